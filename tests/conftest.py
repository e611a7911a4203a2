from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# The repository's folders are installed as sluice.*; on sys.path ahead of site-packages, its kernels/ folder
# would shadow Hugging Face's `kernels` distribution, which transformers imports. Keep the root last, for
# `tests` only, and start every child process without the working directory on its path.
REPO_ROOT = str(Path(__file__).resolve().parent.parent)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != REPO_ROOT] + [REPO_ROOT]
os.environ["PYTHONSAFEPATH"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():  # before anything imports triton: its own library must load interpreted too
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sluice.kernels import options as kernel_options  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402

torch.set_num_threads(max(1, torch.get_num_threads()))
TEST_OUTPUT_ROOTS = [
    Path(tempfile.gettempdir()).resolve().as_uri(),
    "file:///tmp",
    Path("results").resolve().as_uri(),
    "s3://*",
]
os.environ.setdefault("SLUICE_OUTPUT_ROOTS", ",".join(TEST_OUTPUT_ROOTS))
# the default output location ($XDG_DATA_HOME/sluice/results) inside the temp roots, never the user's ~/.local
os.environ.setdefault("XDG_DATA_HOME", tempfile.mkdtemp(prefix="sluice-test-data-"))


@pytest.fixture(autouse=True)
def _kernel_options_follow_the_environment():
    """kernels.options reads the environment once; a test that changed it (and called `options.reset()`)
    leaves options the restored environment no longer sets: read it again. Autouse without monkeypatch, so
    this runs after monkeypatch has restored the environment."""
    yield
    if kernel_options.current() != kernel_options.KernelOptions.from_env():
        kernel_options.reset()


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Build (and cache per session) a tiny random checkpoint: factory(arch, **overrides) -> Path."""
    cache: dict[tuple, object] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides):
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{arch}")
            cache[key] = make_checkpoint(path, arch, seed=seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(checkpoint_factory):
    return checkpoint_factory("llama")


from tests.server_stack import stack  # noqa: E402, F401
from tests.services import redis_server, redis_url, s3_bucket, s3_server  # noqa: E402, F401
