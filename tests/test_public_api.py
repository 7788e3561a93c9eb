"""The public surface of ``llmdd`` (spec section 1): exports, aliases, lazy legacy names, import side effect."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import llmdd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the re-exports of upstream's llm_datadist/__init__.py (spec section 1), in upstream's order
SPEC_EXPORTS = [
    "LLMStatusCode", "LLMException", "Status",
    "LLMClusterInfo", "LLMRole", "LlmConfig", "LLMConfig",
    "DataType",
    "KvCache", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey", "Placement",
    "RegisterMemStatus", "Cache", "LayerSynchronizer", "TransferConfig", "CacheTask",
    "TransferWithCacheKeyConfig", "Memtype", "MemInfo",
    "LLMDataDist",
]
LEGACY_V1 = ["TensorDesc", "Tensor", "KvCacheManager"]


def test_all_snapshot():
    assert llmdd.__all__ == SPEC_EXPORTS + LEGACY_V1  # upstream's __all__ ends with the lazy v1 names
    assert len(set(llmdd.__all__)) == len(llmdd.__all__)


def test_every_name_through_the_drop_in_alias():
    import llmdd as llm_datadist

    for name in SPEC_EXPORTS:
        obj = getattr(llm_datadist, name)
        assert obj is getattr(llmdd, name)
        assert not name.startswith("_")


def test_star_import_gives_every_name():
    namespace: dict = {}
    exec("from llmdd import *", namespace)
    assert set(SPEC_EXPORTS) <= set(namespace)
    assert set(LEGACY_V1) <= set(namespace)  # served lazily, as upstream (llmdd's own v1 package)


def test_llmconfig_alias():
    assert llmdd.LLMConfig is llmdd.LlmConfig


def test_exception_hierarchy():
    assert issubclass(llmdd.LLMException, RuntimeError)


@pytest.mark.parametrize("name", LEGACY_V1)
def test_legacy_v1_names_are_served_lazily(name):
    from llmdd._api import v1 as _v1

    assert getattr(llmdd, name) is getattr(_v1, name)


@pytest.mark.parametrize("name", LEGACY_V1)
def test_legacy_v1_from_import(name):
    namespace: dict = {}
    exec(f"from llmdd import {name}", namespace)
    assert namespace[name].__module__.startswith("llmdd._api.v1")


@pytest.mark.parametrize("name", ["x", "KVCache", "llm_datadist_v1", "v1"])
def test_unknown_attribute(name):
    with pytest.raises(AttributeError) as info:
        getattr(llmdd, name)
    assert str(info.value) == f"Module 'llmdd' has no attribute '{name}'"
    assert not hasattr(llmdd, name)


def _run(code: str, env_update: dict, drop: tuple = ()) -> str:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_update)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("preset, expected", [
    (None, "None->0"),
    ("1", "1->1"),
    ("", "->"),
])
def test_import_sets_auto_use_uc_memory_only_if_absent(preset, expected):
    code = """
        import os
        before = os.environ.get("AUTO_USE_UC_MEMORY")
        import llmdd
        print(f"{before}->{os.environ.get('AUTO_USE_UC_MEMORY')}")
    """
    env = {} if preset is None else {"AUTO_USE_UC_MEMORY": preset}
    assert _run(code, env, drop=("AUTO_USE_UC_MEMORY",)) == expected
