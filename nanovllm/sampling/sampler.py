"""The Sampler: one token per row of logits, with the log-probabilities a request asks for, in
one batched pass over the step's SamplingTensors."""
from dataclasses import dataclass, field

import torch
from torch import nn

from nanovllm.sampling.processors import LogitsProcessor


@dataclass
class SamplingTensors:
    """N sampled rows. temperatures [N] float32 (0: greedy), or None when every row is greedy.
    top_k [N] int64, top_p [N], min_p [N] float32; max_top_k: the largest top_k when every row with
    temperature > 0 has one, else 0. seeds: (rows [S] int64, seeds [S] int64 in [0, 2^31)) of the
    seeded rows, whose noise is gumbel_noise(seed, token id), the same in every sampling path.
    processors: (LogitsProcessor, its state) of each processor some row carries, in the order they
    apply (sampling/processors). num_logprobs: top tokens to return (-1: no row asked), with
    logprob_rows [R] the rows that did. from_shards: under tensor parallelism, every rank draws
    from its vocabulary shard (sampling/tp_shards.py) rather than rank 0 from gathered logits."""
    temperatures: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seeds: tuple | None = None
    processors: list[tuple[LogitsProcessor, object]] = field(default_factory=list)
    num_logprobs: int = -1
    logprob_rows: torch.Tensor | None = None
    from_shards: bool = False

    @property
    def unfiltered(self) -> bool:
        """Whether every row draws from softmax(x / T) of its logits x after the processors (or
        takes the argmax): no top-k, top-p or min-p."""
        return self.top_k is None and self.top_p is None and self.min_p is None

    @property
    def only_temperature(self) -> bool:
        """Whether every row draws from softmax(logits / T) (or takes the argmax): no processors, no filters."""
        return not self.processors and self.unfiltered

    def for_workers(self) -> "SamplingTensors":
        """What the other tensor-parallel ranks need of it, sent with the step's plan: whether they
        draw from their shards (the temperatures and seeds reach them by broadcast) or send their
        logits to rank 0."""
        return SamplingTensors(from_shards=self.from_shards)


@dataclass
class TokenLogprobs:
    """For R rows of logits, column 0 one token each (the sampled one, or the next prompt token),
    then the top K: token_ids [R, 1 + K] int64, logprobs [R, 1 + K] float32 (natural log) and
    ranks [R, 1 + K] int64 (1: the most likely)."""
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "TokenLogprobs":
        return TokenLogprobs(*(getattr(self, f).to(device, non_blocking=non_blocking)
                               for f in self.__dataclass_fields__))

    def numpy(self) -> tuple:
        """(token_ids, logprobs, ranks) as numpy arrays [R, 1 + K] of host tensors, copied (outputs
        keep them, and a copy back from the GPU lands in pinned memory, which is scarce)."""
        return self.token_ids.numpy().copy(), self.logprobs.numpy().copy(), self.ranks.numpy().copy()


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(logits, k, dim=-1) of logits [N, vocab]: (values [N, k], descending; ids [N, k]
    int64); on CUDA, for 1 <= k <= kernels/logits_stats.MAX_KERNEL_TOPK, by its chunked_topk
    (float32 values; benchmarks/sampler_costs.py measures both)."""
    if logits.is_cuda:
        from nanovllm.kernels.logits_stats import MAX_KERNEL_TOPK, chunked_topk
        if 1 <= k <= min(MAX_KERNEL_TOPK, logits.size(-1)):  # k = 0: logprobs=0 asks for the sampled token's alone
            return chunked_topk(logits, k)
    return logits.topk(k, dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> TokenLogprobs:
    """The log-softmax of logits [R, vocab] (computed in float32) at token_ids [R], their ranks,
    and the top k. The [R, vocab] log-softmax is never written: logprob = logit - logsumexp, and
    ranks and the top k are the same on logits as on logprobs. On CUDA the logsumexp and ranks
    come from one read of the logits (kernels/logits_stats.logsumexp_and_rank)."""
    chosen = logits.gather(1, token_ids.unsqueeze(1)).float()
    top, top_ids = topk(logits, k)
    if logits.is_cuda:
        from nanovllm.kernels.logits_stats import logsumexp_and_rank
        lse, rank = logsumexp_and_rank(logits, token_ids)
    else:
        x = logits.float()
        lse, rank = x.logsumexp(-1), (x > chosen).sum(-1) + 1
    ranks = torch.cat([rank.unsqueeze(1), torch.arange(1, k + 1, device=logits.device).expand(logits.size(0), k)], 1)
    return TokenLogprobs(torch.cat([token_ids.unsqueeze(1), top_ids], 1),
                         torch.cat([chosen, top.float()], 1) - lse.unsqueeze(1), ranks)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding uint32 values (the low 32 bits of
    each product are kept, as in uint32 arithmetic); kernels/sampling._fmix32 in torch."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def gumbel_noise(seeds: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(U)) [S, M] float32 of seeds [S] int64 (in [0, 2^31)) at token_ids
    [S, M] int64: U from the counter-based hash of (seed, token id) that the Gumbel-max kernel
    uses (kernels/sampling.py), so a seeded row draws the same token on every path (the kernels'
    noise, through the GPU's approximate log2, is within 8e-6 of this: candidates closer than that
    may order differently)."""
    bits = _fmix32((token_ids * 0x9E3779B9 + _fmix32(seeds).unsqueeze(1)) & 0xFFFFFFFF)
    # 23 random bits, in (0, 1): with 24, (2^24 - 1 + 0.5) / 2^24 rounds to 1.0 in float32 and the
    # noise to +inf (one token in ~110 rows of Qwen's vocabulary drawn whatever its logit)
    u = ((bits >> 9).float() + 0.5) * (1.0 / 8388608)
    return -(-u.log()).log()


