"""A small decoder-only transformer in numpy (float32) with a paged KV cache.

Embedding, ``n_layers`` x (RMSNorm, multi-head attention with rotary position
embeddings and grouped KV heads, RMSNorm, SwiGLU MLP), final RMSNorm and LM head.
Weights are drawn from a fixed seed (nothing is downloaded), so every process that
builds the model with the same :class:`ModelConfig` holds bit-identical weights.

The KV cache is paged the way vLLM pages it: per layer one K and one V tensor of
shape ``[num_blocks, block_size, num_kv_heads, head_dim]``; a sequence owns a block
table (a list of block ids, in any order) and token ``t`` lives in block
``table[t // block_size]`` at row ``t % block_size``.  The ``2 * n_layers`` tensors
are ordered layer-major (K0, V0, K1, V1, ...) and each starts on a 2 MiB boundary,
as vllm-ascend requires of what it registers with ``register_blocks_cache``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import numpy as np

__all__ = ["ModelConfig", "Model", "PagedKVCache", "ALIGNMENT", "make_prompt", "shuffled_table"]

#: start of every KV tensor (vllm-ascend asserts 2 MiB alignment of registered tensors)
ALIGNMENT = 2 * 1024 * 1024


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the demo model; every field has the default of ``llmdd demo``."""

    vocab_size: int = 4096
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 8
    head_dim: int = 128
    d_ff: int = 1024
    block_size: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_layers < 1 or self.n_heads < 1 or self.n_kv_heads < 1:
            raise ValueError("n_layers, n_heads and n_kv_heads must be positive")
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embeddings rotate pairs)")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in bytes."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 4

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one tensor."""
        return self.block_size * self.n_kv_heads * self.head_dim * 4

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def with_seed(self, seed: int) -> "ModelConfig":
        return replace(self, seed=seed)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(var + np.float32(eps))) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - np.max(x, axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= np.sum(x, axis=-1, keepdims=True)
    return x


class PagedKVCache:
    """``2 * n_layers`` block tensors in one buffer, each 2 MiB aligned; zero-filled."""

    def __init__(self, config: ModelConfig, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        self.config = config
        self.num_blocks = num_blocks
        self.shape = (num_blocks, config.block_size, config.n_kv_heads, config.head_dim)
        self.tensor_bytes = num_blocks * config.block_bytes
        stride = -(-self.tensor_bytes // ALIGNMENT) * ALIGNMENT
        count = 2 * config.n_layers
        self._raw = np.empty(count * stride + ALIGNMENT, dtype=np.uint8)
        self._raw.fill(0)  # touch every page now, as an engine's preallocated KV memory is
        base = (-self._raw.ctypes.data) % ALIGNMENT
        self.tensors: list[np.ndarray] = [
            self._raw[base + i * stride: base + i * stride + self.tensor_bytes].view(np.float32).reshape(self.shape)
            for i in range(count)
        ]

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @property
    def addrs(self) -> list[int]:
        """Tensor addresses, layer-major K0, V0, K1, V1, ... (Python ints, as the API requires)."""
        return [int(t.ctypes.data) for t in self.tensors]

    def k(self, layer: int) -> np.ndarray:
        return self.tensors[2 * layer]

    def v(self, layer: int) -> np.ndarray:
        return self.tensors[2 * layer + 1]

    def write(self, layer: int, table: np.ndarray, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        bs = self.config.block_size
        blocks, rows = table[positions // bs], positions % bs
        self.k(layer)[blocks, rows] = k
        self.v(layer)[blocks, rows] = v

    def gather(self, tensor_index: int, table: Sequence[int], length: int) -> np.ndarray:
        """The first ``length`` tokens of one tensor in token order: ``[length, kv_heads, head_dim]``."""
        t = self.tensors[tensor_index]
        nb = self.config.blocks_for(length)
        return t[np.asarray(table[:nb], dtype=np.int64)].reshape(-1, *self.shape[2:])[:length]

    def gather_all(self, table: Sequence[int], length: int) -> np.ndarray:
        """Every tensor's first ``length`` tokens: ``[2 * n_layers, length, kv_heads, head_dim]``."""
        return np.stack([self.gather(i, table, length) for i in range(self.num_tensors)])

    def byte_view(self, tensor_index: int) -> np.ndarray:
        return self.tensors[tensor_index].reshape(-1).view(np.uint8)


