"""Speculative decoding with an EAGLE-3 head (speculative_config {"method": "eagle3", "model": head}):
a tiny random head in the published checkpoint format (LlamaForCausalLMEagle3: fc, midlayer, norm,
lm_head over a smaller vocabulary, d2t, t2d; no embedding) beside a tiny Qwen3. Every proposal
equals a float32 reference written from the architecture (Li et al. 2025; vLLM's llama_eagle3.py),
recomputed from scratch over transformers' hidden states; greedy outputs equal the plain engine's
through chunked prefill, preemption, prefix hits and n > 1; what does not combine fails up front."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from nanovllm import LLM, SamplingParams
from tests.conftest import COMMON, VOCAB, random_prompts
from tests.test_spec_decode import ARGS, outputs, repetitive_prompts

AUX_IDS = [1, 0, 1]  # the target's layer inputs the head reads: out of order, one twice
DRAFT_VOCAB = 200
HEAD = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=64, intermediate_size=96,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1, vocab_size=VOCAB,
            draft_vocab_size=DRAFT_VOCAB, rms_norm_eps=1e-6, max_position_embeddings=64, rope_theta=10000.0,
            tie_word_embeddings=False, eagle_aux_hidden_state_layer_ids=AUX_IDS)


def write_head(path, speculators: bool = False, **overrides) -> dict[str, torch.Tensor]:
    """A random EAGLE-3 head for tiny_qwen3 saved at path (config.json, model.safetensors); its
    tensors. speculators: in the speculators format (Eagle3Speculator: the layer's config nested,
    norm_before_residual by default, the layer's tensors named layers.0, an embedding copy)."""
    config = HEAD | overrides
    h, inter, kv = config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"] * config["head_dim"]
    g = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    draft_ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values  # the target ids it can propose
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    w = {"fc.weight": rand(h, 3 * h), "midlayer.self_attn.q_proj.weight": rand(h, 2 * h),
         "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h), "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h),
         "midlayer.self_attn.o_proj.weight": rand(h, h), "midlayer.mlp.gate_proj.weight": rand(inter, h),
         "midlayer.mlp.up_proj.weight": rand(inter, h), "midlayer.mlp.down_proj.weight": rand(h, inter),
         "lm_head.weight": rand(DRAFT_VOCAB, h), "d2t": draft_ids - torch.arange(DRAFT_VOCAB), "t2d": t2d}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        w[f"{norm}.weight"] = 1 + rand(h)
    path.mkdir(parents=True, exist_ok=True)
    if speculators:
        layer = {k: v for k, v in config.items() if k not in ("architectures", "draft_vocab_size",
                                                             "eagle_aux_hidden_state_layer_ids")}
        config = dict(architectures=["Eagle3Speculator"], speculators_model_type="eagle3", transformer_layer_config=layer,
                      draft_vocab_size=DRAFT_VOCAB, eagle_aux_hidden_state_layer_ids=AUX_IDS,
                      speculators_config={"algorithm": "eagle3", "proposal_methods": [{"speculative_tokens": 3}]})
        saved = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()} | {"embed_tokens.weight": rand(VOCAB, h)}
    (path / "config.json").write_text(json.dumps(config))
    save_file(saved if speculators else w, str(path / "model.safetensors"))
    return w


@pytest.fixture(scope="module", params=["eagle3", "speculators"])
def head(request, tmp_path_factory):
    """(directory, tensors, norm_before_residual) of a head in the published format, or in the
    speculators format (whose default norm_before_residual the reference then follows)."""
    path = tmp_path_factory.mktemp(request.param)
    return str(path), write_head(path, speculators=request.param == "speculators"), request.param == "speculators"


