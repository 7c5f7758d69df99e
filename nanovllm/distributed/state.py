"""This process's place in tensor parallelism, handed to every layer when the model is built."""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorParallel:
    """rank in [0, size): which shard of each split weight this process holds; size: the ranks;
    group: the process group's TPGroup (process_group.py) through which layers sum their partial
    products, None with one rank (and for a model built only to count its parameters).
    expert_parallel: experts placed whole on the ranks, num_experts / size each, rather than
    each expert's intermediate dimension split (enable_expert_parallel; layers/fused_moe.py)."""
    rank: int = 0
    size: int = 1
    group: object = field(default=None, compare=False, repr=False)
    expert_parallel: bool = False
