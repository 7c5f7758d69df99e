"""vLLM's LoRARequest: which PEFT adapter a request runs with (`llm.generate(..., lora_request=...)`)."""
from dataclasses import dataclass
from numbers import Integral


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: a name for the adapter (in messages); lora_int_id: a positive integer that
    identifies it across requests (the engine keeps adapters, their slots and their cached
    prefixes by it: one id, one adapter); lora_path: a local directory holding a PEFT adapter
    (adapter_config.json and adapter_model.safetensors). ValueError for an id that is not a
    positive integer or an empty path."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_int_id, Integral) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r} needs lora_path, the adapter's directory")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