def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_gaps(target, w, tokens: list[int], drafts: list[int],
                   norm_before_residual: bool = False) -> list[tuple[float, float]]:
    """For each of the head's drafts after `tokens` (the last one just sampled), (the reference's best
    logit less the draft's, the logits' norm): 0 where the draft is the reference's argmax. The
    reference recomputes every step from scratch, fed the head's own drafts: target hidden states
    from transformers (hidden_states[j] is layer j's input), position p of the head reading token
    p + 1 and fc of the target's states at p, a drafted position the prenorm of the one before."""
    config = LlamaConfig(**{k: v for k, v in HEAD.items() if k != "architectures"})
    target_of = w["d2t"] + torch.arange(DRAFT_VOCAB)
    with torch.no_grad():
        states = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        hidden = F.linear(torch.cat([states[j][0] for j in AUX_IDS], -1), w["fc.weight"])
        embed, inputs, gaps = target.model.embed_tokens.weight, list(tokens[1:]), []
        rotary = LlamaRotaryEmbedding(config)
        for draft in drafts:
            n = len(inputs)
            normed = rms(hidden, w["midlayer.hidden_norm.weight"])
            x = torch.cat([rms(embed[inputs], w["midlayer.input_layernorm.weight"]), normed], -1)
            q, kk, v = (F.linear(x, w[f"midlayer.self_attn.{p}_proj.weight"]).view(n, -1, 16).transpose(0, 1)
                        for p in "qkv")
            cos, sin = rotary(x, torch.arange(n)[None])
            q, kk = apply_rotary_pos_emb(q[None], kk[None], cos, sin)
            kk, v = kk[0].repeat_interleave(2, 0), v.repeat_interleave(2, 0)
            a = F.scaled_dot_product_attention(q[0], kk, v, is_causal=True).transpose(0, 1).reshape(n, -1)
            r = F.linear(a, w["midlayer.self_attn.o_proj.weight"]) + (normed if norm_before_residual else hidden)
            m = rms(r, w["midlayer.post_attention_layernorm.weight"])
            pre = F.linear(F.silu(F.linear(m, w["midlayer.mlp.gate_proj.weight"])) * F.linear(m, w["midlayer.mlp.up_proj.weight"]),
                           w["midlayer.mlp.down_proj.weight"]) + r
            logits = F.linear(rms(pre[-1], w["norm.weight"]), w["lm_head.weight"])
            chosen = (target_of == draft).nonzero().flatten()
            gaps.append((float(logits.max() - logits[chosen[0]]) if len(chosen) else float("inf"), float(logits.norm())))
            inputs.append(draft)
            hidden = torch.cat([hidden, pre[-1:]])
    return gaps


def record_proposals(llm, k: int) -> list[tuple[list[int], list[int]]]:
    """Wrap the engine's proposer: (the sequence's tokens, its drafts) of each proposal, in a list
    that fills as the engine runs. Drafts are accepted by force, 0 to k of them (as the replay
    proposer's are), so that catch-ups run over drafted positions, computed anew: a random head's
    drafts would all be rejected."""
    proposer, seen = llm.engine.speculator.proposer, []
    propose = proposer.propose

    def record(seqs):
        drafts = propose(seqs)
        seen.extend((list(seq.token_ids), d) for seq, d in zip(seqs, drafts))
        return drafts
    proposer.propose = record
    proposer.forced_acceptance = lambda seq: len(seq) % (k + 1)
    return seen


def test_every_proposal_is_the_reference_heads_argmax(tiny_qwen3, head):
    """Proposals at each step of several sequences (prompts prefilled in chunks, so that the head's
    first catch-up reads hidden states the target wrote over several steps, and a 50-token prompt's
    catch-up is itself cut by the step budget; n = 2, whose forks copy a partial block; drafts
    accepted by force) are the reference's argmax at every draft, and every draft is a token the
    head's vocabulary has."""
    path, target = tiny_qwen3
    head_path, w, norm_before_residual = head
    k = 3
    llm = LLM(path, **ARGS, max_num_batched_tokens=40,
              speculative_config={"method": "eagle3", "model": head_path, "num_speculative_tokens": k})
    seen = record_proposals(llm, k)
    prompts = repetitive_prompts()[:2] + random_prompts([7, 50], seed=5)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2), use_tqdm=False)
    proposed = [(tokens, d) for tokens, d in seen if d]  # none: a catch-up cut by the step's budget
    assert len(proposed) > 20 and len(proposed) < len(seen) and all(len(d) == k for _, d in proposed)
    allowed = set(w["t2d"].nonzero().flatten().tolist())
    for tokens, drafts in proposed:
        assert [gap for gap, _ in reference_gaps(target, w, tokens, drafts, norm_before_residual)] == [0] * k
        assert set(drafts) <= allowed


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 40},  # the target's and the head's prompts in chunks
    {"num_kvcache_blocks": 9, "max_model_len": 128},  # the target preempts
])
def test_greedy_outputs_with_an_eagle3_head_equal_plain_outputs(tiny_qwen3, head, engine_args):
    path, _ = tiny_qwen3
    prompts = repetitive_prompts() + random_prompts([7, 23, 60], seed=3)
    prompts.append(prompts[0][:20] + [3, 4])  # a prefix hit: its hidden states were written for another sequence
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)
    expected = outputs(LLM(path, **ARGS, **engine_args), prompts, params)
    spec = LLM(path, **ARGS, **engine_args,
               speculative_config={"method": "eagle3", "model": head[0], "num_speculative_tokens": 3})
    for _ in range(2):
        assert outputs(spec, prompts, params) == expected
    proposer = spec.engine.speculator.proposer
    assert spec.engine.spec_metrics.num_drafts > 20
    if "num_kvcache_blocks" in engine_args:
        assert spec.engine.scheduler.num_preemptions > 0
    assert proposer.block_manager.num_free_blocks == proposer.runner.num_kvcache_blocks  # shadows freed


