"""The engine's runtime: its one source of time, timers, waiting, threads and sockets.

- :mod:`.runtime`: the seam (:class:`~.runtime.Runtime` and what it hands out: waiters, executors,
  timers), what every layer above names when it needs a clock, a timer, a thread or a socket;
- :mod:`.ioloop` and :mod:`.threads`: the real implementation (:class:`~.ioloop.IoLoop`, a ``selectors``
  loop thread; :class:`~.threads.SystemThreads`, real threads and clock; the bounded
  :class:`~.threads.Pool` and FIFO :class:`~.threads.Strand`).

A deterministic simulation of the same seam, :class:`llmdd.testing.sim.SimRuntime` (docs/simulation-runtime.md),
runs whole engines on one thread and a fake clock (``llmdd/testing/_linksim.py``, its first form, still
runs the link protocol's unit tests).  Only :mod:`.threads` and :mod:`.ioloop` start threads, sleep or
read ``time.monotonic`` (``tests/unit/test_runtime_seam.py``).  This package imports nothing of llmdd
above ``_base``.
"""
