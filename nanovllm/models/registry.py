"""Which model class serves a checkpoint. To add a model: a class in decoder.py if it is a
variant of the shared decoder, in moe.py if a mixture-of-experts one (or a module of its own),
then its name here."""
from nanovllm.models.decoder import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from nanovllm.models.eagle3 import Eagle3LlamaForCausalLM
from nanovllm.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM

MODELS = {cls.__name__: cls for cls in (Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, Qwen3MoeForCausalLM,
                                        MixtralForCausalLM)}
# draft heads, which run beside a target only (speculative_config method "eagle3")
DRAFT_HEADS = {"LlamaForCausalLMEagle3": Eagle3LlamaForCausalLM, "Eagle3LlamaForCausalLM": Eagle3LlamaForCausalLM}
# configs made from GGUF files may carry only a model_type
MODEL_TYPES = {"qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}


def model_class(config, draft_head: bool = False):
    """The model class for `config.architectures` (or its model_type); ValueError names the supported
    ones. draft_head: an EAGLE-3 head's config (DRAFT_HEADS), which only that allows."""
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS and not draft_head:
            return MODELS[arch]
        if arch in DRAFT_HEADS:
            if draft_head:
                return DRAFT_HEADS[arch]
            raise ValueError(f"{arch} is an EAGLE-3 draft head, not a model to serve: pass it as "
                             f"speculative_config={{\"method\": \"eagle3\", \"model\": ...}} beside its target")
    if draft_head:
        raise ValueError(f"speculative_config method \"eagle3\" needs an EAGLE-3 head (architectures "
                         f"{list(DRAFT_HEADS)}), got {archs!r}")
    if not archs and getattr(config, "model_type", None) in MODEL_TYPES:
        return MODEL_TYPES[config.model_type]
    raise ValueError(f"unsupported architecture {archs or getattr(config, 'model_type', None)!r}; "
                     f"supported: {', '.join(MODELS)}")
