"""Default plugins of llmdd, registered by dotted name by ``make_plugin_manager``.

Each one is an ordinary plugin: it can be blocked by name (``blocked=`` or
``LLMDD_DISABLED_PLUGINS``) and overridden with ``tryfirst`` implementations.
"""
