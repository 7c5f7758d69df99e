"""The Sampler: one token per row of logits, with the log-probabilities a request asks for, in
one batched pass over the step's SamplingTensors."""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.logits_processors import apply_logits_processors


@dataclass
class SamplingTensors:
    """N sampled rows. temperatures [N] float32 (0: greedy), or None when every row is greedy.
    top_k [N] int64, top_p [N], min_p [N] float32. generators: {row: torch.Generator} of seeded rows.
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
class SampledLogprobs:
    """For the R rows that asked for logprobs: the sampled ids [R], their logprobs [R] and ranks
    [R] (1: the most likely), and the top K tokens' ids [R, K] and logprobs [R, K]."""
    sampled_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    sampled_ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "SampledLogprobs":
        return SampledLogprobs(*(getattr(self, f).to(device, non_blocking=non_blocking)
                                 for f in self.__dataclass_fields__))

    def tolist(self) -> list[tuple[list[int], list[float], list[int]]]:
        """Per row, (token ids, logprobs, ranks): the sampled token first, then the top K."""
        k = self.top_ids.size(1)
        return [([t, *ids], [lp, *lps], [r, *range(1, k + 1)]) for t, lp, r, ids, lps in zip(
            self.sampled_ids.tolist(), self.sampled_logprobs.tolist(), self.sampled_ranks.tolist(),
            self.top_ids.tolist(), self.top_logprobs.tolist())]


class Sampler(nn.Module):
    """forward(logits [N, vocab] (float32 or the model dtype), st: SamplingTensors or None (all
    greedy, nothing else)) -> (token ids [N] int64, SampledLogprobs or None).

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
        return sampled, self._logprobs(source, sampled, st)

    def _sample(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled ids, the logits they were drawn from: scaled and filtered, greedy rows unscaled)."""
        greedy = st.temperatures == 0
        logits = logits / torch.where(greedy, 1.0, st.temperatures).unsqueeze(1)
        if st.min_p is not None:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < st.min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), float("-inf"))
        if st.top_k is not None or st.top_p is not None:
            logits = self._top_k_top_p(logits, st.top_k, st.top_p)
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=self._default_generator(probs.device))
        noise.clamp_min_(1e-20)  # Exp(1) can round to 0
        for row, gen in (st.generators or {}).items():
            noise[row].exponential_(generator=gen)
        return torch.where(greedy, logits.argmax(-1), (probs / noise).argmax(-1)), logits

    @staticmethod
    def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, st: SamplingTensors) -> SampledLogprobs:
        rows = st.logprob_rows
        logprobs = logits[rows].float().log_softmax(-1)
        chosen = sampled[rows]
        chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
        ranks = (logprobs > chosen_lp).sum(-1) + 1
        top_lp, top_ids = logprobs.topk(st.num_logprobs, dim=-1)
        return SampledLogprobs(chosen, chosen_lp.squeeze(1), ranks, top_ids, top_lp)

    def _default_generator(self, device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if self.generator is None or self.generator.device != torch.device(device):
            self.generator = torch.Generator(device).manual_seed(self.seed)
        return self.generator

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
        sorted_logits, order = logits.sort(-1, descending=True)
        if top_k is not None:
            rank = torch.arange(logits.size(-1), device=logits.device)
            k = torch.where(top_k > 0, top_k, logits.size(-1)).unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
        if top_p is not None:
            probs = sorted_logits.softmax(-1)
            mass_before = probs.cumsum(-1) - probs
            sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
