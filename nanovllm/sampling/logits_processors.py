"""What SamplingParams change in the logits before temperature and the top-k/top-p/min-p filters,
as vLLM applies them: penalties, logit_bias, banned tokens (min_tokens, bad_words) and
allowed_token_ids. Batched over the rows: no per-row host work."""
import torch


def apply_logits_processors(logits: torch.Tensor, st) -> torch.Tensor:
    """logits: [N, vocab] float32, changed in place and returned; st: the step's SamplingTensors."""
    if st.penalties is not None:
        apply_penalties(logits, st)
    if st.logit_bias is not None:
        rows, tokens, values = st.logit_bias
        logits.index_put_((rows, tokens), values, accumulate=True)
    if st.banned is not None:
        logits[st.banned] = float("-inf")
    if st.banned_after is not None:
        rows, prefixes, tokens = st.banned_after
        tails = st.output_ids[rows, -prefixes.size(1):]
        match = ((tails == prefixes) | (prefixes == -3)).all(1)
        logits[rows[match], tokens[match]] = float("-inf")
    if st.allowed is not None:
        rows = st.allowed[0].unique()
        mask = torch.ones_like(logits[rows], dtype=torch.bool)
        mask[torch.searchsorted(rows, st.allowed[0]), st.allowed[1]] = False
        logits[rows] = logits[rows].masked_fill(mask, float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, st):
    """repetition_penalty over the tokens of prompt and completion (CTRL, Keskar et al. 2019:
    a positive logit divided by it, a negative one multiplied, as transformers'
    RepetitionPenaltyLogitsProcessor); then presence_penalty once and frequency_penalty per
    occurrence over the completion's tokens (OpenAI's API definition). The counts come from
    st.token_counts at st.count_rows; on CUDA one pass over the logits (penalty_kernel)."""
    if logits.is_cuda:
        from nanovllm.kernels.penalty import apply_penalties_kernel
        return apply_penalties_kernel(logits, st)
    presence, frequency, repetition = st.penalties
    counts = st.token_counts[st.count_rows].float()
    seen = counts > 0
    if st.prompt_mask is not None:
        seen |= st.prompt_mask[st.count_rows]
    r = repetition.unsqueeze(1)
    logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
    logits -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0)
