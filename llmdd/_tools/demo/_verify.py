"""Bit-for-bit checks of the decoder's KV and tokens against the single-process reference.

The reference KV (every tensor's prompt tokens, in token order) is published by the
parent in a shared-memory segment; a decoder attaches to it and compares its own
pulled blocks byte by byte, so a mismatch is located exactly (tensor, token, head,
element, byte) and nothing is hashed or sampled.
"""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import Sequence

import numpy as np

from llmdd._tools.demo.model import PagedKVCache

__all__ = ["ReferenceKV", "compare_kv", "describe_location"]


class ReferenceKV:
    """The reference's prompt KV ``[2 * n_layers, prompt_len, kv_heads, head_dim]`` in shared memory."""

    def __init__(self, kv: np.ndarray) -> None:
        self.shape = tuple(int(x) for x in kv.shape)
        self._shm = shared_memory.SharedMemory(create=True, size=max(1, kv.nbytes))
        np.ndarray(self.shape, dtype=np.float32, buffer=self._shm.buf)[...] = kv

    @property
    def handle(self) -> dict:
        return {"name": self._shm.name, "shape": self.shape}

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None


def _attach(handle: dict):
    # spawned children share the parent's resource tracker, which forgets the segment when the
    # parent unlinks it: attaching here needs no bookkeeping of its own
    shm = shared_memory.SharedMemory(name=handle["name"])
    return shm, np.ndarray(tuple(handle["shape"]), dtype=np.float32, buffer=shm.buf)


def describe_location(shape: Sequence[int], flat_byte: int) -> dict:
    """Where byte ``flat_byte`` of a ``[tensors, tokens, heads, dim]`` float32 array is."""
    element, byte = divmod(int(flat_byte), 4)
    tensor, token, head, dim = (int(x) for x in np.unravel_index(element, tuple(shape)))
    return {"tensor": tensor, "layer": tensor // 2, "kv": "K" if tensor % 2 == 0 else "V",
            "token": token, "head": head, "dim": dim, "byte": byte}


def compare_kv(kv: PagedKVCache, table: Sequence[int], prompt_len: int, reference: dict) -> dict:
    """Compare the first ``prompt_len`` tokens of every tensor in ``kv`` at ``table`` with the reference."""
    shm, ref = _attach(reference)
    try:
        if ref.shape[0] != kv.num_tensors or ref.shape[1] != prompt_len:
            return {"equal": False, "bytes": 0, "differing_bytes": None,
                    "why": f"reference shape {ref.shape} does not match {kv.num_tensors} tensors x {prompt_len}"}
        differing = 0
        first = None
        per_tensor = ref[0].nbytes
        for i in range(kv.num_tensors):
            mine = kv.gather(i, table, prompt_len)
            diff = np.flatnonzero(np.ascontiguousarray(mine).view(np.uint8).reshape(-1)
                                  != ref[i].view(np.uint8).reshape(-1))
            if diff.size:
                differing += int(diff.size)
                if first is None:
                    first = describe_location(ref.shape, i * per_tensor + int(diff[0]))
        return {"equal": differing == 0, "bytes": int(ref.nbytes), "differing_bytes": differing, "first": first}
    finally:
        del ref
        shm.close()
