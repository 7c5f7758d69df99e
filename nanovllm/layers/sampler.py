import torch
from torch import nn


class Sampler(nn.Module):
    """Picks one token per row of logits in a single batched pass (no per-row host work).

    forward(logits [N, vocab] (float32 or the model dtype), temperatures [N] or None (all greedy), top_k [N] int or None, top_p [N] or None,
    min_p [N] or None, generators: {row: torch.Generator} for rows with a per-request seed) -> [N] int64.

    Rows with temperature 0 take the argmax. On CUDA, a batch with no filters and no per-request
    seeds is sampled in one pass by the Gumbel-max kernel (sampling_kernel.py), the same distribution. The others are scaled by 1/temperature, then filtered
    in vLLM's order of meaning: min_p (drop tokens below min_p * the top probability), top_k (keep
    the k largest; k <= 0 keeps all), top_p (keep the smallest set whose mass reaches top_p, the top
    token always kept). Sampling uses the exponential race argmax(p / E), E ~ Exp(1), which draws
    exactly from p; each seeded row draws its E from its own generator, so it repeats regardless of
    what else is in the batch.
    """

    def __init__(self, seed: int | None = None):
        super().__init__()
        self.seed = seed
        self.generator: torch.Generator | None = None

    def forward(self, logits, temperatures=None, top_k=None, top_p=None, min_p=None, generators=None):
        if temperatures is None:  # every row is greedy
            return logits.argmax(-1)
        if logits.is_cuda and top_k is None and top_p is None and min_p is None and not generators:
            from nanovllm.layers.sampling_kernel import gumbel_max_sample
            gen = self._default_generator(logits.device)
            seeds = torch.randint(0, 2**31 - 1, (logits.size(0),), dtype=torch.int32, device=logits.device, generator=gen)
            return gumbel_max_sample(logits, temperatures, seeds)
        logits = logits.float()
        greedy = logits.argmax(-1)
        logits = logits / temperatures.clamp_min(1e-5).unsqueeze(1)
        if min_p is not None:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), float("-inf"))
        if top_k is not None or top_p is not None:
            logits = self._top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=self._default_generator(probs.device))
        noise.clamp_min_(1e-20)  # Exp(1) can round to 0
        for row, gen in (generators or {}).items():
            noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(-1)
        return torch.where(temperatures > 0, sampled, greedy)

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
