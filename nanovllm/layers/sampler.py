"""The Sampler: one token per row of logits, with the log-probabilities a request asks for, in
one batched pass over the step's SamplingTensors."""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.logits_processors import apply_logits_processors


@dataclass
class SamplingTensors:
    """N sampled rows. temperatures [N] float32 (0: greedy), or None when every row is greedy.
    top_k [N] int64, top_p [N], min_p [N] float32; max_top_k: the largest top_k when every row with
    temperature > 0 has one, else 0. generators: {row: torch.Generator} of seeded rows.
    penalties: (presence [N], frequency [N], repetition [N]) float32. output_ids [N, L] int64: each
    row's completion so far, right-aligned, padded on the left with vocab_size. prompt_ids [N, P]:
    likewise the prompts, only for repetition_penalty. logit_bias: (rows, token ids, values).
    banned: (rows, token ids) set to -inf (EOS and stop ids before min_tokens; one-token bad words).
    banned_after: (rows [B], prefixes [B, M] int64 left-padded with -3, token ids [B]): a token is
    banned when the row's completion ends with its prefix (bad words of several tokens).
    allowed: (rows, token ids), the only tokens of those rows that may be sampled.
    num_logprobs: top tokens to return (-1: no row asked), with logprob_rows [R] the rows that did."""
    temperatures: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    generators: dict | None = None
    penalties: tuple | None = None
    output_ids: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    logit_bias: tuple | None = None
    banned: tuple | None = None
    banned_after: tuple | None = None
    allowed: tuple | None = None
    num_logprobs: int = -1
    logprob_rows: torch.Tensor | None = None



