"""What the CLI and the bench tell a user (issue 41's smaller frictions): ``--version`` on one line, an
``ip:port`` whose port is out of range named as such, the bench's progress through its last phases, and
a ``--quick`` run's plots and verdicts labelled as indicative."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

from llmdd import LLMConfig, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from llmdd._base.options import parse_listen_ip_info
from llmdd._tools.bench import report

from llmdd._tools.bench.runner import Options, Sizes, late_phases, run_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_bench_report import _run  # noqa: E402  (a seeded results.json-shaped run)

pytestmark = pytest.mark.timeout(120)


def _llmdd(*argv: str, columns: int = 40) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS=str(columns), LLMDD_DISABLED_PLUGINS="ucx")
    return subprocess.run([sys.executable, "-m", "llmdd", *argv], capture_output=True, text=True, env=env)


def test_version_is_one_line_however_narrow_the_terminal():
    import llmdd

    for argv in (["--version"], ["info", "--version"]):
        proc = _llmdd(*argv, columns=40)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert len(lines) == 1, proc.stdout        # argparse's own action wrapped this at 40 columns
        assert lines[0].startswith("llmdd ") and lines[0].endswith(f", {os.path.dirname(llmdd.__file__)})")


@pytest.mark.parametrize("value, said", [
    ("127.0.0.1:70000", "llm.listenIpInfo has port 70000, out of range (a port is 0..65535), but got "
                        "'127.0.0.1:70000'."),
    ("127.0.0.1:65536", "llm.listenIpInfo has port 65536, out of range (a port is 0..65535), but got "
                        "'127.0.0.1:65536'."),
    ("127.0.0.1", "llm.listenIpInfo must be in the form ip:port, but got '127.0.0.1'."),
    ("127.0.0.1:x", "llm.listenIpInfo must be in the form ip:port, but got '127.0.0.1:x'."),
    (":26000", "llm.listenIpInfo must be in the form ip:port, but got ':26000'."),
])
def test_a_port_out_of_range_is_named_as_such_not_as_a_malformed_address(value, said):
    with pytest.raises(LLMException) as err:
        parse_listen_ip_info(value)
    assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert str(err.value) == said
    assert parse_listen_ip_info("127.0.0.1:65535") == ("127.0.0.1", 65535)   # the edge is legal (control)


def test_init_refuses_a_port_out_of_range_with_that_reason():
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    cfg.listen_ip_info = "127.0.0.1:70000"
    dd = LLMDataDist(LLMRole.PROMPT, 41)
    with pytest.raises(LLMException) as err:
        dd.init(cfg.generate_options())
    assert err.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "port 70000, out of range" in str(err.value)


def test_doctor_names_the_port_out_of_range():
    proc = _llmdd("doctor", "--listen", "127.0.0.1:70000", "--seconds", "0", columns=200)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "'127.0.0.1:70000' has port 70000, out of range (a port is 0..65535)" in proc.stdout, proc.stdout
    assert "not an ip:port address" not in proc.stdout
    proc = _llmdd("doctor", "--listen", "127.0.0.1", "--seconds", "0", columns=200)   # control: malformed
    assert "'127.0.0.1' is not an ip:port address" in proc.stdout, proc.stdout


def test_bench_progress_shows_each_late_phase_and_is_full_only_at_the_end(capsys):
    opts = Options(sizes=Sizes.quick(), transports=[], skip={"anchors", "idle", "scaling", "cpp"})
    assert late_phases(opts) == ["control"]
    results = run_bench(opts)
    assert "control" in results and not results["errors"]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert "  0/1 " in lines[0] and lines[0].endswith("control: the bulk control notice's encode/decode cost ...")
    assert "  1/1 " in lines[1] and lines[1].endswith("control: done")
    assert late_phases(Options(sizes=Sizes.quick())) == ["idle", "control", "cpp"]   # quick sizes: no scaling
    assert late_phases(Options(sizes=Sizes())) == ["idle", "control", "scaling", "cpp"]


def _titles(monkeypatch) -> dict:
    """Every saved figure's titles (suptitle and each axes' title), by file name."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    seen: dict = {}
    save = Figure.savefig

    def spy(fig, fname, *args, **kwargs):
        sup = fig._suptitle.get_text() if fig._suptitle is not None else ""
        seen[os.path.basename(str(fname))] = [sup] + [ax.get_title() for ax in fig.axes]
        return save(fig, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return seen


def test_plots_of_a_quick_run_say_so_in_every_figure(tmp_path, monkeypatch):
    seen = _titles(monkeypatch)
    for d in ("q", "f", "m"):
        (tmp_path / d).mkdir()
    quick = _run(12)
    quick["meta"]["quick"] = True
    made = report.plots([quick], str(tmp_path / "q"))
    assert made["note"] == "--quick sizes: indicative only (targets are judged on full runs)"
    assert sorted(seen) == sorted(made["files"]) and len(seen) == 3
    for name, titles in seen.items():
        assert any(made["note"] in t for t in titles), (name, titles)
    seen.clear()
    full = report.plots([_run(12)], str(tmp_path / "f"))                       # control: a full run
    assert full["note"] == "" and len(seen) == 3
    assert not any("--quick" in t for titles in seen.values() for t in titles), seen
    seen.clear()
    mixed = report.plots([copy.deepcopy(quick), _run(13)], str(tmp_path / "m"))
    assert mixed["note"] == "1 of 2 runs at --quick sizes: indicative only"


def test_targets_of_a_quick_run_say_a_verdict_counts_from_a_full_run():
    quick = _run(14)
    quick["meta"]["quick"] = True
    note = ("  --quick sizes: the figures are indicative only; a verdict (MET / NOT MET) counts from a full run "
            "(`llmdd bench` without --quick), so a NOT MET here is no cause for concern by itself")
    for run, expected in ((quick, True), (_run(14), False)):
        rows = report.ratios(run)
        lines = report.table(run, rows, report.targets(run, rows))
        at = lines.index("targets (llmdd/_tools/bench/targets.toml):")
        assert (lines[at + 1] == note) is expected, lines[at:at + 3]


def test_demo_accepts_every_standard_transport_and_every_one_info_lists_available():
    """``llmdd demo --transport`` and ``llmdd info`` agree: each standard transport, and each other one info
    lists as available here, can be forced.  A transport info lists as unavailable beside them (the
    simulator's ``sim`` outside a simulation: no fabric in this process) cannot run the demo's two
    processes, so the demo need not take it."""
    from llmdd._tools import doctor as d
    from llmdd._tools.cli import build_parser
    from llmdd._tools.demo.runner import DemoOptions

    info = d.collect_info()["transports"]
    listed = [t["name"] for t in info if t["available"] or t["name"] in ("shm", "tcp", "ucx")]
    assert {"shm", "tcp", "ucx"} <= set(listed), listed
    parser = build_parser()
    for name in listed:
        assert parser.parse_args(["demo", "--transport", name]).transport == name
        DemoOptions(transport=name).check()
    with pytest.raises(SystemExit):                                   # control: a name nobody registers
        parser.parse_args(["demo", "--transport", "carrier-pigeon"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_runs_over_ucx_when_info_lists_it_available():
    from llmdd._tools import doctor as d

    ucx = next(t for t in d.collect_info()["transports"] if t["name"] == "ucx")
    if not ucx["available"]:
        pytest.skip(f"ucx is not available here: {ucx['reason']}")
    env = dict(os.environ)
    env.pop("LLMDD_DEMO_CORRUPT_KV", None)
    proc = subprocess.run([sys.executable, "-m", "llmdd", "demo", "--quick", "--transport", "ucx"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "transport ucx: forced by option (ucx)" in proc.stdout
    assert "check decoder 1: KV 16.0 MiB bit-identical; tokens identical (8/8)" in proc.stdout


_WITHOUT_NIXL = """
import sys
from llmdd_ucx import _nixl
for name in _nixl.PACKAGES:
    sys.modules[name] = None          # as after `pip install llmdd[all]`: the ucx plugin, no NIXL
from llmdd._tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_info_doctor_and_demo_say_how_to_make_ucx_available_without_nixl():
    env = dict(os.environ, COLUMNS="200")
    env.pop("LLMDD_DISABLED_PLUGINS", None)

    def cli(*argv):
        return subprocess.run([sys.executable, "-c", _WITHOUT_NIXL, *argv], capture_output=True, text=True, env=env)

    fix = ("fix: pip install --no-deps nixl-cu12 (NIXL, this transport's engine: `llmdd[ucx]` and `llmdd[all]` do "
           "not pull it in, because its wheel requires torch and CUDA wheels that llmdd does not need)")
    info = cli("info")
    assert info.returncode == 0, info.stderr
    lines = info.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("  ucx      unavailable"))
    assert lines[at + 1].strip() == fix, lines[at:at + 2]
    doctor = cli("doctor", "--seconds", "0")
    assert "installed but unavailable: NIXL is not installed" in doctor.stdout, doctor.stdout
    assert fix in doctor.stdout, doctor.stdout
    demo = cli("demo", "--quick", "--transport", "ucx")
    assert demo.returncode == 1 and demo.stderr.startswith("llmdd demo: --transport ucx is not available here: "
                                                           "NIXL is not installed"), demo.stderr
    # control: with NIXL importable (this venv has it), info shows no fix line under ucx
    plain = subprocess.run([sys.executable, "-m", "llmdd", "info"], capture_output=True, text=True, env=env)
    assert "  ucx      available" in plain.stdout and fix not in plain.stdout, plain.stdout


def test_bench_cpp_row_says_what_to_do_in_a_checkout_and_from_a_wheel(monkeypatch, tmp_path):
    from llmdd._tools.bench import cpp

    monkeypatch.delenv("LLMDD_CPP_BUILD", raising=False)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert cpp._REPO == root                                     # a checkout: its own cpp/build
    assert cpp.not_built_reason().startswith("C++ library not built: no cpp/build/tests/bench_pull (run "
                                             "`bash scripts/test_cpp.sh`")
    monkeypatch.setattr(cpp, "_REPO", str(tmp_path))             # an installed wheel: no cpp/ beside llmdd
    reason = cpp.not_built_reason()
    assert reason.startswith("the C++ API is not part of an installed llmdd (a wheel ships no C++ sources)")
    assert "LLMDD_CPP_BUILD=<checkout>/cpp/build llmdd bench" in reason and "scripts/test_cpp.sh" in reason
    monkeypatch.setenv("LLMDD_CPP_BUILD", str(tmp_path / "nowhere"))
    assert cpp._binary() is None
    assert f"LLMDD_CPP_BUILD={tmp_path / 'nowhere'}" in cpp.not_built_reason()
