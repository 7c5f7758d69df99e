"""Which model class serves a checkpoint. To add a model: a class in decoder.py if it is a
variant of the shared decoder, in moe.py if a mixture-of-experts one (or a module of its own),
then its name here."""
from nanovllm.models.decoder import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from nanovllm.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM

MODELS = {cls.__name__: cls for cls in (Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, Qwen3MoeForCausalLM,
                                        MixtralForCausalLM)}
# configs made from GGUF files may carry only a model_type
MODEL_TYPES = {"qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}


def model_class(config):
    """The model class for `config.architectures` (or its model_type); ValueError names the supported ones."""
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS:
            return MODELS[arch]
    if not archs and getattr(config, "model_type", None) in MODEL_TYPES:
        return MODEL_TYPES[config.model_type]
    raise ValueError(f"unsupported architecture {archs or getattr(config, 'model_type', None)!r}; "
                     f"supported: {', '.join(MODELS)}")
