"""The model implementations: the native Llama-family forward, transformers' own modules (generic), MoE.

The public names load on first use, so that the torch-free modules (fused_layout, which the worker's
read-ahead reads before torch is imported) can be imported without torch."""

from importlib import import_module
from typing import TYPE_CHECKING

__all__ = ["ARCHITECTURES", "GENERIC", "NATIVE", "LlamaModel", "ModelConfig", "forced_generic",
           "model_path_for"]

_HOMES = {"ARCHITECTURES": "llama", "LlamaModel": "llama", "ModelConfig": "llama", "GENERIC": "paths",
          "NATIVE": "paths", "forced_generic": "paths", "model_path_for": "paths"}

if TYPE_CHECKING:
    from sluice.engine.models.llama import ARCHITECTURES, LlamaModel, ModelConfig
    from sluice.engine.models.paths import GENERIC, NATIVE, forced_generic, model_path_for


def __getattr__(name: str):
    """A public name, imported from its module when first asked for."""
    if name not in _HOMES:
        raise AttributeError(f"module 'sluice.engine.models' has no attribute {name!r}")
    value = getattr(import_module(f"sluice.engine.models.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
