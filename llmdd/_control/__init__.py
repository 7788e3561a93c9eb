"""The control plane: links to peer clusters and everything that carries them.

- :mod:`.settings`: the link options (keepalive, timeouts, TLS, caps) parsed once per engine;
- :mod:`.connection`: a control connection, a socket carrying protocol frames on the I/O loop;
- :mod:`.link`: the record of one link (its machine, its connection, its tables and counters);
- :mod:`.listener`: listening sockets, what they accept and what they refuse at once;
- :mod:`.manager`: the link manager: handshakes, table exchange, requests, keepalive, unlink.

A link's state is decided in :mod:`llmdd._lifecycle`; this package does the I/O and fires the
outcome triggers.  What the bytes mean is :mod:`llmdd._protocol` (sans-io); time, threads and sockets
come from :mod:`llmdd._runtime`; the data plane is reached only through ``llmdd._protocol.port``.
"""