class Model:
    """The demo transformer; ``prefill`` fills a paged cache, ``decode_step`` extends it."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = c = config
        rng = np.random.default_rng(c.seed)

        def w(fan_in: int, *shape: int) -> np.ndarray:
            out = rng.standard_normal(shape, dtype=np.float32)
            out *= np.float32(1.0 / math.sqrt(fan_in))
            return out

        def norm(n: int) -> np.ndarray:
            return (np.float32(1.0) + np.float32(0.1) * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.embed = rng.standard_normal((c.vocab_size, c.d_model), dtype=np.float32)
        self.layers = []
        for _ in range(c.n_layers):
            self.layers.append({
                "attn_norm": norm(c.d_model),
                "wqkv": w(c.d_model, c.d_model, q_dim + 2 * kv_dim),
                "wo": w(q_dim, q_dim, c.d_model),
                "mlp_norm": norm(c.d_model),
                "w_gate_up": w(c.d_model, c.d_model, 2 * c.d_ff),
                "w_down": w(c.d_ff, c.d_ff, c.d_model),
            })
        self.final_norm = norm(c.d_model)
        self.lm_head = w(c.d_model, c.d_model, c.vocab_size)
        half = c.head_dim // 2
        self._inv_freq = (1.0 / (c.rope_theta ** (np.arange(half, dtype=np.float64) * 2.0 / c.head_dim)))

    # -- pieces --------------------------------------------------------------------------
    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate pairs (first half, second half) of ``x: [T, heads, head_dim]`` by position."""
        angles = positions.astype(np.float64)[:, None] * self._inv_freq[None, :]
        cos = np.cos(angles).astype(np.float32)[:, None, :]
        sin = np.sin(angles).astype(np.float32)[:, None, :]
        half = self.config.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def _qkv(self, layer: dict, x: np.ndarray, positions: np.ndarray):
        c = self.config
        h = _rms_norm(x, layer["attn_norm"], c.norm_eps)
        qkv = h @ layer["wqkv"]
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q = qkv[:, :q_dim].reshape(-1, c.n_heads, c.head_dim)
        k = qkv[:, q_dim:q_dim + kv_dim].reshape(-1, c.n_kv_heads, c.head_dim)
        v = qkv[:, q_dim + kv_dim:].reshape(-1, c.n_kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), np.ascontiguousarray(v)

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray) -> np.ndarray:
        """``q: [Tq, H, D]`` over ``k, v: [Tk, KVH, D]`` (token 0..Tk-1), causal by position."""
        c = self.config
        group = c.n_heads // c.n_kv_heads
        qh = q.transpose(1, 0, 2).reshape(c.n_kv_heads, group * q.shape[0], c.head_dim)
        kh = k.transpose(1, 2, 0)                       # [KVH, D, Tk]
        vh = v.transpose(1, 0, 2)                       # [KVH, Tk, D]
        scores = np.matmul(qh, kh) * np.float32(1.0 / math.sqrt(c.head_dim))
        scores = scores.reshape(c.n_kv_heads, group, q.shape[0], k.shape[0])
        future = np.arange(k.shape[0])[None, :] > q_positions[:, None]
        if future.any():
            scores[:, :, future] = -np.inf
        probs = _softmax(scores).reshape(c.n_kv_heads, group * q.shape[0], k.shape[0])
        out = np.matmul(probs, vh).reshape(c.n_heads, q.shape[0], c.head_dim)
        return out.transpose(1, 0, 2).reshape(q.shape[0], c.n_heads * c.head_dim)

    def _mlp(self, layer: dict, x: np.ndarray) -> np.ndarray:
        h = _rms_norm(x, layer["mlp_norm"], self.config.norm_eps)
        gate_up = h @ layer["w_gate_up"]
        f = self.config.d_ff
        return (_silu(gate_up[:, :f]) * gate_up[:, f:]) @ layer["w_down"]

    # -- the two phases ------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], cache: PagedKVCache, table: Sequence[int],
                on_layer: Optional[Callable[[int], None]] = None) -> None:
        """Compute the KV of ``tokens`` (positions 0..T-1) into ``cache`` at ``table``.

        ``on_layer(i)`` runs as soon as layer ``i``'s K and V are in the cache (a layer
        synchronizer releases the layer there).  The prompt side needs no logits: the
        first token is produced by the decoder's first step.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.arange(tokens.shape[0], dtype=np.int64)
        tbl = np.asarray(table, dtype=np.int64)
        x = self.embed[tokens]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            cache.write(i, tbl, positions, k, v)
            if on_layer is not None:
                on_layer(i)
            if i == last:
                # the hidden states of the last layer feed nothing the prompt side needs
                break
            x = x + self._attend(q, k, v, positions) @ layer["wo"]
            x = x + self._mlp(layer, x)

    def decode_step(self, token: int, position: int, cache: PagedKVCache, table: Sequence[int]) -> np.ndarray:
        """Run ``token`` at ``position`` over the cached tokens 0..position-1; returns its logits.

        Writes the token's own K and V at ``position`` (appending to the sequence).
        """
        c = self.config
        tbl = np.asarray(table, dtype=np.int64)
        pos = np.array([position], dtype=np.int64)
        x = self.embed[np.array([token], dtype=np.int64)]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, pos)
            cache.write(i, tbl, pos, k, v)
            keys = cache.gather(2 * i, tbl, position + 1)
            values = cache.gather(2 * i + 1, tbl, position + 1)
            x = x + self._attend(q, keys, values, pos) @ layer["wo"]
            x = x + self._mlp(layer, x)
        h = _rms_norm(x, self.final_norm, c.norm_eps)
        return (h @ self.lm_head)[0]

    def generate(self, prompt: Sequence[int], cache: PagedKVCache, table: Sequence[int], n_tokens: int,
                 on_token: Optional[Callable[[int, int], None]] = None) -> list[int]:
        """Greedy decoding after the prompt's KV is in ``cache``.

        The first step recomputes the last prompt position (as vLLM's disaggregated decode
        does) and yields the first new token; each later step feeds the previous token.
        """
        token, position = int(prompt[-1]), len(prompt) - 1
        out: list[int] = []
        for step in range(n_tokens):
            logits = self.decode_step(token, position, cache, table)
            token = int(np.argmax(logits))
            out.append(token)
            position += 1
            if on_token is not None:
                on_token(step, token)
        return out


def make_prompt(config: ModelConfig, length: int, seed: int) -> list[int]:
    """A deterministic random prompt of ``length`` token ids."""
    rng = np.random.default_rng([seed, 0x5eed])
    return [int(t) for t in rng.integers(0, config.vocab_size, size=length)]


def shuffled_table(num_blocks: int, needed: int, seed) -> list[int]:
    """``needed`` distinct block ids out of ``num_blocks``, in random order (a paged-attention block table)."""
    if needed > num_blocks:
        raise ValueError(f"{needed} blocks needed but only {num_blocks} exist")
    rng = np.random.default_rng(seed)
    return [int(b) for b in rng.permutation(num_blocks)[:needed]]
