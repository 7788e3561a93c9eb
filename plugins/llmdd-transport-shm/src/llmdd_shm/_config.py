"""The shm transport's options (``llmdd.shm.*``) and their defaults."""

from __future__ import annotations

from typing import Union

OPT_THREADS = "llmdd.shm.threads"
OPT_SPLIT = "llmdd.shm.split_min_bytes"
OPT_CHUNK = "llmdd.shm.chunk_bytes"
#: "auto" (the C hot path when it is built), "off" (pure Python), "on" (refuse to open without it)
OPT_NATIVE = "llmdd.shm.native"
#: native batches of at most this many bytes keep the GIL for the copy (no thread hand-off after it)
OPT_GIL = "llmdd.shm.native_gil_bytes"
DEFAULTS: dict[str, Union[int, str]] = {OPT_THREADS: 2, OPT_SPLIT: 8 * 1024 * 1024, OPT_CHUNK: 8 * 1024 * 1024,
                                         OPT_NATIVE: "auto", OPT_GIL: 256 * 1024}