class Sampler(nn.Module):
    """forward(logits [N, vocab] (float32 or the model dtype), st: SamplingTensors or None (all
    greedy, nothing else)) -> (token ids [N] int64, TokenLogprobs of st.logprob_rows or None).

    Order (vLLM's): the logits processors of st.processors on a float32 copy of the logits (their
    update() follows the draw), then greedy rows (temperature 0) take the argmax; the others are
    scaled by 1/temperature and filtered: min_p (drop tokens below min_p * the top probability), top_k (keep the k largest),
    top_p (keep the smallest set whose mass reaches top_p, the top token always kept). Sampling
    is the Gumbel-max draw argmax(logits / T + G), exactly from softmax(logits / T) over the kept
    tokens (Gumbel 1954); G = -log(E), E ~ Exp(1) from the engine's generator, except in seeded
    rows, whose G is a hash of (seed, token id) (gumbel_noise), so they repeat whatever else is in
    the batch. On CUDA, a batch with temperatures alone (after its processors, if any) is sampled
    in one pass by the Gumbel-max kernel (kernels/sampling.py), with the same hash in seeded
    rows; with top_p and/or min_p (and no top_k) by the nucleus kernel, which draws the sorted
    path's token without sorting; with top_k on every sampling row, by the top-k kernel over the
    rows' max_top_k largest logits.
    Logprobs are the log-softmax of the raw logits (logprobs_mode "raw_logprobs") or of the
    logits the token was drawn from ("processed_logprobs": after the processors, temperature and
    filters).
    """

    def __init__(self, seed: int | None = None, logprobs_mode: str = "raw_logprobs"):
        super().__init__()
        self.seed, self.logprobs_mode = seed, logprobs_mode
        self.generator: torch.Generator | None = None

    def forward(self, logits: torch.Tensor, st: SamplingTensors | None = None):
        if st is None:
            return logits.argmax(-1), None
        raw = logits
        need_final = st.num_logprobs >= 0 and self.logprobs_mode == "processed_logprobs"  # the logits drawn from
        if st.processors:
            logits = logits.to(torch.float32, copy=True)  # raw stays as it was
            for processor, state in st.processors:
                processor.apply(logits, state)
        if st.temperatures is None:
            sampled, final = logits.argmax(-1), logits
        elif logits.is_cuda and st.unfiltered and not need_final:  # on the processed logits, if any
            from nanovllm.kernels.sampling import gumbel_max_sample
            sampled, final = gumbel_max_sample(logits, st.temperatures, self.kernel_seeds(logits.size(0), st)), None
        elif logits.is_cuda and st.top_k is None and not need_final:  # top_p and/or min_p, no sort
            from nanovllm.kernels.sampling import nucleus_sample
            sampled = nucleus_sample(logits, st.temperatures, st.top_p, st.min_p, self.kernel_seeds(logits.size(0), st))
            final = None
        elif logits.is_cuda and st.max_top_k and not need_final:  # top_k on every sampling row: no sort
            from nanovllm.kernels.sampling import topk_sample
            values, ids = topk(logits, st.max_top_k)
            sampled = topk_sample(values.float(), ids, st.temperatures, st.top_k, st.top_p, st.min_p,
                                  self.kernel_seeds(logits.size(0), st))
            final = None
        else:
            sampled, final = self._sample(logits, st, need_final)
        for processor, state in st.processors:
            processor.update(state, sampled)
        if st.num_logprobs < 0:
            return sampled, None
        source, chosen = final if need_final else raw, sampled
        if st.logprob_rows.numel() < source.size(0):  # else they are all the rows, in order
            source, chosen = source[st.logprob_rows], sampled[st.logprob_rows]
        return sampled, token_logprobs(source, chosen, st.num_logprobs)

    def _sample(self, logits: torch.Tensor, st: SamplingTensors,
                need_final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sampled ids, the logits they were drawn from: scaled and filtered, greedy rows unscaled;
        None unless need_final).

        top_k and top_p run on the logits in descending order: each row's max_top_k largest
        (topk) when every sampling row has a top_k, else the sorted vocabulary; the draw
        happens in that order (the noise of a seeded row is that of its token ids), so no
        vocabulary-sized tensor is scattered back."""
        greedy = st.temperatures == 0
        scale = torch.where(greedy, 1.0, st.temperatures).unsqueeze(1)  # float32: the quotient is float32
        if (st.top_k is not None or st.top_p is not None) and not need_final:
            # in the order of logits / scale; greedy rows take the argmax, the first maximum as transformers'
            values, ids = topk(logits, st.max_top_k) if st.max_top_k else logits.sort(-1, descending=True)
            choice = (self._filter_sorted(values / scale, st) + self._noise(ids, st)).argmax(-1, keepdim=True)
            return torch.where(greedy, logits.argmax(-1), ids.gather(1, choice).squeeze(1)), None
        logits = logits / scale
        if st.top_k is not None or st.top_p is not None:  # processed logprobs: the filtered logits in vocabulary order
            values, order = logits.sort(-1, descending=True)
            logits = torch.empty_like(logits).scatter_(-1, order, self._filter_sorted(values, st))
        elif st.min_p is not None:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < st.min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), float("-inf"))
        token_ids = torch.arange(logits.size(1), device=logits.device).expand_as(logits)
        return torch.where(greedy, logits.argmax(-1), (logits + self._noise(token_ids, st)).argmax(-1)), logits

    def kernel_seeds(self, rows: int, st: SamplingTensors) -> torch.Tensor:
        """[rows] int32 seeds of the Gumbel noise drawn by hashing (the Triton samplers',
        tp_shards'), on st.temperatures' device: seeded rows' own, the others' from the
        engine's generator (fresh each step)."""
        device = st.temperatures.device
        gen = self._default_generator(device)
        seeds = torch.randint(0, 2**31 - 1, (rows,), dtype=torch.int32, device=device, generator=gen)
        if st.seeds is not None:
            seeds[st.seeds[0]] = st.seeds[1].to(torch.int32)
        return seeds

    def _noise(self, token_ids: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """Gumbel noise [N, M] float32 at token_ids [N, M]: the engine's generator's, seeded rows' from
        their seeds. Exp(1) can round to 0: clamped, so that no filtered (-inf) logit can win."""
        noise = -torch.empty(token_ids.shape, device=token_ids.device).exponential_(
            generator=self._default_generator(token_ids.device)).clamp_min_(1e-20).log_()
        if st.seeds is not None:
            rows, seeds = st.seeds
            noise[rows] = gumbel_noise(seeds, token_ids[rows])
        return noise

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
