from sluice.engine.models.llama import ARCHITECTURES, LlamaModel, ModelConfig
from sluice.engine.models.paths import GENERIC, NATIVE, forced_generic, model_path_for

__all__ = ["ARCHITECTURES", "GENERIC", "NATIVE", "LlamaModel", "ModelConfig", "forced_generic", "model_path_for"]
