"""llmdd for vLLM: ``LlmddConnector``, a v1 KV connector that moves prefill KV blocks to decode
instances through llmdd (docs/vllm.md).

vLLM loads it with ``kv_connector="LlmddConnector", kv_connector_module_path="llmdd_vllm"``.
Importing this package imports vLLM (and torch).
"""

from .connector import DEFAULTS, LlmddConnector, LlmddConnectorMetadata, LlmddHandshake, worker_counters

__all__ = ["DEFAULTS", "LlmddConnector", "LlmddConnectorMetadata", "LlmddHandshake", "worker_counters"]