@dataclass
class TokenLogprobs:
    """For R rows of logits: the log-probability [R] and rank [R] (1: the most likely) of one token
    each (the sampled one, or the next prompt token), and the top K tokens' ids [R, K] and logprobs [R, K]."""
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "TokenLogprobs":
        return TokenLogprobs(*(getattr(self, f).to(device, non_blocking=non_blocking)
                               for f in self.__dataclass_fields__))

    def tolist(self) -> list[tuple[list[int], list[float], list[int]]]:
        """Per row, (token ids, logprobs, ranks): its token first, then the top K."""
        k = self.top_ids.size(1)
        return [([t, *ids], [lp, *lps], [r, *range(1, k + 1)]) for t, lp, r, ids, lps in zip(
            self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist(),
            self.top_ids.tolist(), self.top_logprobs.tolist())]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> TokenLogprobs:
    """The log-softmax (float32) of logits [R, vocab] at token_ids [R], their ranks, and the top k."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    return TokenLogprobs(token_ids, chosen.squeeze(1), (logprobs > chosen).sum(-1) + 1, top_ids, top_lp)


class Sampler(nn.Module):
    """forward(logits [N, vocab] (float32 or the model dtype), st: SamplingTensors or None (all
    greedy, nothing else)) -> (token ids [N] int64, TokenLogprobs of st.logprob_rows or None).

    Order (vLLM's): the logits processors (penalties, logit_bias, banned and allowed tokens),
    then greedy rows (temperature 0) take the argmax; the others are scaled by 1/temperature and
    filtered: min_p (drop tokens below min_p * the top probability), top_k (keep the k largest),
    top_p (keep the smallest set whose mass reaches top_p, the top token always kept). Sampling
    uses the exponential race argmax(p / E), E ~ Exp(1), which draws exactly from p; each seeded
    row draws its E from its own generator, so it repeats regardless of what else is in the batch.
    On CUDA, a batch with temperatures alone is sampled in one pass by the Gumbel-max kernel
    (sampling_kernel.py), the same distribution. Logprobs are the log-softmax of the raw logits
    (logprobs_mode "raw_logprobs") or of the logits the token was drawn from ("processed_logprobs":
    after the processors, temperature and filters).
    """

    def __init__(self, seed: int | None = None, logprobs_mode: str = "raw_logprobs"):
        super().__init__()
        self.seed, self.logprobs_mode = seed, logprobs_mode
        self.generator: torch.Generator | None = None

    def forward(self, logits: torch.Tensor, st: SamplingTensors | None = None):
        if st is None:
            return logits.argmax(-1), None
        processed = any(x is not None for x in (st.penalties, st.logit_bias, st.banned, st.banned_after, st.allowed))
        raw = logits
        if processed:
            logits = apply_logits_processors(logits.to(torch.float32, copy=True), st)  # raw stays as it was
        if st.temperatures is None:
            sampled, final = logits.argmax(-1), logits
        elif logits.is_cuda and not processed and st.top_k is None and st.top_p is None and st.min_p is None \
                and not st.generators and st.num_logprobs < 0:
            from nanovllm.layers.sampling_kernel import gumbel_max_sample
            gen = self._default_generator(logits.device)
            seeds = torch.randint(0, 2**31 - 1, (logits.size(0),), dtype=torch.int32, device=logits.device, generator=gen)
            return gumbel_max_sample(logits, st.temperatures, seeds), None
        else:
            sampled, final = self._sample(logits.float(), st)
        if st.num_logprobs < 0:
            return sampled, None
        source = raw if self.logprobs_mode == "raw_logprobs" else final
        return sampled, token_logprobs(source[st.logprob_rows], sampled[st.logprob_rows], st.num_logprobs)

    def _sample(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sampled ids, the logits they were drawn from: scaled and filtered, greedy rows unscaled;
        None from the top-k path, taken only when nothing needs them).

        When every sampling row has a top_k (st.max_top_k), the filters run on each row's
        max_top_k largest logits (torch.topk) instead of the sorted vocabulary, and the draw is the
        same: a seeded row's noise at those tokens is the noise it has over the whole vocabulary."""
        greedy = st.temperatures == 0
        logits = logits / torch.where(greedy, 1.0, st.temperatures).unsqueeze(1)
        if st.max_top_k and (st.num_logprobs < 0 or self.logprobs_mode == "raw_logprobs"):
            values, ids = logits.topk(st.max_top_k, dim=-1)
            probs = self._filter_sorted(values, st).softmax(-1)
            noise = torch.empty_like(probs).exponential_(generator=self._default_generator(probs.device))
            for row, gen in (st.generators or {}).items():
                noise[row] = torch.empty(logits.size(1), device=logits.device).exponential_(generator=gen)[ids[row]]
            choice = (probs / noise.clamp_min_(1e-20)).argmax(-1, keepdim=True)  # Exp(1) can round to 0
            return torch.where(greedy, ids[:, 0], ids.gather(1, choice).squeeze(1)), None
        if st.top_k is not None or st.top_p is not None:
            values, order = logits.sort(-1, descending=True)
            logits = torch.empty_like(logits).scatter_(-1, order, self._filter_sorted(values, st))
        elif st.min_p is not None:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < st.min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), float("-inf"))
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=self._default_generator(probs.device))
        for row, gen in (st.generators or {}).items():
            noise[row].exponential_(generator=gen)
        return torch.where(greedy, logits.argmax(-1), (probs / noise.clamp_min_(1e-20)).argmax(-1)), logits

    @staticmethod
    def _filter_sorted(values: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """min_p, top_k and top_p on logits sorted in descending order along the last dimension."""
        if st.min_p is not None:  # p / p_max = exp(x - x_max), the same over any prefix of the sorted row
            probs = values.softmax(-1)
            values = values.masked_fill(probs < st.min_p.unsqueeze(1) * probs[:, :1], float("-inf"))
        if st.top_k is not None:
            rank = torch.arange(values.size(-1), device=values.device)
            values = values.masked_fill(rank >= torch.where(st.top_k > 0, st.top_k, values.size(-1)).unsqueeze(1),
                                        float("-inf"))
        if st.top_p is not None:
            probs = values.softmax(-1)
            values = values.masked_fill(probs.cumsum(-1) - probs >= st.top_p.unsqueeze(1), float("-inf"))
        return values

    def _default_generator(self, device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if self.generator is None or self.generator.device != torch.device(device):
            self.generator = torch.Generator(device).manual_seed(self.seed)
        return self.generator
