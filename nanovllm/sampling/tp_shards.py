"""Tensor parallelism's draw from vocabulary shards: where every row only scales by temperature
(or is greedy) and none asks for logprobs, each rank draws the Gumbel-max candidates of its shard
of the vocabulary with rank 0's temperatures and seeds (one broadcast of [2, N] int32), and rank 0
takes each row's best of all (one gather): the Sampler's draw from whole rows, without gathering
them (78 MB of bf16 logits for 256 rows of Qwen3's vocabulary)."""
import torch
import torch.distributed as dist

from nanovllm.sampling.sampler import Sampler, SamplingTensors, gumbel_noise


def draws_from_shards(st: SamplingTensors) -> bool:
    """Whether a step's rows may be drawn from the ranks' vocabulary shards: temperature (or
    greedy) alone, no logits processor, no logprobs."""
    return st.only_temperature and st.num_logprobs < 0


def sample_from_shards(logits: torch.Tensor, st: SamplingTensors, sampler: Sampler, lm_head) -> torch.Tensor | None:
    """Every rank: logits [N, vocab / tp_size] of this rank's shard (lm_head's vocab_start and
    num_real real columns); st: rank 0's SamplingTensors (the others': for_workers()). Returns
    the token ids [N] int64 on rank 0, None elsewhere."""
    rank, size = lm_head.tp_rank, lm_head.tp_size
    params = torch.zeros(2, logits.size(0), dtype=torch.int32, device=logits.device)  # temperatures' bits, seeds
    if rank == 0 and st.temperatures is not None:  # else all greedy: no noise, no seeds
        params[0] = st.temperatures.view(torch.int32)
        params[1] = sampler.kernel_seeds(logits.size(0), st)
    dist.broadcast(params, 0)
    maxima, ids = shard_candidates(logits, params[0].view(torch.float32), params[1], lm_head.vocab_start,
                                   lm_head.num_real)
    mine = torch.stack([maxima.view(torch.int32), ids.to(torch.int32)])  # [2, N, C]: one message
    parts = [torch.empty_like(mine) for _ in range(size)] if rank == 0 else None
    dist.gather(mine, parts, 0)
    if rank != 0:
        return None
    both = torch.cat(parts, 2)  # the ranks' shards in vocabulary order
    return first_max(both[0].view(torch.float32), both[1].long())


def shard_candidates(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, offset: int,
                     width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gumbel-max draw's candidates from a vocabulary shard: logits [N, W] of tokens offset +
    [0, W), of which the first `width` are real; temperatures [N] float32 (0: greedy), seeds [N]
    int32, whose noise at token t is gumbel_noise(seed, t) on every shard. Returns (maxima [N, C]
    float32, their token ids [N, C] int64), for first_max over the candidates of all shards in
    vocabulary order: the token argmax(logits / T + G) over the whole vocabulary. On CUDA the
    Gumbel-max kernel's per-chunk maxima (C = its chunks, in base 2); elsewhere torch's (C = 1)."""
    if logits.is_cuda:
        from nanovllm.kernels.sampling import gumbel_max_candidates
        return gumbel_max_candidates(logits, temperatures, seeds, offset, width)
    x = logits[:, :width].float()
    hot = temperatures > 0
    ids = torch.arange(offset, offset + width, device=x.device).expand_as(x)
    x = torch.where(hot.unsqueeze(1), x / torch.where(hot, temperatures, 1.0).unsqueeze(1)
                    + gumbel_noise(seeds.long(), ids), x)
    maxima, index = x.max(1, keepdim=True)  # the first maximum
    return maxima, index + offset


def first_max(maxima: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Candidates maxima [N, C] with their token ids [N, C] int64, in vocabulary order -> each
    row's id of the largest [N], the first on ties (as argmax over the whole row)."""
    return ids.gather(1, maxima.argmax(1, keepdim=True)).squeeze(1)
