"""How a FusedMoE layer's experts are computed: the experts' seam, as linear_method.py is the linear
layers'. A MoEMethod is chosen when the model is built (moe_method, from the linear layers' method,
so that quantization="fp8" quantizes the experts too) and owns what the stacked expert weights are
once loaded (process_weights_after_loading) and the product from the router's logits (apply). On
CUDA the Triton kernels of kernels/fused_moe.py run it; elsewhere select_experts and torch_experts,
a loop over the experts hit as transformers' modules compute it (the CPU path, and the reference the
engine's CPU tests compare with transformers).
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.fp8 import quantize_fp8
from nanovllm.layers.linear_method import LinearMethod


def uses_kernels(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take this step's experts: on CUDA (the CPU tests force them in
    Triton's interpreter by replacing this function)."""
    return x.is_cuda


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts as transformers' routers choose them (Qwen3-MoE, Mixtral), in torch (the
    CPU path; on CUDA kernels/moe_routing.topk_ids and topk_weights): softmax of the router's
    logits [T, E] (computed in the model dtype) in float32, the top_k largest probabilities,
    divided by their sum with `renormalize` (norm_topk_prob; Mixtral always). Returns
    (topk_weights [T, top_k] float32, topk_ids [T, top_k] int32), largest first; the weights stay
    float32 where transformers' Qwen3-MoE rounds them to the model dtype."""
    weights, ids = torch.softmax(router_logits, -1, dtype=torch.float32).topk(top_k, -1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


class MoEMethod:
    """Experts in the model dtype: w13_weight [E, 2N, H] ([gate | up] per expert), w2_weight [E, H, N]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded model-dtype weights into what apply reads (nothing to do by default)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """The routing-weighted sum of each token's top-k experts' SwiGLU outputs: x [T, H] -> [T, H]
        in x's dtype (written to out when given); router_logits [T, num_experts], the experts chosen
        as select_experts chooses them (layer.top_k, layer.renormalize); layer.expert_map, if any,
        takes the ids of all num_experts to this rank's."""
        scales = (layer.w13_weight_scale, layer.w2_weight_scale)
        if uses_kernels(x):
            from nanovllm.kernels.fused_moe import fused_moe  # Triton: imported only where it runs
            return fused_moe(x, router_logits, layer.w13_weight, layer.w2_weight, layer.top_k, layer.renormalize,
                             *scales, out, layer.expert_map)
        return torch_experts(x.contiguous(), layer.w13_weight, layer.w2_weight,
                             *select_experts(router_logits, layer.top_k, layer.renormalize), *scales, out,
                             layer.expert_map)


class Fp8MoEMethod(MoEMethod):
    """quantization="fp8": each expert's weights kept as float8 e4m3 with one float32 scale per
    output row (w13_weight_scale [E, 2N], w2_weight_scale [E, H]); the activations stay in the
    model dtype (the kernels widen the weights in registers), so a decode step moves one byte per
    expert weight it reads."""

    @torch.no_grad()
    def process_weights_after_loading(self, layer):
        for name in ("w13_weight", "w2_weight"):
            weight, scale = quantize_fp8(getattr(layer, name))
            setattr(layer, name, nn.Parameter(weight, requires_grad=False))
            setattr(layer, f"{name}_scale", scale)


def moe_method(linear_method: LinearMethod | None) -> MoEMethod:
    """The experts' method for a model whose linear layers use `linear_method` (its `quantization`
    name; None: unquantized). ValueError for a quantization the experts do not implement."""
    name = getattr(linear_method, "quantization", None)
    if name not in MOE_METHODS:
        raise ValueError(f"the experts of mixture-of-experts layers do not support quantization={name!r}; "
                         f"supported: {list(MOE_METHODS)}")
    return MOE_METHODS[name]()


MOE_METHODS = {None: MoEMethod, "fp8": Fp8MoEMethod}


def torch_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """fused_experts' result (same arguments) with torch ops: for each expert hit, its tokens'
    gate/up product, silu(gate) * up and down product in x's dtype (float8 weights dequantized to
    it first), weighted and summed per token in float32. Reads the routing on the host: not for
    CUDA graphs."""
    if expert_map is not None:
        topk_ids = expert_map[topk_ids.long()]
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        if expert < 0:
            continue  # another rank's
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        w_gate_up, w_down = w13[expert], w2[expert]
        if w13_scale is not None:
            w_gate_up = (w_gate_up.float() * w13_scale[expert, :, None]).to(x.dtype)
            w_down = (w_down.float() * w2_scale[expert, :, None]).to(x.dtype)
        gate, up = F.linear(x[tokens], w_gate_up).chunk(2, -1)
        y = F.linear(F.silu(gate) * up, w_down)
        acc.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None])
    return acc.to(x.dtype) if out is None else out.copy_(acc)
