"""LoRA adapters: PEFT folders loaded and checked, slots in working memory, each step's token-to-slot
mapping."""

from sluice.engine.lora.adapter import LoRAAdapter, LoRAError, read_adapter
from sluice.engine.lora.lora_request import LoRARequest
from sluice.engine.lora.manager import LoRAManager

__all__ = ["LoRAAdapter", "LoRAError", "LoRAManager", "LoRARequest", "read_adapter"]
