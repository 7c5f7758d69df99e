"""Running engines over processes and machines: LLMEngine (llm_engine.py: one replica with its
tensor-parallel worker processes, tp_workers.py), and data parallelism (replica_router.py: whole
replicas behind the engine interface, as local processes in data_parallel.py or Ray actors in
ray_replicas.py). processes.py makes child processes die with their parent and stops them cleanly.
"""
