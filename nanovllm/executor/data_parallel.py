"""Data parallelism: data_parallel_size engine replicas, each an ordinary LLMEngine in its own
process on its own tensor_parallel_size GPUs (CPU processes without CUDA).

ReplicaRouter is what this process does whatever carries the messages: it validates every
request, hands each to the replica with the least outstanding work and collects the
RequestOutputs the replicas send back. DataParallelEngine carries them over pipes to processes of
this host (distributed_executor_backend="mp"); ray_replicas.py to Ray actors on a cluster.
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
from nanovllm.outputs import RequestOutput
from nanovllm.executor.processes import die_with_parent, died_while_starting, stop_processes
from nanovllm.executor.replica_router import ReplicaRouter

REPLY_TIMEOUT_S = 600  # the longest a busy replica may stay silent (one engine step, or its start-up)


def _replica_main(config: Config, conn, parent_pid: int):
    """One replica's loop. Messages in: ("add", [add_request's arguments]), ("abort", ids)
    (no reply), ("abort",), ("reset_prefix_cache",), ("metrics",), ("lora", method, args) (its
    engine's add_lora, remove_lora, list_loras or pin_lora), None (exit). Out: ("ready",
    max_model_len) once; ("outputs", [RequestOutput]) after each step that reports some;
    ("aborted",) answers every ("abort",); ("reset", ok); ("metrics", its engine's get_metrics());
    ("lora", what the method returns); ("error", traceback) when a step fails (its requests are
    dropped, the replica stays up) or a LoRA call raises ValueError (the replica stays up)."""
    die_with_parent(parent_pid)
    from nanovllm.executor.llm_engine import LLMEngine
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
                elif message[0] == "metrics":
                    conn.send(("metrics", engine.get_metrics()))
                elif message[0] == "lora":
                    try:
                        conn.send(("lora", getattr(engine, message[1])(*message[2])))
                    except ValueError:  # the router checked the call: a race, e.g. the adapter's files since removed
                        conn.send(("error", traceback.format_exc()))
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


class DataParallelEngine(ReplicaRouter):
    """The engine behind `LLM(model, data_parallel_size=M, **engine_args)` (distributed_executor_backend
    "mp"): replicas in processes of this host, messages over pipes. Raises RuntimeError when a
    replica fails to start, and from step() when one fails or dies."""

    def __init__(self, config: Config):
        super().__init__(config, config.data_parallel_size)
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
        self._last_heard = [time.monotonic()] * len(self.conns)
        self._early: list[tuple[int, list[RequestOutput]]] = []  # outputs sent before an answer (_ask_all)
        self._started = False
        self._set_max_model_len(min(self._receive(i)[1] for i in range(len(self.conns))))  # ("ready", max_model_len)
        self._started = True

    @staticmethod
    def _gpu_groups(config: Config) -> list[str]:
        """CUDA_VISIBLE_DEVICES for each replica: consecutive groups of tensor_parallel_size GPUs."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        n = config.tensor_parallel_size
        return [",".join(ids[r * n:(r + 1) * n]) for r in range(config.data_parallel_size)]

    def _send(self, i: int, batch: list):
        if self.procs[i].exitcode is not None:
            raise self._dead(i)
        self._last_heard[i] = time.monotonic()
        self.conns[i].send(("add", batch))

    def _receive_outputs(self, busy: list[int]) -> list[tuple[int, list[RequestOutput]]]:
        received, self._early = self._early, []
        received += [(self.conns.index(conn), self._receive(self.conns.index(conn))[1])
                     for conn in wait([self.conns[i] for i in busy], timeout=0 if received else 1.0)]
        now = time.monotonic()
        for i in busy:
            if self.procs[i].exitcode is not None:
                raise self._dead(i)
            if now - self._last_heard[i] > REPLY_TIMEOUT_S:
                raise RuntimeError(f"data-parallel replica {i} (pid {self.procs[i].pid}) sent nothing for "
                                   f"{REPLY_TIMEOUT_S} s")
        return received

    def _send_abort(self, i: int, request_ids: list[str]):
        self.conns[i].send(("abort", request_ids))

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
        if not self._started:
            return died_while_starting(f"data-parallel replica {i} (pid {proc.pid})", proc.exitcode)
        return RuntimeError(f"data-parallel replica {i} (pid {proc.pid}) exited with code {proc.exitcode}; "
                            f"create a new LLM")

    def abort_all_requests(self):
        """Have every busy replica drop its requests, reading its replies up to the acknowledgement,
        so that the next call starts clean (a dead replica is reported by the next call)."""
        self._early = []
        for i in self._forget_all():
            try:
                self.conns[i].send(("abort",))
                while self.conns[i].poll(60) and self.conns[i].recv()[0] != "aborted":
                    pass
            except (OSError, EOFError):
                pass

    def _ask_all(self, message: tuple) -> list:
        """Each replica's answer to message; the outputs a busy replica sends before it are kept
        for the next step()."""
        answers = []
        for i, conn in enumerate(self.conns):
            conn.send(message)
            while (reply := self._receive(i))[0] == "outputs":
                self._early.append((i, reply[1]))
            answers.append(reply[1])
        return answers

    def _replica_lora(self, method: str, *args) -> list:
        return self._ask_all(("lora", method, args))

    def _replica_metrics(self) -> list[list]:
        return self._ask_all(("metrics",))

    def reset_prefix_cache(self) -> bool:
        """Empty every replica's prefix cache; False if any replica still holds blocks."""
        return all(self._ask_all(("reset_prefix_cache",)))
