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

from hypothesis import HealthCheck, settings

pytest_plugins = ["llmdd.testing.pytest_plugin"]

# no deadline and no too_slow health check in either profile: both time CPU-bound work (hypothesis'
# default 200 ms deadline per example failed busy machines; issue 41: no timed tests); each test has
# pytest-timeout's bound instead
_UNTIMED = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, **_UNTIMED)
settings.register_profile("dev", print_blob=True, **_UNTIMED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
