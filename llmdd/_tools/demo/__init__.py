"""The ``llmdd demo`` machinery: a numpy transformer, prompt/decoder roles, the run and its report.

Private: the command line (``llmdd demo``) is the interface.  Nothing here prints.
"""
