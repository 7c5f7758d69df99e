"""Running one model on several processes: tensor parallelism (tp_workers.py: rank 0 drives the
other ranks' ModelRunners; state.py: the rank and size that layers are built with;
process_group.py: torch.distributed set-up and tear-down, and the sums of the ranks' partial
products, fused with the RMSNorm after them in all_reduce_norm_kernel.py on two GPUs) and data parallelism
(replica_router.py: whole engine replicas behind the same interface as LLMEngine, as local
processes in data_parallel.py or Ray actors on a cluster in ray_replicas.py). processes.py
makes child processes die with their parent and stops them cleanly.
"""
