from sluice.engine.models.llama import ARCHITECTURES, LlamaModel, ModelConfig

__all__ = ["ARCHITECTURES", "LlamaModel", "ModelConfig"]
