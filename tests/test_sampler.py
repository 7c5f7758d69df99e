import pytest
import torch

from nanovllm.sampling.sampler import Sampler, SamplingTensors, gumbel_noise

try:
    import triton
    import triton.language as tl

    from nanovllm.kernels.sampling import gumbel2_at

    @triton.jit
    def noise_kernel(k_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        k = tl.load(k_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + offs, gumbel2_at(k), mask=offs < n)
except ImportError:
    triton = None


def sample(sampler, x, temperatures=None, **kwargs):
    return sampler(x, SamplingTensors(temperatures, **kwargs))[0]


def logits(n=6, vocab=50, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits()
    assert torch.equal(Sampler()(x)[0], x.argmax(-1))
    mixed = torch.tensor([0.0, 1.0, 0.0, 0.7, 0.0, 2.0])
    out = sample(Sampler(seed=1), x, mixed)
    assert torch.equal(out[mixed == 0], x.argmax(-1)[mixed == 0])


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p"])
def test_filters_never_emit_outside_the_allowed_set(kind):
    x = logits(n=4, vocab=40, seed=3)
    probs = (x / 0.9).softmax(-1)
    temps = torch.full((4,), 0.9)
    if kind == "top_k":
        k = torch.tensor([1, 3, 7, 40])
        allowed = [set(probs[i].topk(int(k[i])).indices.tolist()) for i in range(4)]
        args = {"top_k": k}
    elif kind == "top_p":
        p = torch.tensor([0.05, 0.3, 0.6, 0.9])
        allowed = []
        for i in range(4):
            order = probs[i].argsort(descending=True)
            mass_before = probs[i][order].cumsum(0) - probs[i][order]
            allowed.append(set(order[mass_before < p[i]].tolist()))
        args = {"top_p": p}
    else:
        m = torch.tensor([0.0, 0.1, 0.5, 1.0])
        allowed = [set(torch.nonzero(probs[i] >= m[i] * probs[i].max()).flatten().tolist()) for i in range(4)]
        args = {"min_p": m}
    sampler = Sampler(seed=0)
    seen = [set() for _ in range(4)]
    for _ in range(400):
        for i, t in enumerate(sample(sampler, x, temps, **args).tolist()):
            seen[i].add(t)
    for i in range(4):
        assert seen[i] <= allowed[i], (kind, i)
    assert len(seen[3]) > 1 or kind == "min_p"  # the loosest setting really samples


def test_top_k_and_top_p_together():
    x = logits(n=1, vocab=30, seed=4)
    temps = torch.ones(1)
    order = x[0].argsort(descending=True)
    sampler = Sampler(seed=0)
    seen = {sample(sampler, x, temps, top_k=torch.tensor([5]), top_p=torch.tensor([0.999]))[0].item() for _ in range(300)}
    assert seen <= set(order[:5].tolist())


def seeds(rows, values):
    return torch.tensor(rows), torch.tensor(values)


def test_per_request_seed_repeats_whatever_the_batch():
    """A seeded row draws the same token whatever the other rows are and whichever path (sorted,
    top-k, plain) the batch takes; different seeds draw differently."""
    x = logits(n=3, vocab=1000, seed=5)
    temps = torch.ones(3)
    a = sample(Sampler(seed=1), x, temps, seeds=seeds([0, 2], [42, 43]))
    b = sample(Sampler(seed=2), x, temps, seeds=seeds([0, 2], [42, 43]))
    assert a[0] == b[0] and a[2] == b[2]
    alone = sample(Sampler(), x[2:], temps[:1], seeds=seeds([0], [43]))
    filtered = sample(Sampler(), x, temps, seeds=seeds([2], [43]), top_p=torch.tensor([0.5, 0.9, 1.0]))
    top_k = sample(Sampler(), x, temps, seeds=seeds([2], [43]), top_k=torch.tensor([3, 5, 1000]), max_top_k=1000)
    assert alone[0] == filtered[2] == top_k[2] == a[2]
    draws = [sample(Sampler(), x[:1], temps[:1], seeds=seeds([0], [s])).item() for s in range(30)]
    assert len(set(draws)) > 5


def test_engine_seed_repeats():
    x, temps = logits(n=8, vocab=500, seed=6), torch.ones(8)
    assert torch.equal(sample(Sampler(seed=3), x, temps), sample(Sampler(seed=3), x, temps))


def test_temperature_shapes_the_distribution():
    """Empirical frequencies follow softmax(logits / T): sharper for small T, flatter for large T."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    sampler = Sampler(seed=0)
    for t in (0.5, 1.0, 2.0):
        counts = torch.bincount(sample(sampler, x, torch.full((20000,), t)), minlength=4).float() / 20000
        expected = (x[0] / t).softmax(-1)
        assert (counts - expected).abs().max() < 0.015, (t, counts, expected)


def test_gumbel_max_kernel_samples_the_softmax():
    """The one-pass Triton sampler (Triton's interpreter without CUDA) draws from softmax(x / T)
    and takes the argmax where T == 0."""
    pytest.importorskip("triton")
    from nanovllm.kernels.sampling import gumbel_max_sample
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = 600 if device == "cpu" else 100000  # the interpreter runs one program per row
    row = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    x = row.repeat(n, 1).to(device)
    seeds = torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32).to(device)
    for t in (0.5, 1.0, 2.0):
        counts = torch.bincount(gumbel_max_sample(x, torch.full((n,), t, device=device), seeds).cpu(), minlength=5)
        expected = (row / t).softmax(-1)
        assert (counts.float() / n - expected).abs().max() < 4 * (0.25 / n) ** 0.5, (t, counts)
    flat = torch.zeros(n, 64, device=device)  # equal logits: every index equally likely
    counts = torch.bincount(gumbel_max_sample(flat, torch.ones(n, device=device), seeds).cpu(), minlength=64)
    expected = n / 64
    assert (counts - expected).abs().max() < 5 * expected ** 0.5, counts
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0]], device=device)
    assert gumbel_max_sample(ties, torch.zeros(1, device=device), seeds[:1]).item() == 1
    rows = torch.randn(4, 3000).to(device) * 3  # the kernel's noise is gumbel_noise's: seeded rows agree
    seeded = torch.tensor([7, 2**31 - 2, 0, 123456], device=device)
    token_ids = torch.arange(3000, device=device).expand(4, 3000)
    expected = (rows / 0.8 + gumbel_noise(seeded, token_ids)).argmax(-1)
    assert torch.equal(gumbel_max_sample(rows, torch.full((4,), 0.8, device=device), seeded.to(torch.int32)), expected)
    wide = torch.randn(3, 20000).to(device)  # spans several chunks; ties across chunks take the first
    wide[:, 9000] = wide[:, 17000] = 10.0
    assert gumbel_max_sample(wide, torch.zeros(3, device=device), seeds[:3]).tolist() == [9000] * 3


def test_gumbel_noise_is_finite_at_the_largest_hash():
    """Seed 148 hashes token 14,809 to the largest 24-bit value (found by search): U must stay
    below 1 in float32, or the noise is +inf and that token wins whatever its logit (it did, in a
    user's top_p run: a token of logprob -22.8). Both the torch noise and the kernel's."""
    seeds, token_ids = torch.tensor([148]), torch.tensor([[14809]])
    assert torch.isfinite(gumbel_noise(seeds, token_ids)).all()
    pytest.importorskip("triton")
    from nanovllm.kernels.sampling import gumbel_max_sample
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.zeros(1, 16384, device=device)
    logits[0, 14809] = -1e4  # must never be drawn
    drawn = gumbel_max_sample(logits, torch.ones(1, device=device), torch.tensor([148], dtype=torch.int32, device=device))
    expected = (logits.cpu() + gumbel_noise(seeds, torch.arange(16384).unsqueeze(0))).argmax(-1)
    assert drawn.item() != 14809 and drawn.cpu().item() == expected.item()


def test_kernel_noise_is_the_exact_noise_at_every_grid_point():
    """The kernels' Gumbel noise gumbel2_at(k) = -log2(-log2(U)), U = (k + 0.5) / 2^23, against
    float64 at every k on the GPU (a sample of 65,536 including both ends in the interpreter). The
    GPU's log2 is the hardware approximation: absolute error at most 2^-22 on [0.5, 2], 2 ulp
    elsewhere (CUDA C++ Programming Guide, intrinsic functions, __log2f). So -log2(U) for U <=
    15/16 errs by 2^-22, i.e. 2^-22 / (E ln 2) <= 3.70e-6 in the noise (E >= -log2(15/16)); the
    outer log2 by 2 ulp of |noise| <= 23.5, 3.81e-6; with float32 roundings, under 8e-6."""
    if triton is None:
        pytest.skip("needs triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k = torch.arange(2**23, dtype=torch.float64)
    if device == "cpu":
        k = torch.cat([k[:4096], k[torch.randperm(2**23, generator=torch.Generator().manual_seed(0))[:57344]], k[-4096:]])
    out = torch.full(k.shape, float("nan"), device=device)
    noise_kernel[(triton.cdiv(k.numel(), 4096),)](k.float().to(device), out, k.numel(), BLOCK=4096)
    exact = -torch.log2(-torch.log2((k + 0.5) / 2**23))
    assert (out.cpu().double() - exact).abs().max() < 8e-6


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_vocabulary_shards_draw_the_whole_rows_token(path):
    """Tensor parallelism's draw: the candidates of each vocabulary shard (the last one padded
    with columns that must not count), merged by first_max, are the Gumbel-max draw over whole
    rows: the same noise per token id, greedy rows' first maximum across shards."""
    from nanovllm.sampling.tp_shards import first_max, shard_candidates
    if path == "kernel":
        pytest.importorskip("triton")
        from nanovllm.kernels.sampling import gumbel_max_candidates as candidates, gumbel_max_sample
    device = "cuda" if path == "kernel" and torch.cuda.is_available() else "cpu"
    vocab, shards = 20000, 3
    width = -(-vocab // shards)
    x = logits(n=4, vocab=vocab, seed=11)
    x[2, 5000] = x[2, 15000] = 50.0  # a greedy row's tie across shards: the first
    temps = torch.tensor([0.7, 1.3, 0.0, 1.0])
    seeds = torch.tensor([3, 2**31 - 2, 5, 123456], dtype=torch.int32)
    padded = torch.cat([x, torch.full((4, width * shards - vocab), 1e4)], 1).to(device)
    parts = [(shard_candidates if path == "torch" else candidates)(
        padded[:, i * width:(i + 1) * width], temps.to(device), seeds.to(device), i * width, min(width, vocab - i * width))
        for i in range(shards)]
    merged = first_max(*(torch.cat(t, 1) for t in zip(*parts))).cpu()
    if path == "torch":
        noise = gumbel_noise(seeds.long(), torch.arange(vocab).expand(4, vocab))
        expected = torch.where(temps > 0, (x / torch.where(temps > 0, temps, 1).unsqueeze(1) + noise).argmax(-1),
                               x.argmax(-1))
    else:
        expected = gumbel_max_sample(x.to(device), temps.to(device), seeds.to(device)).cpu()
    assert merged[2] == 5000 and torch.equal(merged, expected)


def test_top_k_path_draws_what_the_sorted_path_draws():
    """With top_k on every sampling row the filters run on torch.topk's values (no sort of the
    vocabulary); seeded rows must draw the very same tokens as on the sorted path, with min_p and
    top_p too, and greedy rows take the argmax."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = logits(n=4, vocab=3000, seed=8).to(device)
    temps = torch.tensor([0.7, 1.3, 0.0, 1.0], device=device)
    kwargs = dict(top_k=torch.tensor([5, 40, 0, 60], device=device), min_p=torch.tensor([0.0, 0.05, 0.0, 0.01], device=device),
                  top_p=torch.tensor([0.9, 0.6, 1.0, 0.95], device=device))
    for trial in range(40):
        seeded = tuple(t.to(device) for t in seeds([0, 1, 3], [trial * 10 + r for r in (0, 1, 3)]))
        fast = sample(Sampler(), x, temps, max_top_k=60, seeds=seeded, **kwargs)
        slow = sample(Sampler(), x, temps, seeds=seeded, **kwargs)
        assert torch.equal(fast, slow), trial
    assert fast[2] == x[2].argmax()


def test_topk_kernel_draws_what_the_sorted_path_draws():
    """The top-k kernel (filters and draw over each row's max_top_k largest logits; Triton's
    interpreter without CUDA): every row seeded, so each must draw the sorted path's very token,
    with min_p and top_p too; greedy rows the argmax, also where two logits tie."""
    pytest.importorskip("triton")
    from nanovllm.kernels.sampling import topk_sample
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = logits(n=5, vocab=3001, seed=10)
    x[2, 17] = x[2, 2999] = x[2].max() + 1  # a greedy row with a tie: the first index
    temps = torch.tensor([0.7, 1.3, 0.0, 1.0, 2.0])
    kwargs = dict(top_k=torch.tensor([5, 40, 0, 37, 20]), min_p=torch.tensor([0.0, 0.3, 0.0, 0.1, 0.2]),
                  top_p=torch.tensor([0.9, 0.6, 1.0, 0.8, 0.5]))
    values, ids = x.topk(40, dim=-1)
    for trial in range(15):
        seeded = seeds(list(range(5)), [trial * 10 + r for r in range(5)])
        for names in (("top_k",), ("top_k", "min_p"), ("top_k", "top_p", "min_p")):
            chosen = {k: kwargs[k] for k in names}
            slow = sample(Sampler(), x, temps, seeds=seeded, **chosen)
            fast = topk_sample(values.to(device), ids.to(device), temps.to(device),
                               *(chosen[k].to(device) if k in chosen else None for k in ("top_k", "top_p", "min_p")),
                               seeded[1].to(torch.int32).to(device))
            assert torch.equal(fast.cpu(), slow), (trial, names, fast, slow)
            assert fast[2] == 17


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_of_temperature_sampling(dtype):
    """Raw logprobs next to plain temperature sampling (on CUDA: beside the Gumbel-max kernel): the
    float32 log-softmax of the logits as given, at the sampled token and the top k, with ranks."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = logits(n=5, vocab=1999, seed=3).to(device, dtype)
    rows = torch.tensor([0, 2, 3], device=device)
    sampled, lp = Sampler(seed=1)(x, SamplingTensors(torch.tensor([0.7, 1.0, 0.0, 1.5, 0.9], device=device),
                                                     num_logprobs=4, logprob_rows=rows))
    ref = x.float().log_softmax(-1)[rows]
    assert lp.token_ids.shape == lp.logprobs.shape == lp.ranks.shape == (3, 5)
    assert torch.equal(lp.token_ids[:, 0], sampled[rows]) and sampled[2] == x[2].argmax()
    torch.testing.assert_close(lp.logprobs[:, :1], ref.gather(1, sampled[rows, None]), rtol=0, atol=1e-5)
    assert torch.equal(lp.ranks[:, 0], (ref > ref.gather(1, sampled[rows, None])).sum(-1) + 1)
    top = ref.topk(4)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values, rtol=0, atol=1e-5)
    assert torch.equal(lp.ranks[:, 1:].cpu(), torch.arange(1, 5).expand(3, 4))
    assert torch.equal(ref.gather(1, lp.token_ids[:, 1:]), top.values)  # ids of the top values (ties allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logsumexp_and_rank_kernel(dtype):
    """The one-pass logprob kernel (Triton's interpreter without CUDA) against float32 torch, on a
    vocabulary of several chunks with a ragged end, -inf entries and ties with the token's logit."""
    pytest.importorskip("triton")
    from nanovllm.kernels.logits_stats import logsumexp_and_rank
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(3, 17001, generator=torch.Generator().manual_seed(9)) * 4).to(device, dtype)
    x[0, :9000] = float("-inf")  # a whole chunk of -inf and part of the next
    x[2, 5] = x[2, 16999] = x[2].max()  # the token ties with another entry: neither counts as above
    token_ids = torch.tensor([12000, 17000, 5], device=device)
    ref = x.float()
    lse, rank = logsumexp_and_rank(x, token_ids)
    torch.testing.assert_close(lse, ref.logsumexp(-1), rtol=1e-6, atol=1e-5)
    assert torch.equal(rank, (ref > ref.gather(1, token_ids[:, None])).sum(-1) + 1) and rank[2] == 1



@pytest.mark.parametrize("k", [1, 5, 33, 64])
@pytest.mark.parametrize("vocab", [2 * 2048 + 21, 12 * 2048 + 7])
def test_chunked_topk_kernel(k, vocab):
    """The chunked top-k (Triton's interpreter without CUDA) against torch.topk in float32: equal
    values, ids that hold them, no id twice; with fewer chunks than k (no threshold) and more (a
    threshold from the chunk maxima), a last chunk shorter than k, ties at the top across chunks,
    a row mostly -inf, and a bf16 row."""
    pytest.importorskip("triton")
    from nanovllm.kernels.logits_stats import chunked_topk
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(k)) * 3
    x[1, 100:110] = x[1, 3000:3005] = x[1, 4100] = 9.0  # 16 equal maxima over three chunks
    x[2, :] = float("-inf")
    x[2, [7, 2050, 4110]] = torch.tensor([1.0, 3.0, 2.0])  # fewer finite values than k (for k > 3)
    x[3] = x[3].bfloat16().float()
    for dtype in (torch.float32, torch.bfloat16):
        rows = x.to(device, dtype)
        values, ids = chunked_topk(rows, k)
        ref = rows.float().topk(k)
        assert values.dtype == torch.float32 and ids.dtype == torch.int64 and values.shape == ids.shape == (4, k)
        assert torch.equal(values, ref.values), dtype
        assert torch.equal(rows.float().gather(1, ids), values)
        assert all(len(set(r)) == k for r in ids.tolist())
    with pytest.raises(ValueError, match="k=65"):
        chunked_topk(x.to(device), 65)


def test_nucleus_kernel_draws_what_the_sorted_path_draws():
    """The nucleus kernel (top_p and/or min_p without sorting; Triton's interpreter without CUDA):
    seeded rows draw the sorted path's very token (the same noise, argmax over the same set),
    greedy rows the argmax; unseeded, the frequencies follow the renormalised nucleus."""
    pytest.importorskip("triton")
    from nanovllm.kernels.sampling import nucleus_sample
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = logits(n=5, vocab=9001, seed=9).to(device)  # three blocks of 4,096, the last partial
    temps = torch.tensor([0.7, 1.3, 0.0, 1.0, 2.0], device=device)
    top_p = torch.tensor([0.9, 0.6, 1.0, 0.95, 0.3], device=device)
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.01, 0.0], device=device)
    for trial in range(15):
        values = [trial * 10 + r for r in range(5)]
        seeded = tuple(t.to(device) for t in seeds(list(range(5)), values))
        for kwargs in (dict(top_p=top_p), dict(min_p=min_p), dict(top_p=top_p, min_p=min_p)):
            slow = sample(Sampler(), x.cpu(), temps.cpu(), seeds=tuple(t.cpu() for t in seeded),
                          **{k: v.cpu() for k, v in kwargs.items()})
            fast = nucleus_sample(x, temps, kwargs.get("top_p"), kwargs.get("min_p"),
                                  torch.tensor(values, dtype=torch.int32, device=device))
            assert torch.equal(fast.cpu(), slow), (trial, kwargs, fast, slow)
            assert fast[2] == x[2].argmax()
    n = 600 if device == "cpu" else 100000  # the interpreter runs one program per row
    row = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    p = row.softmax(-1)  # top_p 0.8 keeps 2.0, 1.0 and 0.5 (more probable mass before 0.5: 0.71)
    counts = torch.bincount(nucleus_sample(row.repeat(n, 1).to(device), torch.ones(n, device=device),
                                           torch.full((n,), 0.8, device=device), None,
                                           torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32).to(device)).cpu(),
                            minlength=5).float() / n
    expected = torch.zeros(5)
    expected[[0, 1, 4]] = p[[0, 1, 4]] / p[[0, 1, 4]].sum()
    assert (counts - expected).abs().max() < 4 * (0.25 / n) ** 0.5, counts


