"""Root conftest: the hypothesis profiles of every test tree (tests/ and plugins/*/tests).

* ``ci`` (selected when the ``CI`` environment variable is set, or by ``HYPOTHESIS_PROFILE=ci``,
  which .ci/run exports): derandomized
  (a fixed seed per test, the same examples on every run) and no example database, so a run never
  replays examples another run found; a failing example is printed and becomes an explicit
  ``@example`` regression in its test.
* ``dev`` (everywhere else): random exploration with the local database, as hypothesis does by
  default, so local runs keep finding new examples.

``HYPOTHESIS_PROFILE=ci`` selects the CI profile locally (to reproduce a CI run).

llmdd's pytest plugin (the ``llmdd_*`` fixtures) is opt-in, as for any suite: loaded here for
llmdd's own tests and its plugins' tests.
"""

import os

from hypothesis import settings

pytest_plugins = ["llmdd.testing.pytest_plugin"]

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
