"""How a FusedMoE layer's experts are computed: the experts' seam, as linear_method.py is the linear
layers'. A MoEMethod is chosen when the model is built (moe_method, from the linear layers'
method, so that quantization="fp8" quantizes the experts too) and owns what the stacked expert
weights are once loaded (process_weights_after_loading) and the product (apply). On CUDA the
Triton kernels of kernels/fused_moe.py run it; elsewhere torch_experts, a loop over the experts
hit as transformers' modules compute it (the CPU path, and the reference the engine's CPU tests
compare with transformers).
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


class MoEMethod:
    """Experts in the model dtype: w13_weight [E, 2N, H] ([gate | up] per expert), w2_weight [E, H, N]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded model-dtype weights into what apply reads (nothing to do by default)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """The routing-weighted sum of each token's experts' SwiGLU outputs: x [T, H] -> [T, H] in x's
        dtype (written to out when given); topk_weights [T, k] float32, topk_ids [T, k] int32
        (ids of all num_experts: layer.expert_map, if any, takes them to this rank's)."""
        args = (x.contiguous(), layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.w13_weight_scale,
                layer.w2_weight_scale, out, layer.expert_map)
        if uses_kernels(x):
            from nanovllm.kernels.fused_moe import fused_experts  # Triton: imported only where it runs
            return fused_experts(*args)
        return torch_experts(*args)


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
