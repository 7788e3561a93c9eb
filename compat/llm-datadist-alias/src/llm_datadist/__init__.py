"""``llm_datadist`` served by llmdd (opt-in alias distribution).

Importing this package installs llmdd's alias and replaces itself with ``llmdd``, so
``llm_datadist.X`` is ``llmdd.X`` and ``llm_datadist.v2.llm_types`` etc. resolve to
llmdd's mirrors of upstream's module paths.
"""

import sys

import llmdd
import llmdd.compat

llmdd.compat.install_alias()
sys.modules[__name__] = llmdd
