"""This process's place in tensor parallelism, handed to every layer when the model is built."""
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallel:
    """rank in [0, size): which shard of each split weight this process holds; size: the ranks."""
    rank: int = 0
    size: int = 1
