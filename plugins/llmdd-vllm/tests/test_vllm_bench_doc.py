"""docs/vllm.md's time-to-first-token tables (issue 20's runs, issue 39's) are what
scripts/vllm_ttft_table.py prints for the committed runs each block names (never typed); needs no vLLM."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
START = re.compile(r"^<!-- generated: (python scripts/vllm_ttft_table\.py .+) -->$")


def test_the_ttft_tables_in_docs_vllm_are_generated_from_the_committed_runs():
    lines = open(os.path.join(ROOT, "docs", "vllm.md")).read().split("\n")
    found = 0
    for i, ln in enumerate(lines):
        m = START.match(ln)
        if not m:
            continue
        end = lines.index("<!-- end generated -->", i)
        args = shlex.split(m.group(1))[2:]
        assert args and all(a.startswith(("bench/results-committed/issue20/", "bench/results-committed/issue39/"))
                            for a in args), args
        out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "vllm_ttft_table.py"), *args],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert lines[i + 1:end] == [""] + out.rstrip("\n").split("\n") + [""]
        found += 1
    assert found == 2       # issue 20's runs, issue 39's


NIXL_START = re.compile(r"^<!-- generated: (python scripts/vllm_ttft_table\.py --nixl .+) -->$")


def test_the_nixl_comparison_in_docs_benchmarks_is_generated_from_the_committed_runs():
    lines = open(os.path.join(ROOT, "docs", "benchmarks.md")).read().split("\n")
    found = 0
    for i, ln in enumerate(lines):
        m = NIXL_START.match(ln)
        if not m:
            continue
        end = lines.index("<!-- end generated -->", i)
        args = shlex.split(m.group(1))[2:]
        assert args[0] == "--nixl" and len(args) > 1
        assert all(a.startswith("bench/results-committed/issue39/nixl/") for a in args[1:]), args
        out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "vllm_ttft_table.py"), *args],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert lines[i + 1:end] == [""] + out.rstrip("\n").split("\n") + [""]
        found += 1
    assert found == 1


def _nixl_run(rng, slow_at: int, local_factor: float, mixed_factor: float) -> dict:
    """A synthetic run of scripts/bench_vllm_vs_nixl.py: LlmddConnector at 0.5x NixlConnector's decode TTFT
    except 1.5x at ``slow_at`` tokens; its local TTFT ``local_factor`` x the instance without a connector."""
    load = {"loadavg_start": [1.0, 1.0, 1.0], "loadavg_end": [2.0, 2.0, 2.0], "wall_s": 1.0}
    rows, mixed, local = [], [], []
    for rep in range(16):
        for n in (256, 2048, 4096):
            x = float(rng.uniform(0.5, 0.6))
            rows.append({"rep": rep, "prompt_tokens": n, "nixl_ttft_s": x, "llmdd_ttft_s": x * (1.5 if n == slow_at else 0.5),
                         "llmdd_prefill_ttft_s": 1.0, "nixl_prefill_ttft_s": 1.0,
                         "llmdd_pull_s": 0.01, "same_first_token": True})
        b = float(rng.uniform(0.07, 0.08))
        local.append({"rep": rep, "prompt_tokens": 100, "llmdd_ttft_s": b * local_factor, "nixl_ttft_s": b, "none_ttft_s": b})
        t = float(rng.uniform(100, 110))
        side = {"prefill_wall_s": 1.0, "decode_wall_s": 1.0, "decode_ttft_s": [0.1, 0.2], "tokens_per_s": t,
                "decode_tokens_per_s": 2 * t}
        mixed.append({"rep": rep, "requests": 2, "prompt_tokens": 300, "output_tokens": 40, "same_tokens": 2,
                      "llmdd": dict(side, tokens_per_s=t * mixed_factor, decode_tokens_per_s=2 * t * mixed_factor),
                      "nixl": side})
    return {"command": "python scripts/bench_vllm_vs_nixl.py --out x.json", "transports": {"0": "shm"},
            "connectors": {"llmdd": "LlmddConnector", "nixl": "NixlConnector"},
            "machine": {"cpus": 2, "loadavg_start": [1.0] * 3, "loadavg_end": [2.0] * 3},
            "model": {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 8, "dtype": "float32", "block_size": 32},
            "phases": {"ttft": load, "mixed": load, "local": load}, "rows": rows, "mixed": mixed, "local": local}


def test_the_nixl_verdicts_follow_the_figures(tmp_path):
    import json

    import numpy as np

    rng = np.random.default_rng(39)
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_nixl_run(rng, slow_at=0, local_factor=1.0, mixed_factor=1.2)))
    # the control: slower at 4096 tokens, 1.2x on a local request, 1.0x throughput: three targets missed
    bad.write_text(json.dumps(_nixl_run(rng, slow_at=4096, local_factor=1.2, mixed_factor=1.0)))

    def run(path):
        return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "vllm_ttft_table.py"), "--nixl", str(path)],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout

    g, b = run(good), run(bad)
    assert "NOT met" not in g and g.count("| met |") == 3 and "target >= 1.1x: met" in g and "target <= 1.05x: met" in g
    rows = {ln.split("|")[1].strip(): ln for ln in b.split("\n") if ln.startswith("| 4096 ") or ln.startswith("| 2048 ")}
    assert "**NOT met**" in rows["4096"] and "| 1.50x |" in rows["4096"] and "| met |" in rows["2048"]
    assert "target >= 1.1x: **NOT met**" in b and "target <= 1.05x: **NOT met**" in b
    # a run at a load above 2 per CPU: the same figures, each verdict marked as standing on a noisy machine
    noisy = _nixl_run(rng, slow_at=0, local_factor=1.0, mixed_factor=1.2)
    for ph in noisy["phases"].values():
        ph["loadavg_end"] = [4.5, 4.5, 4.5]
    path = tmp_path / "noisy.json"
    path.write_text(json.dumps(noisy))
    n = run(path)
    assert n.count("met (indicative: load above 2 per CPU)") == 5 and "NOT met" not in n
