"""Unmodified client code written against ``llm_datadist`` runs on llmdd through the opt-in alias."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLIENTS = pathlib.Path(__file__).resolve().parent / "clients"
ALIAS_SRC = ROOT / "compat" / "llm-datadist-alias" / "src"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ALIAS_SRC), env.get("PYTHONPATH", "")]))
    return env


@pytest.mark.timeout(60)
def test_unmodified_clients_link_and_pull_through_the_alias():
    port = _free_port()
    prompt = subprocess.Popen([sys.executable, str(CLIENTS / "prompt_client.py"), str(port), "11"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env())
    try:
        assert prompt.stdout.readline().strip() == "READY"
        decoder = subprocess.run([sys.executable, str(CLIENTS / "decoder_client.py"), str(port), "11"],
                                 capture_output=True, text=True, env=_env())
        assert decoder.returncode == 0, decoder.stderr
        assert "PULLED OK" in decoder.stdout
        prompt.stdin.write("done\n")
        prompt.stdin.flush()
        assert prompt.wait(timeout=10) == 0
        assert "Traceback" not in prompt.stderr.read()
    finally:
        if prompt.poll() is None:
            prompt.kill()
            prompt.wait()


def test_alias_is_opt_in_and_serves_the_submodules_clients_import():
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('llm_datadist') is None\n"
        "import llmdd.compat\n"
        "llmdd.compat.install_alias()\n"
        "import llm_datadist, llmdd\n"
        "assert llm_datadist is llmdd\n"
        "from llm_datadist.v2.llm_types import Cache, CacheDesc, BlocksCacheKey\n"
        "from llm_datadist.v2.llm_datadist import _shutdown_handler, LLMDataDist\n"
        "from llm_datadist.status import LLMStatusCode, code_2_status\n"
        "from llm_datadist.configs import LLMConfig, LLMClusterInfo\n"
        "from llm_datadist.data_type import DataType, dtype_to_np_dtype\n"
        "from llm_datadist.utils.utils import check_uint64\n"
        "import llm_datadist.utils.log\n"
        "assert Cache is llmdd.Cache and LLMDataDist is llmdd.LLMDataDist\n"
        "llmdd.compat.uninstall_alias()\n"
        "assert 'llm_datadist' not in sys.modules\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
