"""LoRARequest: how a request, the offline API or an admin call names one adapter (vLLM's shape)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One adapter: a name (what the OpenAI `model` field says), a positive integer id (unique per
    engine; 0 is the base model) and a local PEFT directory (`adapter_config.json` +
    `adapter_model.safetensors`). `base_model_name`, when given, is checked against the adapter's
    own `base_model_name_or_path` where both can be compared."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name: must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise ValueError(f"lora_path: must be a local adapter directory, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name: must be a string, got {self.base_model_name!r}")

    # vLLM's older attribute names, which some callers still use.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
