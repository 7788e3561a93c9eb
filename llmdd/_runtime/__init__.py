"""The engine's runtime: its one source of time, timers, waiting, threads and sockets.

- :mod:`.runtime`: the seam (:class:`~.runtime.Runtime` and what it hands out: waiters, executors,
  timers), what every layer above names when it needs a clock, a timer, a thread or a socket;
- :mod:`.ioloop`: the real implementation (:class:`~.ioloop.IoLoop`, a ``selectors`` loop thread, and its
  bounded :class:`~.ioloop.Pool` and FIFO :class:`~.ioloop.Strand`).

A deterministic simulation of the same seam (``llmdd/testing/_linksim.py``) runs the link protocol's
unit tests on one thread and a fake clock.  This package imports nothing of llmdd above ``_base``.
"""
