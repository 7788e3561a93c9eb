"""Builds the optional C hot path ``llmdd_shm._shmfast`` (everything else is in pyproject.toml).

The extension needs a C compiler and the Python headers (``Python.h``); on Debian/Ubuntu
``apt-get install gcc python3-dev`` (a pyenv / python.org build ships its headers already).
When it cannot be built the install still succeeds, prints why, and the transport runs its
pure-Python path (``llmdd info`` shows which one is active). ``LLMDD_SHM_BUILD_NATIVE=0`` skips it;
``LLMDD_SHM_BUILD_NATIVE=1`` makes a failed build fail the install.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

MODE = os.environ.get("LLMDD_SHM_BUILD_NATIVE", "auto")


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - the pure-Python path remains
            self._skip(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._skip(exc)

    def _skip(self, exc):
        if MODE == "1":
            raise
        sys.stderr.write(f"llmdd-transport-shm: the C hot path was not built ({exc}); "
                         "the pure-Python path will be used\n")


ext = [] if MODE == "0" or not sys.platform.startswith("linux") else [
    Extension("llmdd_shm._shmfast", ["src/llmdd_shm/_shmfast.c"], extra_compile_args=["-O2", "-std=gnu11"])]

setup(ext_modules=ext, cmdclass={"build_ext": OptionalBuildExt})
