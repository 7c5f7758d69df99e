import torch
import torch.nn.functional as F

from nanovllm.kernels.compile import token_compile


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer 2020): x = [gate | up] along the last dim -> silu(gate) * up.

    x: [num_tokens, 2 * intermediate_size] -> [num_tokens, intermediate_size]. Eager; silu_and_mul
    is it compiled.
    """
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


silu_and_mul = token_compile(swiglu)
