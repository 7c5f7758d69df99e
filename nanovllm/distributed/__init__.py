"""Tensor parallelism's ground floor: this process's rank and size (state.py, handed to every
layer when the model is built) and the process group with its collectives (process_group.py:
NCCL or gloo, and the sum of the ranks' partial products fused with the RMSNorm after them).
"""
