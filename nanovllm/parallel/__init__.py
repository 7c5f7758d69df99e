"""Running one model on several processes: tensor parallelism (tp_workers.py: rank 0 drives the
other ranks' ModelRunners; state.py: the rank and size that layers are built with;
process_group.py: torch.distributed set-up and tear-down) and data parallelism
(data_parallel.py: whole engine replicas behind the same interface as LLMEngine). processes.py
makes child processes die with their parent and stops them cleanly.
"""
