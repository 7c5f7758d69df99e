import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU's gate (Shazeer 2020): x = [gate | up] along the last dim -> silu(gate) * up.

    x: [num_tokens, 2 * intermediate_size] -> [num_tokens, intermediate_size].
    """

    @torch.compile(dynamic=True, disable=not torch.cuda.is_available())
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
