"""Data-parallel replicas as Ray actors (distributed_executor_backend="ray"), for prompt sets that
outgrow one host.

Each replica is an actor running an ordinary LLMEngine in one bundle of a placement group:
tensor_parallel_size GPUs (one CPU without CUDA), so a replica never straddles two nodes and
its tensor-parallel ranks stay local processes over NCCL (gloo on CPU), exactly as without Ray;
Ray gives the actor its GPUs through CUDA_VISIBLE_DEVICES. The bundles are spread over the nodes
where they fit (strategy SPREAD). The cluster is the one Ray is connected to, RAY_ADDRESS's, or a
local one that ray.init starts.

A replica that dies (its node lost, its actor killed) fails the call whole: step() raises a
RuntimeError naming the replica and its node as soon as Ray reports the death, and its requests
are not resubmitted (the other replicas' requests are aborted by LLM.generate, as for any error).
Deleting the engine kills its actors and removes the placement group, which frees their GPUs.
"""
import time
import weakref
from dataclasses import replace

from nanovllm.config import Config
from nanovllm.outputs import RequestOutput
from nanovllm.executor.replica_router import ReplicaRouter

REPLY_TIMEOUT_S = 600  # the longest a busy replica may go without finishing a step, or take to start


class Replica:
    """One replica, inside its actor."""

    def __init__(self, config: Config):
        from nanovllm.executor.llm_engine import LLMEngine
        self.engine = LLMEngine(config)

    def info(self) -> tuple[int, str]:
        """(max_model_len, the Ray node id this replica runs on)."""
        import ray
        return self.engine.config.max_model_len, ray.get_runtime_context().get_node_id()

    def add(self, requests: list):
        for request in requests:
            self.engine.add_request(*request)

    def run(self) -> list[RequestOutput]:
        """Steps until some request reports an output, or none is left."""
        while self.engine.has_unfinished_requests():
            if outputs := self.engine.step():
                return outputs
        return []

    def abort(self, request_ids: list[str]):
        self.engine.abort_request(request_ids)

    def abort_all(self):
        self.engine.abort_all_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def metrics(self) -> list:
        return self.engine.get_metrics()

    def lora(self, method: str, *args):
        """Its engine's add_lora, remove_lora, list_loras or pin_lora."""
        return getattr(self.engine, method)(*args)


def _stop(actors: list, placement_group):
    """Kill the actors and free their bundles (nothing to do once Ray is shut down: all went with it)."""
    import ray
    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor)
        except ray.exceptions.RayError:
            pass  # already gone
    ray.util.remove_placement_group(placement_group)


class RayDataParallelEngine(ReplicaRouter):
    """The engine behind `LLM(model, data_parallel_size=M, distributed_executor_backend="ray")`.
    RuntimeError when the cluster cannot place the replicas or one fails to start."""

    def __init__(self, config: Config):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        super().__init__(config, config.data_parallel_size)
        if not ray.is_initialized():
            ray.init()
        gpus = config.tensor_parallel_size if config.device.type == "cuda" else 0
        bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
        self._placement_group = placement_group([bundle] * config.data_parallel_size, strategy="SPREAD")
        replica = ray.remote(Replica)
        self._actors = [replica.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            self._placement_group, placement_group_bundle_index=i)).remote(replace(config, data_parallel_size=1))
            for i in range(config.data_parallel_size)]
        weakref.finalize(self, _stop, self._actors, self._placement_group)
        try:
            ray.get(self._placement_group.ready(), timeout=REPLY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the Ray cluster did not place {config.data_parallel_size} replicas of {bundle} within "
                               f"{REPLY_TIMEOUT_S} s; available: {ray.available_resources()}") from None
        try:
            info = ray.get([actor.info.remote() for actor in self._actors], timeout=REPLY_TIMEOUT_S)
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"a data-parallel replica failed to start: {e}") from None
        self.nodes = [node for _, node in info]
        self._set_max_model_len(min(n for n, _ in info))
        self._runs: dict[int, tuple[object, float]] = {}  # replica -> (its run() in flight, when it was sent)

    def _send(self, i: int, batch: list):
        self._actors[i].add.remote(batch)

    def _receive_outputs(self, busy: list[int]) -> list[tuple[int, list[RequestOutput]]]:
        import ray
        for i in busy:
            if i not in self._runs:
                self._runs[i] = self._actors[i].run.remote(), time.monotonic()
        refs = {ref: i for i, (ref, _) in self._runs.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=1.0)
        received = []
        for ref in ready:
            i = refs[ref]
            del self._runs[i]
            try:
                received.append((i, ray.get(ref)))
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(f"data-parallel replica {i} (Ray node {self.nodes[i]}) died: {e}; its requests "
                                   f"are lost, create a new LLM") from None
            except ray.exceptions.RayTaskError as e:
                raise RuntimeError(f"data-parallel replica {i} (Ray node {self.nodes[i]}) failed:\n{e}") from None
        for i, (_, sent) in self._runs.items():
            if time.monotonic() - sent > REPLY_TIMEOUT_S:
                raise RuntimeError(f"data-parallel replica {i} (Ray node {self.nodes[i]}) finished no step in "
                                   f"{REPLY_TIMEOUT_S} s")
        return received

    def _send_abort(self, i: int, request_ids: list[str]):
        self._actors[i].abort.remote(request_ids)

    def abort_all_requests(self):
        """Have every busy replica drop its requests (after its step in flight), so that the next
        call starts clean; a dead replica is reported by the next call."""
        import ray
        busy = self._forget_all()
        try:
            ray.get([self._actors[i].abort_all.remote() for i in busy], timeout=60)
        except ray.exceptions.RayError:
            pass
        self._runs.clear()

    def reset_prefix_cache(self) -> bool:
        import ray
        return all(ray.get([actor.reset_prefix_cache.remote() for actor in self._actors], timeout=REPLY_TIMEOUT_S))

    def _replica_metrics(self) -> list[list]:
        import ray
        return ray.get([actor.metrics.remote() for actor in self._actors], timeout=REPLY_TIMEOUT_S)

    def _replica_lora(self, method: str, *args) -> list:
        import ray
        return ray.get([actor.lora.remote(method, *args) for actor in self._actors], timeout=REPLY_TIMEOUT_S)
