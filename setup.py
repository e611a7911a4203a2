"""The package build: pyproject.toml says what the package is; this adds the prebuilt C++ kernels to a wheel.

A wheel build (`pip wheel .`, `python -m build --wheel`) compiles each kernel library for each CPU tier with
that tier's explicit flags (kernels.cpp_build.compile_prebuilt) into sluice/kernels/prebuilt/ and tags the
wheel for this Python and platform (cp3XX-cp3XX-linux_x86_64). An editable install (`make install`) compiles
nothing: the kernels build on first use as always.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _cpp_build() -> types.ModuleType:
    """kernels.cpp_build as sluice.kernels.cpp_build, without importing the package (and the engine) around
    it."""
    for name, folder in (("sluice", "sluice"), ("sluice.kernels", "kernels")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(ROOT / folder)]
            sys.modules[name] = package
    return importlib.import_module("sluice.kernels.cpp_build")


class BuildPyWithKernels(build_py):
    """build_py, then (except for an editable install) the prebuilt kernels into the build's package
    folder."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            raise SystemExit("the wheel's prebuilt kernels are compiled against torch: install torch first "
                             "(pip wheel --no-build-isolation), or let the build backend add it") from exc
        _cpp_build().compile_prebuilt(Path(self.build_lib) / "sluice" / "kernels" / "prebuilt")


class PlatformDistribution(Distribution):
    """A distribution whose wheel carries compiled objects: tagged for its Python ABI and platform."""

    def has_ext_modules(self) -> bool:
        return True


setup(distclass=PlatformDistribution, cmdclass={"build_py": BuildPyWithKernels})
