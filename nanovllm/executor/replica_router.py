"""ReplicaRouter: what a data-parallel engine does in this process, whatever carries the messages
to its replicas (pipes to local processes in data_parallel.py, Ray actors in ray_replicas.py)."""
from dataclasses import replace
from itertools import count

from nanovllm.config import Config
from nanovllm.engine.base import EngineBase
from nanovllm.engine.processor import Processor
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


def request_load(prompt_len: int, max_tokens: int, n: int = 1) -> int:
    """A request's work for its replica, in tokens of KV cache read: its prompt prefilled, then each
    of n completions reads its context at every decode step, prompt_len + t at step t, so
    max_tokens x (prompt_len + max_tokens / 2) in all. Decode steps of many sequences are bound by
    these reads; prompt plus max_tokens, the earlier measure, left bench.py's default workload's
    two replicas with roofline floors of 2.82 and 2.94 s, this one 2.876 and 2.881: `--dp 2` 4.02
    -> 3.96 s on 2 x H100 (docs/perf-log.md, 2026-11-25)."""
    return prompt_len + n * max_tokens * (2 * prompt_len + max_tokens) // 2  # an int: loads add and subtract exactly


class ReplicaRouter(EngineBase):
    """What every data-parallel engine does in this process: validate each request once, hand it to
    the replica with the least outstanding work (see request_load; a batch's requests go largest
    first), and collect the RequestOutputs the replicas send back. Subclasses move the
    messages: _send, _receive_outputs, _send_abort, abort_all_requests, reset_prefix_cache,
    _replica_metrics (each replica's get_metrics()), _replica_lora (each replica's answer to one
    of its engine's LoRA adapter calls)."""

    def __init__(self, config: Config, num_replicas: int):
        self.config = config
        self.processor = Processor(config)
        self._pending: list[tuple] = []  # validated (id, prompt, params, arrival_time, lora_request, load) not sent yet
        # request id -> (replica, load, id sent) of every sent, unfinished one; id sent -> request id. A
        # replica knows each request by an id of its own, so that outputs it sent before an abort are
        # not taken for those of a later request given the same id
        self._owner: dict[str, tuple[int, int, str]] = {}
        self._sent: dict[str, str] = {}
        self._sent_ids = count()
        self._loads = [0] * num_replicas

    def _set_max_model_len(self, max_model_len: int):
        """The replicas' max_model_len, when lowered to what their KV caches hold."""
        if max_model_len < self.config.max_model_len:
            self.config = replace(self.config, max_model_len=max_model_len)
            self.processor = Processor(self.config)

    def add_request(self, request_id: str, prompt, params=None, arrival_time=None, lora_request=None,
                    priority=0) -> None:
        if request_id in self._owner or any(r[0] == request_id for r in self._pending):
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        params = params or SamplingParams()
        request = self.processor.make_request(request_id, prompt, params, lora_request, priority, arrival_time)
        prompt = {"prompt_token_ids": request.prompt_token_ids, "prompt": request.prompt}  # tokenized once
        max_tokens = params.max_tokens or self.config.max_model_len - len(request.prompt_token_ids)
        load = request_load(len(request.prompt_token_ids), max_tokens, params.n)
        self._pending.append((request_id, prompt, params, arrival_time, lora_request, load))

    def get_metrics(self) -> list:
        """Every replica's metric records, each labelled {"engine": its replica's index} (vLLM's label
        of a data-parallel engine's metrics): sum a name's records for the whole."""
        return [replace(m, labels=m.labels | {"engine": str(i)})
                for i, records in enumerate(self._replica_metrics()) for m in records]

    def add_lora(self, lora_request) -> bool:
        self._check_lora_enabled("add_lora")
        self.processor.check_lora(lora_request)  # a bad adapter's error here, before any replica reads it
        return all(self._replica_lora("add_lora", lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        self._check_lora_enabled("remove_lora")
        return any(self._replica_lora("remove_lora", lora_id))

    def list_loras(self) -> set[int]:
        self._check_lora_enabled("list_loras")
        return set().union(*self._replica_lora("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        self._check_lora_enabled("pin_lora")
        lacking = [i for i, ids in enumerate(self._replica_lora("list_loras")) if lora_id not in ids]
        if lacking:  # checked on all before any pins it
            raise ValueError(f"LoRA adapter lora_int_id {lora_id} is not loaded on data-parallel replica(s) "
                             f"{lacking}; add_lora it first (it loads the adapter on every replica)")
        return all(self._replica_lora("pin_lora", lora_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending or self._owner)

    def step(self) -> list[RequestOutput]:
        """Send the queued requests, then return the outputs the replicas have sent (waiting up to
        1 s for some). RuntimeError if a busy replica reports an error, dies or stays silent."""
        if self._pending:
            self._dispatch()
        outputs = []
        for i, replica_outputs in self._receive_outputs(self._busy()):
            for out in replica_outputs:
                out.request_id = self._sent.get(out.request_id)
                if out.request_id is None:
                    continue  # aborted after the replica sent it
                outputs.append(out)
                if out.finished:
                    self._forget(out.request_id)
        return outputs

    def _busy(self) -> list[int]:
        return sorted({i for i, _, _ in self._owner.values()})

    def _forget(self, request_id: str) -> tuple[int, str]:
        """Drop a sent request here; returns (its replica, the id it was sent with)."""
        i, load, sent = self._owner.pop(request_id)
        del self._sent[sent]
        self._loads[i] -= load
        return i, sent

    def _dispatch(self):
        """Each queued request, largest load first, to the replica with the least outstanding load."""
        batches = [[] for _ in self._loads]
        for request_id, *request, load in sorted(self._pending, key=lambda r: -r[-1]):
            i, sent = self._loads.index(min(self._loads)), str(next(self._sent_ids))
            batches[i].append((sent, *request))  # add_request's arguments, in its order
            self._loads[i] += load
            self._owner[request_id], self._sent[sent] = (i, load, sent), request_id
        self._pending = []
        for i, batch in enumerate(batches):
            if batch:
                self._send(i, batch)

    def abort_request(self, request_id) -> None:
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        self._pending = [r for r in self._pending if r[0] not in ids]
        by_replica: dict[int, list[str]] = {}
        for rid in ids & self._owner.keys():
            i, sent = self._forget(rid)
            by_replica.setdefault(i, []).append(sent)
        for i, rids in by_replica.items():
            self._send_abort(i, rids)

    def _forget_all(self) -> list[int]:
        """Drop every request here; returns the replicas that were busy."""
        busy = self._busy()
        self._pending, self._owner, self._sent, self._loads = [], {}, {}, [0] * len(self._loads)
        return busy
