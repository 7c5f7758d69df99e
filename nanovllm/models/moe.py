"""Mixture-of-experts decoders: the shared decoder (decoder.py) whose MLP blocks are, where the
config says, a sparse block of experts (SparseMoeBlock): a router picks each token's top-k
experts and FusedMoE sums their SwiGLU outputs, weighted by the router.

Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention; layer i is sparse unless listed in
mlp_only_layers, and when (i + 1) % decoder_sparse_step == 0 (else a dense SwiGLU MLP of
intermediate_size); experts of moe_intermediate_size; the top-k probabilities renormalised when
norm_topk_prob. Mixtral: Llama's attention, every layer sparse with experts of
intermediate_size, top-k always renormalised.

To add a mixture-of-experts model: a subclass here that says which layers are sparse (make_mlp),
the experts' size and routing, and its checkpoint's expert names (expert_mapping), then its
name in registry.py.
"""
import torch
from torch import nn

from nanovllm.distributed.process_group import DOWN_PROJ_SLOT
from nanovllm.distributed.state import TensorParallel
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import ReplicatedLinear, norm_linear_input
from nanovllm.layers.linear_method import LinearMethod
from nanovllm.layers.moe_method import moe_method
from nanovllm.models.decoder import DecoderForCausalLM, DecoderMLP


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as experts: the router (gate [num_experts, hidden], replicated on every
    rank and never quantized, as vLLM keeps it) scores the experts, and the experts (FusedMoE)
    choose each token's top_k by those logits and sum their outputs. With tensor parallelism the
    output is this rank's partial sums, written where the two-GPU sum reads them (DOWN_PROJ_SLOT)."""

    def __init__(self, config, intermediate_size: int, renormalize: bool, tp: TensorParallel,
                 quant_method: LinearMethod | None = None):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
        self.group = tp.group
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, tp)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size, intermediate_size,
                                tp, renormalize, moe_method(quant_method))

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts(norm(r)), r) for r = x + residual; x, residual: [num_tokens, hidden_size]."""
        router_logits, residual, x = norm_linear_input(x, residual, norm, self.gate)
        out = self.group.partial_sums_buffer(x.size(0), x.dtype, DOWN_PROJ_SLOT) if self.group else None
        return self.experts(x, router_logits, out), residual


def experts_split(hf_config, expert_size: str, expert_parallel: bool) -> dict[str, int]:
    """What tensor parallelism splits of a mixture of experts: the experts (expert parallelism,
    num_experts, which transformers' Mixtral config names num_local_experts too) or each expert's
    intermediate size (the config's field expert_size)."""
    if expert_parallel:
        return {"num_experts": hf_config.num_experts}
    return {expert_size: getattr(hf_config, expert_size)}


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k norms), sparse layers as decoder_sparse_step and
    mlp_only_layers say."""
    qk_norm = True
    # checkpoint name of an expert's projection (experts.{e}.<name>.weight) -> (FusedMoE parameter, shard id)
    expert_mapping = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", None)}

    @staticmethod
    def sparse(config, layer_idx: int) -> bool:
        """Whether layer layer_idx is a sparse (experts) layer, as transformers' Qwen3MoeDecoderLayer decides."""
        return (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (layer_idx + 1) % config.decoder_sparse_step == 0)

    def make_mlp(self, config, layer_idx, tp, quant_method):
        if self.sparse(config, layer_idx):
            return SparseMoeBlock(config, config.moe_intermediate_size, config.norm_topk_prob, tp, quant_method)
        return DecoderMLP(config, tp, quant_method)

    @classmethod
    def split_sizes(cls, hf_config, expert_parallel=False):
        layers = range(hf_config.num_hidden_layers)
        sizes = experts_split(hf_config, "moe_intermediate_size", expert_parallel)
        if not all(cls.sparse(hf_config, i) for i in layers):
            sizes["intermediate_size"] = hf_config.intermediate_size
        return sizes


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral: Llama's attention, every layer sparse, top-k renormalised (softmax, then top-k)."""
    expert_mapping = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", None)}
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}  # its checkpoints' name for the sparse block

    @classmethod
    def check_config(cls, hf_config, tp_size, expert_parallel=False):
        if getattr(hf_config, "sliding_window", None) is not None:
            raise ValueError(f"Mixtral with sliding_window={hf_config.sliding_window} is not supported (no "
                             f"sliding-window attention here); only sliding_window=None")
        super().check_config(hf_config, tp_size, expert_parallel)

    def make_mlp(self, config, layer_idx, tp, quant_method):
        return SparseMoeBlock(config, config.intermediate_size, True, tp, quant_method)

    @classmethod
    def split_sizes(cls, hf_config, expert_parallel=False):
        return experts_split(hf_config, "intermediate_size", expert_parallel)
