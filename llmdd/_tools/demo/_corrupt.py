"""The demo's self-test: flip one byte of the pulled KV before the check, to prove the check bites.

Enabled by ``llmdd demo --corrupt-kv`` or the environment variable ``LLMDD_DEMO_CORRUPT_KV=1``;
only the first decoder corrupts its copy.
"""

from __future__ import annotations

import os
from typing import Sequence

from llmdd._tools.demo.model import PagedKVCache

__all__ = ["ENV_CORRUPT", "corrupt_requested", "default_spot", "flip_byte"]

ENV_CORRUPT = "LLMDD_DEMO_CORRUPT_KV"


def corrupt_requested(flag: bool) -> bool:
    return bool(flag) or os.environ.get(ENV_CORRUPT, "").strip().lower() in ("1", "true", "yes", "on")


def default_spot(prompt_len: int) -> dict:
    """Layer 0's K, the middle prompt token, head 0, element 0, its high byte (sign and exponent)."""
    return {"tensor": 0, "token": prompt_len // 2, "head": 0, "dim": 0, "byte": 3}


def flip_byte(kv: PagedKVCache, table: Sequence[int], prompt_len: int, *, tensor: int, token: int, head: int,
              dim: int, byte: int) -> dict:
    """XOR one byte of the cached KV with 0xFF, in place; returns where and what changed."""
    if not 0 <= token < prompt_len:
        raise ValueError(f"token {token} is outside the prompt (0..{prompt_len - 1})")
    bs = kv.config.block_size
    block, row = int(table[token // bs]), token % bs
    cell = kv.tensors[tensor][block, row, head, dim:dim + 1].view("u1")
    old = int(cell[byte])
    cell[byte] = old ^ 0xFF
    return {"tensor": tensor, "layer": tensor // 2, "kv": "K" if tensor % 2 == 0 else "V", "token": token,
            "head": head, "dim": dim, "byte": byte, "block": block, "old": old, "new": int(cell[byte])}
