"""bench.py's roofline floor counts what an engine must do and no more (it must stay a lower bound)."""
import math

import pytest

from bench import floor_seconds, weights_read_per_step
from nanovllm.loader.source import read_hf_config, resolve_path


def _config(name):
    return read_hf_config(*resolve_path(name, "dummy"))


def test_weights_of_qwen3_0_6b():
    """Qwen3-0.6B's published config: tied embeddings, so the LM head is read once and is the only
    vocabulary-sized matrix; 28 layers of q/k/v/o (1024 -> 2048 + 1024 + 1024, 2048 -> 1024) and
    gate/up/down (1024 -> 2 x 3072, 3072 -> 1024) products."""
    nbytes, matmul_params, head_params, *experts = weights_read_per_step(_config("Qwen/Qwen3-0.6B"))
    assert experts == [0, 0, 0, 0]
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
    _, matmul_params, head_params, *_ = weights
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


def test_weights_of_qwen3_30b_a3b():
    """Qwen3-30B-A3B's published config: 48 sparse layers of 128 experts (2048 -> 2 x 768 -> 2048),
    8 per token. A step reads the dense weights (attention, routers, norms, the untied LM head)
    and the experts its tokens touch: 8 per layer for one token (~6.1 GB in bf16, the brief's
    ~6.0 GB per token), all 128 for a few hundred; each token multiplies its 8 experts' weights."""
    config = _config("Qwen/Qwen3-30B-A3B")
    w = weights_read_per_step(config)
    expert = 3 * 2048 * 768
    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048
    assert (w.moe_layers, w.num_experts, w.top_k, w.expert_bytes) == (48, 128, 8, 2 * expert)
    assert w.head_params == 151936 * 2048
    assert w.matmul_params == 48 * (attention + 128 * 2048 + 8 * expert) + w.head_params
    norms = 48 * (2 * 2048 + 2 * 128) + 2048
    assert w.nbytes == 2 * (48 * (attention + 128 * 2048) + w.head_params + norms)
    assert w.experts_touched(1) == 8 and w.nbytes_for(1) == w.nbytes + 48 * 8 * w.expert_bytes
    assert 6.0e9 < w.nbytes_for(1) < 6.2e9
    assert w.experts_touched(8) == 128 * (1 - (1 - 1 / 16) ** 8)
    assert 127.99 < w.experts_touched(256) < 128
    fp8 = weights_read_per_step(config, "fp8")
    assert fp8.expert_bytes == expert + 4 * (2 * 768 + 2048) and fp8.matmul_params == w.matmul_params


def test_floor_of_a_moe_step_reads_the_touched_experts():
    """With unbounded FLOPs a step costs its bytes: one decode step of 1 and of 3 sequences read
    the dense weights and the experts 1 and 3 tokens touch, plus their KV."""
    config = _config("Qwen/Qwen3-30B-A3B")
    w = weights_read_per_step(config)
    kv_per_token = 2 * 48 * 4 * 2 * 128
    floor = floor_seconds(config, w, [[0] * 4] * 3, [1, 1, 2], "auto", 1.0, math.inf)
    prefill = w.nbytes_for(12) + 12 * kv_per_token
    decode = w.nbytes_for(1) + (4 + 1 + 1) * kv_per_token  # the third sequence's second token
    assert floor == pytest.approx(prefill + decode, rel=1e-12)
