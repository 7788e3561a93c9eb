"""Former home of llmdd's mirrors of upstream's module paths.

The mirrors are now public modules of llmdd under upstream's own paths (``llmdd.status``,
``llmdd.configs``, ``llmdd.data_type``, ``llmdd.utils.*``, ``llmdd.v2.*``), so that
``import llmdd as llm_datadist`` reaches them as attributes; :func:`llmdd.compat.install_alias`
maps ``llm_datadist.*`` onto them.  The modules of this package re-export those for code that
imported them here.
"""
