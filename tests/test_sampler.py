import pytest
import torch

from nanovllm.layers.sampler import Sampler, SamplingTensors


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


def test_per_request_seed_repeats_whatever_the_batch():
    x = logits(n=3, vocab=1000, seed=5)
    temps = torch.ones(3)

    def draw(rows, gen_seed):
        gens = {r: torch.Generator().manual_seed(gen_seed) for r in rows}
        return sample(Sampler(), x, temps, generators=gens)

    a, b = draw([0, 2], 42), draw([0, 2], 42)
    assert a[0] == b[0] and a[2] == b[2]
    seq_a = [sample(Sampler(), x[:1], temps[:1], generators={0: g}).item() for g in [torch.Generator().manual_seed(7)] * 20]
    g = torch.Generator().manual_seed(7)
    seq_b = [sample(Sampler(), x[:1], temps[:1], generators={0: g}).item() for _ in range(20)]
    assert seq_a == seq_b and len(set(seq_a)) > 1


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
    from nanovllm.layers.sampling_kernel import gumbel_max_sample
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
    wide = torch.randn(3, 20000).to(device)  # spans several chunks; ties across chunks take the first
    wide[:, 9000] = wide[:, 17000] = 10.0
    assert gumbel_max_sample(wide, torch.zeros(3, device=device), seeds[:3]).tolist() == [9000] * 3


def test_top_k_path_draws_what_the_sorted_path_draws():
    """With top_k on every sampling row the filters run on torch.topk's values (no sort of the
    vocabulary); seeded rows must draw the very same tokens as on the sorted path, with min_p and
    top_p too, and greedy rows take the argmax."""
    x = logits(n=4, vocab=3000, seed=8)
    temps = torch.tensor([0.7, 1.3, 0.0, 1.0])
    kwargs = dict(top_k=torch.tensor([5, 40, 0, 300]), top_p=torch.tensor([0.9, 0.6, 1.0, 0.95]),
                  min_p=torch.tensor([0.0, 0.05, 0.0, 0.01]))
    for trial in range(40):
        gens = [{r: torch.Generator().manual_seed(trial * 10 + r) for r in (0, 1, 3)} for _ in range(2)]
        fast = sample(Sampler(), x, temps, max_top_k=300, generators=gens[0], **kwargs)
        slow = sample(Sampler(), x, temps, generators=gens[1], **kwargs)
        assert torch.equal(fast, slow), trial
    assert fast[2] == x[2].argmax()
