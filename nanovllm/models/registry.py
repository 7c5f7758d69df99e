from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM

MODELS = {cls.__name__: cls for cls in (Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM)}
# configs made from GGUF files may carry only a model_type
MODEL_TYPES = {"qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}


def model_class(config):
    """The model class for `config.architectures[0]`; ValueError names the supported ones."""
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS:
            return MODELS[arch]
    if not archs and getattr(config, "model_type", None) in MODEL_TYPES:
        return MODEL_TYPES[config.model_type]
    raise ValueError(f"unsupported architecture {archs or getattr(config, 'model_type', None)!r}; "
                     f"supported: {', '.join(MODELS)}")
