"""Upstream ``llm_datadist`` module paths, for drop-in use by unmodified client code.

Clients import more than the package root: ``llm_datadist.v2.llm_types`` (omni-infer),
``llm_datadist.v2.llm_datadist`` (``_shutdown_handler``), ``llm_datadist.status``,
``llm_datadist.configs``, ``llm_datadist.data_type``, ``llm_datadist.utils.log``.
This package mirrors those paths; :func:`llmdd.compat.install_alias` makes
``import llm_datadist...`` resolve to ``llmdd`` and these modules.
"""
