"""``import llmdd_vllm`` without vLLM or torch says what to install, not a bare ModuleNotFoundError.

Each case runs in a fresh interpreter where the missing package is made unimportable (``None`` in
``sys.modules``), so it runs whether or not vLLM is installed here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

_IMPORT = """
import sys
for name in sys.argv[1:]:
    sys.modules[name] = None          # as if not installed
try:
    import llmdd_vllm
except ModuleNotFoundError as exc:
    print(exc.name)
    print(exc)
else:
    print("imported")
"""


@pytest.mark.parametrize("missing", [["torch"], ["vllm"], ["torch", "vllm"]])
def test_import_without_vllm_or_torch_says_what_to_install(missing):
    out = subprocess.run([sys.executable, "-c", _IMPORT, *missing], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    name, message = out.stdout.split("\n", 1)
    assert any(name == m or name.startswith(m + ".") for m in missing), name   # "vllm.distributed", ...
    assert message.startswith("llmdd_vllm is the KV connector that vLLM loads: it needs vLLM (and its torch) "
                              f"installed, and {name!r} is not"), message
    assert "pip install vllm" in message and "docs/vllm.md" in message, message


def test_control_another_missing_module_is_not_reworded():
    """A missing module other than torch/vLLM (a broken install) keeps its own error."""
    out = subprocess.run([sys.executable, "-c", _IMPORT, "llmdd_vllm.connector"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    name, message = out.stdout.split("\n", 1)
    assert name == "llmdd_vllm.connector" and "needs vLLM" not in message, out.stdout