def test_what_an_eagle3_head_cannot_do_fails_up_front(tiny_qwen3, head, tmp_path):
    path, _ = tiny_qwen3
    spec = {"method": "eagle3", "model": head[0], "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="is an EAGLE-3 draft head, not a model to serve"):
        LLM(head[0], **ARGS)
    with pytest.raises(ValueError, match='is an EAGLE-3 draft head.*"method": "eagle3"'):  # as a draft model
        LLM(path, **ARGS, speculative_config={"model": head[0], "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="runs with tensor_parallel_size=1"):
        LLM(path, **ARGS, tensor_parallel_size=2, speculative_config=spec)
    with pytest.raises(ValueError, match='goes with methods draft_model and eagle3'):
        LLM(path, **ARGS, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"needs an EAGLE-3 head"):
        LLM(path, **ARGS, speculative_config=spec | {"model": path})
    (tmp_path / "medusa").mkdir()
    (tmp_path / "medusa" / "config.json").write_text(json.dumps({"speculators_model_type": "medusa"}))
    with pytest.raises(ValueError, match="needs speculators_model_type \"eagle3\".*got speculators_model_type 'medusa'"):
        LLM(path, **ARGS, speculative_config=spec | {"model": str(tmp_path / "medusa")})
    write_head(tmp_path / "wide", hidden_size=128, target_hidden_size=128)
    with pytest.raises(ValueError, match="for a target of hidden_size 128; this target's is 64"):
        LLM(path, **ARGS, speculative_config=spec | {"model": str(tmp_path / "wide")})
    write_head(tmp_path / "deep", eagle_aux_hidden_state_layer_ids=[0, 1, COMMON["num_hidden_layers"]])
    with pytest.raises(ValueError, match=r"ids in \[0, 2\)"):
        LLM(path, **ARGS, speculative_config=spec | {"model": str(tmp_path / "deep")})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_eagle3_head_under_cuda_graphs(tiny_qwen3, head):
    """The head's steps replay its graphs (reading the hidden-state input they captured), the
    target's verify steps its q_len 1 + k ones; each draft is the reference's argmax up to twice
    the TF32 error of test_spec_decode.tf32_greedy, until the first draft that is not (its later
    drafts follow it); greedy outputs are transformers' up to TF32 near-ties."""
    path, target = tiny_qwen3
    head_path, w, norm_before_residual = head
    k = 3
    args = dict(device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.3, kvcache_block_size=16)
    spec = LLM(path, **args, speculative_config={"method": "eagle3", "model": head_path, "num_speculative_tokens": k})
    assert spec.engine.speculator.proposer.runner.graph_runner.chains  # its k - 1 greedy steps: one graph
    assert (1, 1 + k) in spec.engine.model_runner.graph_runner.graphs
    seen = record_proposals(spec, k)
    prompts = repetitive_prompts() + random_prompts([9, 30], seed=4)
    outputs(spec, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert len(seen) > 20
    near_ties = 0
    for tokens, drafts in seen:
        for gap, norm in reference_gaps(target, w, tokens, drafts, norm_before_residual):
            assert gap <= 2 * 3e-3 * norm
            if gap > 0:
                near_ties += 1
                break
    assert near_ties < len(seen) / 4
