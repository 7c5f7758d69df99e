"""A mixture-of-experts layer's experts, stacked (FusedMoE), which take the router's logits and
choose each token's experts themselves (vLLM's interface; moe_method.select_experts).

FusedMoE holds its experts' SwiGLU weights in two tensors, w13_weight [E, 2N, H] (each expert's
gate rows, then its up rows) and w2_weight [E, H, N], which the kernels index by expert. With
tensor parallelism each rank holds N = intermediate_size / tp_size of every expert's intermediate
dimension (Megatron-LM's split of a dense MLP, per expert); with expert parallelism
(enable_expert_parallel, vLLM's name) E = num_experts / tp_size whole experts, rank r experts
r * E to (r + 1) * E - 1, and the pairs of a token with another rank's experts are skipped there
(expert_map). Either way the layer's output is this rank's partial sums, which the next norm sums
over the ranks as it sums a RowParallelLinear's. Whole experts make larger GEMMs (an expert's
intermediate dimension is not cut), while every token still reaches every rank, where vLLM's
expert parallelism over data-parallel ranks sends each token only to its experts' ranks
(all-to-all); with one replica the sum after the experts is the only exchange either way.
Its method (moe_method.py) computes the product and decides what the weights are once loaded.
"""
import torch
from torch import nn

from nanovllm.distributed.state import TensorParallel
from nanovllm.layers.moe_method import MoEMethod


class FusedMoE(nn.Module):
    """num_experts SwiGLU experts of intermediate_size each over hidden_size features, top_k per
    token. forward(x [T, H], router_logits [T, num_experts], out) -> [T, H] in x's dtype:
    sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for the router's choice
    (select_experts; renormalize: the top-k weights divided by their sum) (this rank's partial
    sums with tensor parallelism), written to out when given. With tp.expert_parallel (and more
    than one rank) this rank holds num_local_experts whole experts from first_expert on;
    expert_map [num_experts] int32 gives each expert's index here, -1 for another rank's (None
    without expert parallelism). ValueError when the ranks do not divide num_experts."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, tp: TensorParallel,
                 renormalize: bool, quant_method: MoEMethod | None = None):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        expert_parallel = tp.expert_parallel and tp.size > 1
        if expert_parallel and num_experts % tp.size:
            raise ValueError(f"enable_expert_parallel needs tensor_parallel_size={tp.size} to divide "
                             f"num_experts={num_experts}")
        self.quant_method = quant_method or MoEMethod()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.num_local_experts = num_experts // tp.size if expert_parallel else num_experts
        self.first_expert = tp.rank * self.num_local_experts if expert_parallel else 0
        # the ranks that split each expert's intermediate dimension, and this one's place among them
        self.split_size, self.split_rank = (1, 0) if expert_parallel else (tp.size, tp.rank)
        self.intermediate_size = intermediate_size // self.split_size  # this rank's share of each expert's
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.intermediate_size))
        expert_map = None
        if expert_parallel:
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.first_expert:self.first_expert + self.num_local_experts] = torch.arange(
                self.num_local_experts, dtype=torch.int32)
        self.register_buffer("expert_map", expert_map, persistent=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader
        self.register_buffer("w13_weight_scale", None)
        self.register_buffer("w2_weight_scale", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int | None, int]):
        """Copy this rank's slice of one expert's checkpoint weight into `param` (nothing for another
        rank's expert). shard = (shard_id, expert): shard_id 0 or 1 for its gate or up projection
        [intermediate_size, H] (into w13_weight), None for its down projection [H,
        intermediate_size] (into w2_weight); expert: its id in the checkpoint."""
        shard_id, expert = shard
        n, dim = self.intermediate_size, 1 if shard_id is None else 0
        full = (param.size(1), n * self.split_size) if shard_id is None else (n * self.split_size, param.size(2))
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has num_experts={self.num_experts}")
        if tuple(loaded.shape) != full:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {full}")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        rows = param.data[local] if shard_id is None else param.data[local].narrow(0, shard_id * n, n)
        rows.copy_(loaded.narrow(dim, self.split_rank * n, n))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.quant_method.apply(self, x, router_logits, out)
