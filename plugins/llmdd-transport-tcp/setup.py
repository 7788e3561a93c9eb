"""Builds the tcp transport's optional C hot path ``llmdd_tcp._tcpfast`` (the rest is pyproject.toml).

It needs a C compiler and ``Python.h`` (Debian/Ubuntu: ``apt-get install gcc python3-dev``; pyenv and
python.org builds ship the headers).  Without them the install still succeeds, says why on stderr,
and the transport runs its pure-Python path (``llmdd info`` shows which one is active).
``LLMDD_TCP_BUILD_NATIVE=0`` skips the build, ``=1`` makes a failed build fail the install.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

WANT = os.environ.get("LLMDD_TCP_BUILD_NATIVE", "auto")


class BuildOrExplain(build_ext):
    """build_ext that turns a failed compile into a message unless the build was required."""

    def build_extensions(self):
        for ext in self.extensions:
            try:
                self.build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - the pure-Python path stays
                if WANT == "1":
                    raise
                print(f"llmdd-transport-tcp: {ext.name} not built ({exc}); the pure-Python path is used",
                      file=sys.stderr)


native = WANT != "0" and sys.platform.startswith("linux")
setup(ext_modules=[Extension("llmdd_tcp._tcpfast", ["src/llmdd_tcp/_tcpfast.c"],
                             extra_compile_args=["-O2", "-std=gnu11"])] if native else [],
      cmdclass={"build_ext": BuildOrExplain})
