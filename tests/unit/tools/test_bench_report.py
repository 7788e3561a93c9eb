"""The bench's targets file, its verdicts over one and several runs, the markdown report, the peers'
results and the plots."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from llmdd._tools.bench import report, targets
from llmdd._tools.bench.peers import load_peers

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MiB = 1 << 20


def _run(seed: int, transports=("shm", "tcp"), decoders=(1, 2, 4, 8)) -> dict:
    """A results.json-shaped run with seeded random figures."""
    rng = np.random.default_rng(seed)

    def bw():
        return {"median": float(rng.uniform(1, 12)), "n": 5, "verified": True}

    def lat():
        p50 = float(rng.uniform(10, 500))
        return {"p50": p50, "median": p50, "p99": p50 * 3, "n": 100, "verified": True,
                "hist": {"edges": [1.0, 10.0, 100.0, 1000.0], "counts": [1, 50, 40]}}

    anchors = {k: bw() for k in ("memcpy", "gather_64k", "gather_16k", "cma_contiguous", "cma_64k", "cma_16k",
                                 "tcp_1stream", "tcp_2stream")}
    anchors["cma_latency_64k"] = lat()
    anchors["tcp_rr_64k"] = lat()
    tr = {}
    for t in transports:
        figs = {f: bw() for f in ("pull_blocks_64k", "push_blocks_64k", "pull_blocks_16k", "push_blocks_16k",
                                  "transfer_cache_async_64k", "pull_cache")}
        figs["latency_64k"] = lat()
        figs["decoders"] = {}
        for n in decoders:
            per = rng.uniform(1, 10, n).tolist()
            figs["decoders"][str(n)] = {"aggregate_gbps": float(sum(per)), "per_decoder_gbps": per,
                                        "mean_gbps": float(np.mean(per)), "min_gbps": min(per), "verified": True}
        figs["links"] = {"idle": {"rss_after_init": int(rng.integers(30, 60)) * MiB, "delta_bytes": 10 * MiB},
                         "points": [{"links": n, "delta_bytes": int(rng.integers(1, 30)) * MiB,
                                     "marginal_per_link_bytes": float(rng.uniform(1, 128)) * 1024}
                                    for n in (1, 2, 4, 8)]}
        figs["idle_engine"] = {"rss_bytes": int(rng.integers(30, 60)) * MiB}
        if t == "shm":
            figs["small"] = {r: {"ratio_p50": float(rng.uniform(1, 20))}
                             for r in ("pull_1x64k", "push_1x64k", "pull_8x2x16k")}
        tr[t] = figs
    return {"meta": {"started_utc": f"2026-12-01T0{seed % 10}:00:00Z", "load_before": [1.0, 2.0, 3.0],
                     "load_after": [2.0, 2.0, 3.0], "elapsed_s": 100.0, "sizes": {"kv_bytes": 1 << 30,
                                                                                   "contiguous_bytes": 1 << 30}},
            "anchors": anchors, "transports": tr, "errors": []}


def test_targets_file_loads_and_every_row_says_where_it_comes_from():
    rows = targets.load()
    ids = [t.id for t in rows]
    assert len(ids) == len(set(ids)) and len(ids) >= 15
    for t in rows:
        assert re.fullmatch(r"issue \d+|v1|ceiling", t.source), t
        assert t.op in (">=", ">", "<=", "<") and t.bound > 0, t
        for path in t.paths("shm"):
            assert path.split(".")[0] in ("transports", "anchors", "peers", "control"), path
    # issue 22's targets 1-3 are all there, with their goals
    want = {"22.1-gather": ">= 1.15", "22.1-cma16": ">= 1.0", "22.1-push64": ">= 1.0", "22.1-decoders": ">= 1.0",
            "22.2-cma64": ">= 0.9", "22.2-nixl": ">= 1.5", "22.3-tcp": ">= 0.9"}
    got = {t.id: t.goal for t in rows}
    assert {k: got.get(k) for k in want} == want


@pytest.mark.parametrize("bad, message", [
    ('[[target]]\nid="a"\nsource="v1"\ntitle="x"\nvalue="anchors.memcpy.median"\ngoal="=> 1"\n', "not '<op>"),
    ('[[target]]\nid="a"\nsource="v1"\ntitle="x"\nvalue="anchors.memcpy.median"\ngoal=">= one"\n', "not a number"),
    ('[[target]]\nid="a"\nsource="v1"\ntitle="x"\ngoal=">= 1"\n', "missing 'value'"),
    ('[[target]]\nid="a"\nsource="v1"\ntitle="x"\nvalue="a / b / c"\ngoal=">= 1"\n', "at most one"),
    ('[[target]]\nid="a"\nsource="v1"\ntitle="x"\nvalue="a"\ngoal=">= 1"\n' * 2, "duplicate"),
])
def test_a_malformed_targets_file_is_refused(tmp_path, bad, message):
    p = tmp_path / "t.toml"
    p.write_text(bad)
    with pytest.raises(targets.TargetsError, match=re.escape(message)):
        targets.load(str(p))


def test_one_run_verdicts_compute_the_named_ratio():
    run = _run(1)
    rows = {(r["id"], r["transport"]): r for r in targets.evaluate(run)}
    got = rows[("22.1-gather", "shm")]
    want = run["transports"]["shm"]["pull_blocks_64k"]["median"] / run["anchors"]["gather_64k"]["median"]
    assert got["value"] == pytest.approx(want)
    assert got["met"] is (want >= 1.15)
    idle = rows[("22.5-idle", "tcp")]
    assert idle["value"] == pytest.approx(run["transports"]["tcp"]["idle_engine"]["rss_bytes"] / MiB)
    assert idle["met"] is (idle["value"] <= 45)
    link = rows[("22.5-link", "shm")]
    assert link["value"] == pytest.approx(run["transports"]["shm"]["links"]["points"][-1]["marginal_per_link_bytes"]
                                          / 1024)
    # a transport this run did not measure has no rows; a figure it did not measure is "not measured"
    assert not any(t == "ucx" for _, t in rows)
    nixl = [r for r in targets.evaluate(dict(run, transports=dict(run["transports"], ucx=run["transports"]["tcp"])))
            if r["id"] == "22.2-nixl"]
    assert nixl[0]["value"] is None and nixl[0]["met"] is None
    assert "peers.values.nixl_kv64" in nixl[0]["note"]


def test_a_quick_run_is_marked_and_missing_decoders_are_not_measured():
    run = _run(2, decoders=(1, 2))
    run["meta"]["quick"] = True
    rows = {(r["id"], r["transport"]): r for r in targets.evaluate(run)}
    assert rows[("22.1-gather", "shm")]["note"] == "--quick sizes"
    dec = rows[("22.1-decoders", "shm")]
    assert dec["value"] is None and dec["met"] is None and "decoders.8" in dec["note"]


def test_several_runs_give_the_median_and_keep_every_run():
    runs = [_run(s) for s in (3, 4, 5)]
    runs[1]["transports"]["shm"].pop("small")  # one run without the small rows
    rows = {(r["id"], r["transport"]): r for r in targets.aggregate(runs)}
    g = rows[("22.1-gather", "shm")]
    each = [r["transports"]["shm"]["pull_blocks_64k"]["median"] / r["anchors"]["gather_64k"]["median"] for r in runs]
    assert g["values"] == pytest.approx(each)
    assert g["value"] == pytest.approx(sorted(each)[1])
    assert g["met"] is (sorted(each)[1] >= 1.15) and g["runs_measured"] == 3
    s = rows[("21.1-pull", "shm")]
    assert s["values"][1] is None and s["runs_measured"] == 2
    assert s["value"] == pytest.approx(np.median([runs[0]["transports"]["shm"]["small"]["pull_1x64k"]["ratio_p50"],
                                                  runs[2]["transports"]["shm"]["small"]["pull_1x64k"]["ratio_p50"]]))
    assert s["note"] == "1 of 3 runs did not measure it"


def test_markdown_report_lists_runs_figures_and_verdicts():
    runs = [_run(s) for s in (6, 7, 8)]
    names = ["a/results.json", "b/results.json", "c/results.json"]
    lines = report.markdown(copy.deepcopy(runs), names)
    text = "\n".join(lines)
    assert text.startswith("Generated by `llmdd bench --report a/results.json b/results.json c/results.json "
                           "--markdown`")
    for n in names:
        assert f"| `{n}` |" in text
    v = [r["transports"]["shm"]["pull_blocks_64k"]["median"] for r in runs]
    assert f"| pull_blocks KV 64 KiB blocks | {sorted(v)[1]:.2f} GB/s ({v[0]:.2f}, {v[1]:.2f}, {v[2]:.2f})" in text
    agg = {(r["id"], r["transport"]): r for r in targets.aggregate(runs)}
    g = agg[("22.1-gather", "shm")]
    row = [ln for ln in lines if ln.startswith("| 22.1-gather |")][0]
    assert row.endswith("| **met** |" if g["met"] else "| **not met** |"), row
    assert "Every moved byte verified in every run." in text
    # a run with an unverified byte is named
    runs[1]["transports"]["tcp"]["pull_cache"]["verified"] = False
    assert "Runs with a byte that did not verify: `b/results.json`." in "\n".join(report.markdown(runs, names))


def test_peers_lines_are_read_by_name_and_status_kept(tmp_path):
    (tmp_path / "nixl_peer.jsonl").write_text(
        json.dumps({"name": "nixl_kv64", "median": 2.5, "verified": True}) + "\n"
        + json.dumps({"name": "nixl_peer: set-up", "unit": "info", "seconds": 3}) + "\nnot json\n"
        + json.dumps({"name": "nixl_kv64", "median": "fast"}) + "\n")
    (tmp_path / "status.txt").write_text("run_peers.sh 2026-12-01T00:00:00Z load 1.0 2.0 3.0\nmooncake: unavailable\n")
    got = load_peers(str(tmp_path))
    assert got["values"] == {"nixl_kv64": 2.5} and got["verified"] == {"nixl_kv64": True}
    assert got["load"] == "1.0 2.0 3.0" and got["status"][1] == "mooncake: unavailable"
    assert [i["name"] for i in got["info"]] == ["nixl_peer: set-up", "nixl_kv64"]


def test_cli_report_of_several_runs_rewrites_none_and_writes_plots(tmp_path):
    pytest.importorskip("matplotlib")
    paths = []
    for s in (9, 10, 11):
        d = tmp_path / f"run-{s}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps(_run(s)))
        paths.append(str(d / "results.json"))
    before = [open(p).read() for p in paths]
    proc = subprocess.run([sys.executable, "-m", "llmdd", "bench", "--report", *paths, "--markdown", "--plots",
                           str(tmp_path / "img")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n").split("\n") == report.markdown([json.loads(b) for b in before], paths)
    assert [open(p).read() for p in paths] == before
    for png in ("bandwidth_vs_block_size.png", "latency_64k.png", "scaling.png"):
        data = (tmp_path / "img" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000, png
