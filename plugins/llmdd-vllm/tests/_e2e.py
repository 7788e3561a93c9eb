"""Shared parts of the vLLM end-to-end tests: models, prompts, instance start-up, checks."""

from __future__ import annotations

import math
import os
import time
from typing import Callable

import numpy as np

from llmdd_vllm.instance import Instance
from llmdd_vllm.tinymodel import write_tiny_llama

BLOCK = 32
MAX_TOKENS = 12
#: 8+ prompts, none a multiple of the block size (partial last blocks are transferred too)
LENGTHS = (33, 47, 61, 70, 95, 101, 130, 201, 250)
NICE = 10
START_TIMEOUT_S = 900          # two or three vLLM instances starting at once on a loaded 2-core machine


def prompts(seed: int, lengths=LENGTHS) -> list:
    rng = np.random.default_rng(seed)
    out = [rng.integers(3, 500, n).tolist() for n in lengths]
    assert all(len(p) % BLOCK for p in out)
    return out


def models(root: str) -> tuple:
    """(model A, model B): B differs from A only in its attention projections."""
    a = write_tiny_llama(os.path.join(root, "model_a"), seed=11)
    b = write_tiny_llama(os.path.join(root, "model_b"), seed=11, attn_seed=12)
    return a, b


def log_dir(default: str) -> str:
    """Where the instances' logs go: ``LLMDD_VLLM_TEST_LOGS`` (kept, e.g. by scripts/test_vllm.sh), else ``default``."""
    d = os.environ.get("LLMDD_VLLM_TEST_LOGS") or default
    os.makedirs(d, exist_ok=True)
    return d


def start(model: str, role: str, log_dir: str, name: str, **kw) -> Instance:
    return Instance(model, role=role, log_path=os.path.join(log_dir, f"{name}.log"), nice=NICE,
                    start_timeout_s=START_TIMEOUT_S, wait=False, **kw)


def prefill(inst: Instance, ps: list) -> list:
    """Run the prompts as prefill requests (max_tokens=1, do_remote_decode); their kv_transfer_params."""
    out = inst.call(op="generate", prompts=ps, max_tokens=1, params=[{"do_remote_decode": True}] * len(ps))
    kv = [r["kv_transfer_params"] for r in out["results"]]
    assert all(k and k["do_remote_prefill"] and k["remote_block_ids"] for k in kv), kv
    return kv


def blocks_of(ps: list) -> int:
    return sum(math.ceil(len(p) / BLOCK) for p in ps)


def wait_for(fn, what: str, timeout: float = 60.0, every: float = 0.25):
    """Poll ``fn()`` until it returns a truthy value, or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout} s (last: {got!r})")
        time.sleep(every)


def counters(inst: Instance) -> dict:
    (c,) = inst.call(op="counters")["workers"]
    return c


def by_source(inst: Instance) -> dict:
    return dict(inst.call(op="metrics").get("prompt_tokens_by_source", {}))


def kv_usage(inst: Instance) -> float:
    """vLLM's KV cache usage of ``inst`` at rest: a one-token local request runs (so the instance
    steps and reports its gauge) and has ended when the value is read; blocks held by anything
    else (a leak, a prefill's handed-over requests) show as usage above the idle value."""
    inst.call(op="generate", prompts=[[7, 8, 9]], max_tokens=1)
    return float(inst.call(op="metrics")["kv_cache_usage"])


def delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


def generate(inst: Instance, ps: list, params: "list | None" = None) -> list:
    """Each prompt's greedy tokens on ``inst``; with ``params``, each prompt's kv_transfer_params."""
    kw = {} if params is None else {"params": params}
    return [r["tokens"] for r in inst.call(op="generate", prompts=ps, max_tokens=MAX_TOKENS, **kw)["results"]]


def transfer_equals_local_run(d: Instance, ps: list, kv: list, counters: "Callable[[Instance], object] | None" = counters
                              ) -> tuple:
    """Run ``ps`` on the decode instance ``d`` with the prefill's ``kv`` (the transfer run), then as
    the single-instance run (the same instance computes each prompt itself): the tokens are equal,
    the weights are not degenerate (the outputs vary within and across prompts), and vLLM's own
    metrics say every prompt token of the transfer run came by external KV transfer, none computed
    locally, while the single-instance run computed them all.  ``counters(d)`` before and after the
    transfer run (None, None without ``counters``: a connector other than llmdd's has none)."""
    count = counters or (lambda inst: None)
    src0, c0 = by_source(d), count(d)
    got = generate(d, ps, kv)
    src1, c1 = by_source(d), count(d)
    ref = generate(d, ps)
    src2 = by_source(d)
    assert got == ref
    assert all(len(set(t)) >= MAX_TOKENS // 2 for t in ref), ref
    assert len({tuple(t) for t in ref}) == len(ref)
    n = sum(len(x) for x in ps)
    assert delta(src1, src0) == {"external_kv_transfer": n, "local_compute": 0, "local_cache_hit": 0}
    assert delta(src2, src1) == {"external_kv_transfer": 0, "local_compute": n, "local_cache_hit": 0}
    return c0, c1


def control_prefill_changes_every_output(p_other: Instance, d: Instance, ps: list) -> None:
    """The control: a prefill instance whose attention weights differ.  The decode instance uses its
    KV (every prompt token by transfer, none computed), so every output differs from ``d``'s own run:
    the tokens depend on the transferred KV."""
    ref = generate(d, ps)
    kv = prefill(p_other, ps)
    src0 = by_source(d)
    got = generate(d, ps, kv)
    src1 = by_source(d)
    assert delta(src1, src0)["external_kv_transfer"] == sum(len(x) for x in ps)
    assert delta(src1, src0)["local_compute"] == 0
    assert all(g != r for g, r in zip(got, ref)), (got, ref)
