"""Small local Llama checkpoints with seeded random weights, for tests, the example and benchmarks.

vLLM loads them from a directory (``config.json`` + ``model.safetensors``); no tokenizer, no
download.  ``load_format="dummy"`` is not used on purpose: it fills every tensor from one fixed
seed and the model then repeats one token, so a token comparison would prove nothing.  These
weights are drawn from ``numpy.random.default_rng(seed)`` and scaled so that outputs vary from
prompt to prompt.  ``attn_seed`` (default ``seed``) draws the attention projections from another
stream: two checkpoints that differ only there compute different KV for the same prompt.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np


def write_tiny_llama(path: str, *, seed: int = 0, attn_seed: Optional[int] = None, layers: int = 2,
                     hidden: int = 128, heads: int = 4, kv_heads: int = 2, intermediate: int = 256,
                     vocab: int = 512, max_positions: int = 4096, dtype: str = "float32") -> str:
    """Write a LlamaForCausalLM checkpoint into ``path`` (created); returns ``path``.

    The head size is ``hidden // heads`` (vLLM's CPU attention backend supports 32, 64, 80, 96,
    112, 128, ...)."""
    from safetensors.numpy import save_file

    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be a multiple of heads, heads a multiple of kv_heads")
    head = hidden // heads
    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head,
        "vocab_size": vocab, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    rng = np.random.default_rng(seed)
    arng = rng if attn_seed is None else np.random.default_rng([attn_seed, 7919])
    np_dtype = np.float32 if dtype == "float32" else np.float16

    def mat(r, rows, cols, scale=None):
        s = (1.0 / np.sqrt(cols)) if scale is None else scale
        return (r.standard_normal((rows, cols)) * s).astype(np_dtype)

    t = {"model.embed_tokens.weight": mat(rng, vocab, hidden, 1.0),
         "model.norm.weight": np.ones(hidden, np_dtype),
         "lm_head.weight": mat(rng, vocab, hidden, 4.0 / np.sqrt(hidden))}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(hidden, np_dtype)
        t[p + "post_attention_layernorm.weight"] = np.ones(hidden, np_dtype)
        t[p + "self_attn.q_proj.weight"] = mat(arng, heads * head, hidden, 2.0 / np.sqrt(hidden))
        t[p + "self_attn.k_proj.weight"] = mat(arng, kv_heads * head, hidden, 2.0 / np.sqrt(hidden))
        t[p + "self_attn.v_proj.weight"] = mat(arng, kv_heads * head, hidden)
        t[p + "self_attn.o_proj.weight"] = mat(arng, hidden, heads * head)
        t[p + "mlp.gate_proj.weight"] = mat(rng, intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = mat(rng, intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = mat(rng, hidden, intermediate)
    save_file(t, os.path.join(path, "model.safetensors"))
    return path
