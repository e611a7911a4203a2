from sluice.engine.models.llama import ARCHITECTURES, LlamaModel, ModelConfig
from sluice.engine.models.paths import GENERIC, NATIVE, model_path_for

__all__ = ["ARCHITECTURES", "GENERIC", "NATIVE", "LlamaModel", "ModelConfig", "model_path_for"]
