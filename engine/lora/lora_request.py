"""How a request names its adapter: vLLM's LoRARequest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT LoRA adapter by name, a positive integer id unique per adapter, and its folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
