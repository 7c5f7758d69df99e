"""The one place that decides when a completion ends, and why."""
from nanovllm.engine.detokenizer import find_stop_string
from nanovllm.sequence import PLACEHOLDER, Sequence


def check_stop(seq: Sequence, token: int, num_tokens: int, eos_token_ids: frozenset, max_model_len: int,
               new_text: str = "") -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) if `seq` ends with `token`, its newest known token and its
    num_tokens-th (later tokens, sampled and not read yet, may follow it), else None:
    ("stop", None) for an EOS id (unless ignore_eos); ("stop", id) for one of stop_token_ids (the
    token stays in token_ids, its text leaves the detokenized text unless
    include_stop_str_in_output, as vLLM's detokenizer skips a stop token);
    ("stop", s) for a stop string s completed by new_text (the text the token added; the
    detokenized text is then cut, see cut_stop_string); ("stop", None) when its grammar
    (structured_outputs, fed the token here if the sampler has not) is complete, so that only EOS
    could follow, whatever ignore_eos and min_tokens say; ("abort", None) when it refused the token
    (logged), which only other constraints leaving no token it allows can bring about;
    ("length", None) once the completion holds max_tokens tokens or the sequence max_model_len.
    Before min_tokens completion tokens only "length" or the grammar can end it (the sampler masks
    EOS and stop ids until then). With token = PLACEHOLDER (sampled, not read yet) only "length"
    can be decided, which the engine does as soon as the step is launched."""
    sp, num_completion_tokens = seq.sampling_params, num_tokens - seq.num_prompt_tokens
    if token != PLACEHOLDER and num_completion_tokens >= sp.min_tokens:
        if not sp.ignore_eos and token in eos_token_ids:
            return _stop_token(seq, new_text, None)
        if sp.stop_token_ids and token in sp.stop_token_ids:
            return _stop_token(seq, new_text, token)
        if new_text and sp.stop_strings:
            found = find_stop_string(seq.detokenizer.text, len(new_text), sp.stop_strings)
            if found:
                cut_stop_string(seq, *found)
                return "stop", found[0]
    if token != PLACEHOLDER and seq.grammar is not None and seq.grammar.advance(seq):
        return "abort" if seq.grammar.refused else "stop", None
    if (sp.max_tokens is not None and num_completion_tokens >= sp.max_tokens) or num_tokens >= max_model_len:
        return "length", None
    return None


def _stop_token(seq: Sequence, new_text: str, stop_reason: int | None) -> tuple[str, int | None]:
    """("stop", stop_reason) for a stop token, whose text (new_text) is taken off the end of the
    completion's text unless include_stop_str_in_output."""
    if new_text and not seq.sampling_params.include_stop_str_in_output:
        seq.detokenizer.text = seq.detokenizer.text[:-len(new_text)]
    return "stop", stop_reason


def cut_stop_string(seq: Sequence, stop: str, start: int):
    """Cut the completion's text at the stop string (after it with include_stop_str_in_output)."""
    detok = seq.detokenizer
    detok.text = detok.text[:start + (len(stop) if seq.sampling_params.include_stop_str_in_output else 0)]