def test_penalty_kernel_equals_the_torch_penalties():
    """The one-pass penalty kernel (Triton's interpreter without CUDA) against the penalties in
    torch, on a vocabulary of two blocks (the last partial), with and without the prompt mask,
    counts read through count_rows, on three of four rows: the fourth left bit for bit."""
    pytest.importorskip("triton")
    from nanovllm.kernels.penalty import apply_penalties_kernel
    from nanovllm.sampling.processors.penalties import PenaltyState, apply_penalties
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(11)
    vocab = 5001
    x = torch.randn(4, vocab, generator=g) * 3
    counts = torch.randint(0, 4, (5, vocab), generator=g, dtype=torch.int32) * (torch.rand(5, vocab, generator=g) < 0.1)
    prompt_mask = torch.rand(5, vocab, generator=g) < 0.05
    rows, count_rows = torch.tensor([3, 0, 2]), torch.tensor([2, 4, 1])
    penalties = (torch.tensor([1.5, 0.0, -0.5]), torch.tensor([0.5, 0.0, 1.0]), torch.tensor([1.0, 1.3, 0.7]))
    for mask in (None, prompt_mask):
        ref = x.clone()
        apply_penalties(ref, PenaltyState(rows, count_rows, counts, mask, *penalties))
        out = x.clone().to(device)
        apply_penalties_kernel(out, *(t if t is None else t.to(device)
                                      for t in (rows, counts, mask, count_rows, *penalties)))
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(out[1].cpu(), x[1]) and torch.equal(ref[1], x[1])
        assert all(not torch.equal(ref[r], x[r]) for r in rows)
