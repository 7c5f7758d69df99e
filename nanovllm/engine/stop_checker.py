"""The one rule for when a sequence ends, and why."""
from nanovllm.engine.sequence import PLACEHOLDER, Sequence


def check_stop(seq: Sequence, token: int, eos_token_ids: frozenset, max_model_len: int) -> str | None:
    """Why `seq` ends with `token`, its newest known token: "stop" for an EOS id (unless
    ignore_eos) or one of stop_token_ids; "length" once it holds max_tokens completion tokens
    or max_model_len tokens in all; else None. With token = PLACEHOLDER (sampled, not read yet)
    only "length" can be decided, which the engine does as soon as the step is launched."""
    sp = seq.sampling_params
    if token != PLACEHOLDER and ((not sp.ignore_eos and token in eos_token_ids) or token in (sp.stop_token_ids or ())):
        return "stop"
    if seq.num_completion_tokens >= sp.max_tokens or len(seq) >= max_model_len:
        return "length"
    return None
