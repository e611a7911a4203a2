"""The build backend: setuptools', with torch added to what an isolated wheel build installs first (setup.py
compiles the prebuilt kernels against it). An editable install needs no torch to build, and gets none."""

from __future__ import annotations

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F403  (every hook setuptools offers, unchanged)


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    """setuptools' requirements for a wheel, and torch (the kernels compile against its headers and
    libraries)."""
    return [*build_meta.get_requires_for_build_wheel(config_settings), "torch"]
