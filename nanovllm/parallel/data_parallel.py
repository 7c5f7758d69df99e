"""Data parallelism: data_parallel_size engine replicas, each an ordinary LLMEngine in its own
process on its own tensor_parallel_size GPUs (CPU processes without CUDA).

This process validates every request, hands each to the replica with the least outstanding
work (prompt plus max_tokens; a generate call's requests go largest first), and collects the
RequestOutputs the replicas send back as their requests finish.
"""
import multiprocessing as mp
import os
import time
import traceback
import weakref
from dataclasses import replace
from multiprocessing.connection import wait

import torch

from nanovllm.config import Config
from nanovllm.engine.base import EngineBase
from nanovllm.engine.processor import Processor
from nanovllm.outputs import RequestOutput
from nanovllm.parallel.processes import die_with_parent, stop_processes

REPLY_TIMEOUT_S = 600  # the longest a busy replica may stay silent (one engine step, or its start-up)


def _replica_main(config: Config, conn, parent_pid: int):
    """One replica's loop. Messages in: ("add", [(request_id, prompt, params)]), ("abort", ids)
    (no reply), ("abort",), ("reset_prefix_cache",), None (exit). Out: ("ready", max_model_len)
    once; ("outputs", [RequestOutput]) after each step that reports some; ("aborted",) answers
    every ("abort",); ("reset", ok);
    ("error", traceback) when a step fails (its requests are dropped, the replica stays up)."""
    die_with_parent(parent_pid)
    from nanovllm.engine.llm_engine import LLMEngine
    try:
        engine = LLMEngine(config)
        conn.send(("ready", engine.config.max_model_len))
        while True:
            if not engine.has_unfinished_requests() or conn.poll():
                message = conn.recv()
                if message is None:
                    break
                if message[0] == "add":
                    for request in message[1]:
                        engine.add_request(*request)
                elif message[0] == "abort" and len(message) == 2:
                    engine.abort_request(message[1])
                elif message[0] == "abort":
                    engine.abort_all_requests()
                    conn.send(("aborted",))
                else:
                    conn.send(("reset", engine.reset_prefix_cache()))
                continue
            try:
                outputs = engine.step()
            except Exception:
                engine.abort_all_requests()
                conn.send(("error", traceback.format_exc()))
                continue
            if outputs:
                conn.send(("outputs", outputs))
    except EOFError:
        pass  # the parent is gone
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class DataParallelEngine(EngineBase):
    """The engine behind `LLM(model, data_parallel_size=M, **engine_args)`. Raises RuntimeError when
    a replica fails to start, and from step() when one fails or dies."""

    def __init__(self, config: Config):
        self.config = config
        self.processor = Processor(config)
        replica_config = replace(config, data_parallel_size=1)
        gpus = self._gpu_groups(config) if config.device.type == "cuda" else [None] * config.data_parallel_size
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for group in gpus:
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_replica_main, args=(replica_config, child, os.getpid()),
                               name=f"nanovllm-dp{len(self.procs)}", daemon=False)
            previous = os.environ.get("CUDA_VISIBLE_DEVICES")
            if group is not None:  # the replica's GPUs, in its environment from its start (before any CUDA call)
                os.environ["CUDA_VISIBLE_DEVICES"] = group
            try:
                proc.start()
            finally:
                if previous is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = previous
            child.close()
            self.procs.append(proc)
            self.conns.append(conn)
        weakref.finalize(self, stop_processes, self.procs, self.conns, 30)
        self._pending: list[tuple[str, dict, object, int]] = []  # validated requests not sent yet, with their load
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (replica, load) of every sent, unfinished one
        self._loads = [0] * len(self.conns)
        self._last_heard = [time.monotonic()] * len(self.conns)
        max_model_len = min(self._receive(i)[1] for i in range(len(self.conns)))  # ("ready", max_model_len)
        if max_model_len < config.max_model_len:  # lowered to what the replicas' KV caches hold
            self.config = replace(config, max_model_len=max_model_len)
            self.processor = Processor(self.config)

    @staticmethod
    def _gpu_groups(config: Config) -> list[str]:
        """CUDA_VISIBLE_DEVICES for each replica: consecutive groups of tensor_parallel_size GPUs."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        n = config.tensor_parallel_size
        return [",".join(ids[r * n:(r + 1) * n]) for r in range(config.data_parallel_size)]

    def add_request(self, request_id: str, prompt, params) -> None:
        if request_id in self._owner or any(r[0] == request_id for r in self._pending):
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        request = self.processor.make_request(request_id, prompt, params)
        prompt = {"prompt_token_ids": request.prompt_token_ids, "prompt": request.prompt}  # tokenized once
        max_tokens = params.max_tokens or self.config.max_model_len - len(request.prompt_token_ids)
        self._pending.append((request_id, prompt, params, len(request.prompt_token_ids) + params.n * max_tokens))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending or self._owner)

    def step(self) -> list[RequestOutput]:
        """Send the queued requests, then return the outputs the replicas have sent (waiting up to
        1 s for some). RuntimeError if a busy replica reports an error, dies or stays silent."""
        if self._pending:
            self._dispatch()
        busy = sorted({i for i, _ in self._owner.values()})
        outputs = []
        for conn in wait([self.conns[i] for i in busy], timeout=1.0):
            i = self.conns.index(conn)
            for out in self._receive(i)[1]:
                if out.request_id not in self._owner:
                    continue  # aborted after the replica sent it
                outputs.append(out)
                if out.finished:
                    self._loads[i] -= self._owner.pop(out.request_id)[1]
        now = time.monotonic()
        for i in busy:
            if self.procs[i].exitcode is not None:
                raise self._dead(i)
            if now - self._last_heard[i] > REPLY_TIMEOUT_S:
                raise RuntimeError(f"data-parallel replica {i} (pid {self.procs[i].pid}) sent nothing for "
                                   f"{REPLY_TIMEOUT_S} s")
        return outputs

    def _dispatch(self):
        """Each queued request, largest load first, to the replica with the least outstanding load."""
        batches = [[] for _ in self.conns]
        for request_id, prompt, params, load in sorted(self._pending, key=lambda r: -r[3]):
            i = self._loads.index(min(self._loads))
            batches[i].append((request_id, prompt, params))
            self._loads[i] += load
            self._owner[request_id] = (i, load)
        self._pending = []
        for i, batch in enumerate(batches):
            if batch:
                if self.procs[i].exitcode is not None:
                    raise self._dead(i)
                self._last_heard[i] = time.monotonic()
                self.conns[i].send(("add", batch))

    def _receive(self, i: int, timeout: float = REPLY_TIMEOUT_S):
        """The next message from replica i; RuntimeError if it reports an error, dies or stays silent."""
        conn, proc = self.conns[i], self.procs[i]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.1):
            if proc.exitcode is not None:
                raise self._dead(i)
            if time.monotonic() > deadline:
                raise RuntimeError(f"data-parallel replica {i} (pid {proc.pid}) sent nothing for {timeout} s")
        try:
            message = conn.recv()
        except EOFError:  # it died
            proc.join(5)
            raise self._dead(i) from None
        self._last_heard[i] = time.monotonic()
        if message[0] == "error":
            raise RuntimeError(f"data-parallel replica {i} failed:\n{message[1]}")
        return message

    def _dead(self, i: int) -> RuntimeError:
        proc = self.procs[i]
        return RuntimeError(f"data-parallel replica {i} (pid {proc.pid}) exited with code {proc.exitcode}; "
                            f"create a new LLM")

    def abort_request(self, request_id) -> None:
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        self._pending = [r for r in self._pending if r[0] not in ids]
        by_replica: dict[int, list[str]] = {}
        for rid in ids & self._owner.keys():
            i, load = self._owner.pop(rid)
            self._loads[i] -= load
            by_replica.setdefault(i, []).append(rid)
        for i, rids in by_replica.items():
            self.conns[i].send(("abort", rids))

    def abort_all_requests(self):
        """Have every busy replica drop its requests, reading its replies up to the acknowledgement,
        so that the next call starts clean (a dead replica is reported by the next call)."""
        for i in sorted({i for i, _ in self._owner.values()}):
            try:
                self.conns[i].send(("abort",))
                while self.conns[i].poll(60) and self.conns[i].recv()[0] != "aborted":
                    pass
            except (OSError, EOFError):
                pass
        self._pending, self._owner, self._loads = [], {}, [0] * len(self.conns)

    def reset_prefix_cache(self) -> bool:
        """Empty every replica's prefix cache; False if any replica still holds blocks."""
        results = []
        for i, conn in enumerate(self.conns):
            conn.send(("reset_prefix_cache",))
            results.append(self._receive(i)[1])
        return all(results)
