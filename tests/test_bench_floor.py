"""bench.py's roofline floor counts what an engine must do and no more (it must stay a lower bound)."""
import math

from bench import floor_seconds, weights_read_per_step
from nanovllm.loader.source import read_hf_config, resolve_path


def _config(name):
    return read_hf_config(*resolve_path(name, "dummy"))


def test_weights_of_qwen3_0_6b():
    """Qwen3-0.6B's published config: tied embeddings, so the LM head is read once and is the only
    vocabulary-sized matrix; 28 layers of q/k/v/o (1024 -> 2048 + 1024 + 1024, 2048 -> 1024) and
    gate/up/down (1024 -> 2 x 3072, 3072 -> 1024) products."""
    nbytes, matmul_params, head_params = weights_read_per_step(_config("Qwen/Qwen3-0.6B"))
    layer = 1024 * 4096 + 2048 * 1024 + 1024 * 6144 + 3072 * 1024
    assert head_params == 151936 * 1024
    assert matmul_params == 28 * layer + head_params
    norms = 28 * (2 * 1024 + 2 * 128) + 1024  # two RMSNorms and q/k norms per layer, the final norm
    assert nbytes == 2 * (matmul_params + norms)


def test_floor_counts_the_lm_head_once_per_prompt():
    """With unbounded bandwidth the floor is the FLOPs at the matmul rate: a prompt's tokens each
    pass the decoder's products, only its last one the LM head (the logits of the first output
    token), and each decode step's tokens pass both; causal attention over every (query, key) pair."""
    config = _config("Qwen/Qwen3-0.6B")
    weights = weights_read_per_step(config)
    _, matmul_params, head_params = weights
    attention = 4 * 28 * 16 * 128  # QK^T and PV per (query, key) pair, all layers and heads
    lens, max_tokens = [3, 5], [1, 3]
    prefill = 2 * (matmul_params - head_params) * 8 + 2 * head_params * 2 + attention * (6 + 15)
    decode = [2 * matmul_params + attention * (5 + t) for t in (1, 2)]  # the second prompt's tokens 2 and 3
    floor = floor_seconds(config, weights, [[0] * n for n in lens], max_tokens, "auto", math.inf, 1.0)
    assert floor == prefill + sum(decode)


def test_random_adapters_fit_qwen3_0_6b(tmp_path):
    """bench.py --lora's adapters are PEFT adapters the engine accepts: two of rank 8 on q and v."""
    from types import SimpleNamespace

    from bench import random_adapters
    from nanovllm.loader.lora import check_adapter, lora_targets
    args = SimpleNamespace(model="Qwen/Qwen3-0.6B", load_format="dummy", lora=2, lora_rank=8,
                           lora_targets=["q_proj", "v_proj"])
    requests = random_adapters(args, str(tmp_path))
    targets = lora_targets(_config("Qwen/Qwen3-0.6B"))
    for request in requests:
        info = check_adapter(request, targets, 8)
        assert info.rank == 8 and info.scale == 2.0 and len(info.modules) == 2 * 28
    assert [r.lora_int_id for r in requests] == [1, 2]
