"""``llm_datadist.utils``: the argument checks (:mod:`.utils`) and the logging helpers (:mod:`.log`)."""

from llmdd.utils import log, utils  # noqa: F401  (upstream's modules are reachable as attributes once imported)
