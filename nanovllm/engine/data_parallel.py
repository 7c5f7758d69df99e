"""Data parallelism: data_parallel_size engine replicas, each in its own process on its own
tensor_parallel_size GPUs (CPU processes without CUDA), sharing the prompts of each generate call.

This process validates and tokenizes every request, splits them among the replicas by load
(prompt plus max_tokens, largest first, each to the least-loaded replica), shows one progress
bar and returns the outputs in input order.
"""
import multiprocessing as mp
import os
import time
import traceback
import weakref
from multiprocessing.connection import wait

import torch
from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.requests import RequestOutput, RequestProcessor
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.distributed import check_tensor_parallel, die_with_parent, stop_processes
from nanovllm.utils.source import resolve_model

REPLY_TIMEOUT_S = 600  # the longest a replica may stay silent (one engine step, or its start-up)


def _replica_main(model: str, engine_args: dict, conn, parent_pid: int):
    """One replica's loop. Messages in: ("generate", [(token ids, SamplingParams)]), ("abort",),
    ("reset_prefix_cache",), None (exit). Out: ("ready",) once; per call ("finished", n) after
    each step that finishes n requests, then ("done", [(completion ids, finish reason, cached
    tokens)]) or ("error", traceback); ("aborted",) answers every abort; ("reset", ok)."""
    die_with_parent(parent_pid)
    from nanovllm.engine.llm_engine import LLMEngine
    try:
        engine = LLMEngine(model, **engine_args)
        conn.send(("ready",))
        while (message := conn.recv()) is not None:
            if message[0] == "reset_prefix_cache":
                conn.send(("reset", engine.reset_prefix_cache()))
            elif message[0] == "abort":
                conn.send(("aborted",))
            elif not _replica_generate(engine, conn, [Sequence(ids, sp) for ids, sp in message[1]]):
                break
    except EOFError:
        pass  # the parent is gone
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _replica_generate(engine, conn, seqs: list[Sequence]) -> bool:
    """Run one call's requests; False if the parent asked the replica to exit meanwhile."""
    for seq in seqs:
        engine.scheduler.add(seq)
    try:
        while engine.has_unfinished_requests():
            if conn.poll():  # mid-call the parent only sends ("abort",) or None (shut down)
                message = conn.recv()
                engine.abort_all_requests()
                if message is not None:
                    conn.send(("aborted",))
                return message is not None
            finished = engine.step()[0]
            if finished:
                conn.send(("finished", len(finished)))
    except Exception:
        engine.abort_all_requests()
        conn.send(("error", traceback.format_exc()))
        return True
    conn.send(("done", [(s.completion_token_ids, s.finish_reason, s.num_cached_tokens) for s in seqs]))
    return True


class DataParallelEngine:
    """What `LLM(model, data_parallel_size=M, **engine_args)` returns: the same generate() over M
    replicas. Raises ValueError for bad arguments, RuntimeError when a replica fails to start."""

    def __init__(self, model: str, **engine_args):
        self.config = config = Config(model, **engine_args)
        source = resolve_model(model, config.load_format)
        check_tensor_parallel(source.hf_config, config.tensor_parallel_size)
        self.processor = RequestProcessor(config, source)
        self.tokenizer = self.processor.tokenizer
        replica_args = dict(engine_args, data_parallel_size=1)
        gpus = self._gpu_groups(config) if config.torch_device.type == "cuda" else [None] * config.data_parallel_size
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for group in gpus:
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_replica_main, args=(model, replica_args, child, os.getpid()),
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
        for i in range(len(self.conns)):
            self._receive(i)  # ("ready",)

    @staticmethod
    def _gpu_groups(config: Config) -> list[str]:
        """CUDA_VISIBLE_DEVICES for each replica: consecutive groups of tensor_parallel_size GPUs."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        n = config.tensor_parallel_size
        return [",".join(ids[r * n:(r + 1) * n]) for r in range(config.data_parallel_size)]

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
        if message[0] == "error":
            raise RuntimeError(f"data-parallel replica {i} failed:\n{message[1]}")
        return message

    def _dead(self, i: int) -> RuntimeError:
        proc = self.procs[i]
        return RuntimeError(f"data-parallel replica {i} (pid {proc.pid}) exited with code {proc.exitcode}; "
                            f"create a new LLM")

    def _split(self, seqs: list[Sequence]) -> list[list[int]]:
        """Request indices per replica: largest load (prompt + max_tokens) first, to the least loaded."""
        loads = [0] * len(self.conns)
        parts = [[] for _ in self.conns]
        for i in sorted(range(len(seqs)), key=lambda i: -(len(seqs[i]) + seqs[i].sampling_params.max_tokens)):
            r = loads.index(min(loads))
            parts[r].append(i)
            loads[r] += len(seqs[i]) + seqs[i].sampling_params.max_tokens
        return [sorted(p) for p in parts]

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """As LLMEngine.generate: one RequestOutput per prompt, in input order; a ValueError for an
        invalid request refuses the whole call before any replica starts work. RuntimeError if a
        replica fails; after an interrupt the replicas drop the call's requests and stay usable."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        seqs = self.processor.to_sequences(prompts, sampling_params)
        for i, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                self._receive(i)  # raises the error it left, if any
                raise self._dead(i)
        parts = self._split(seqs)
        for conn, part in zip(self.conns, parts):
            conn.send(("generate", [(seqs[i].token_ids, seqs[i].sampling_params) for i in part]))
        busy = set(range(len(parts)))
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            while busy:
                for conn in wait([self.conns[i] for i in busy], timeout=1.0):
                    i = self.conns.index(conn)
                    message = self._receive(i)
                    if message[0] == "finished":
                        bar.update(message[1])
                        continue
                    busy.discard(i)
                    for index, (ids, reason, cached) in zip(parts[i], message[1]):
                        seq = seqs[index]
                        seq.token_ids.extend(ids)
                        seq.finish_reason, seq.num_cached_tokens = reason, cached
        except BaseException:
            self._abort(busy)
            raise
        finally:
            bar.close()
        return [self.processor.output(i, p, seq) for i, (p, seq) in enumerate(zip(prompts, seqs))]

    def _abort(self, busy: set[int]):
        """Have the replicas still on the interrupted call drop its requests, and read their
        replies up to the acknowledgement, so that the next call starts clean."""
        for i in busy:
            try:
                self.conns[i].send(("abort",))
                while self.conns[i].poll(60) and self.conns[i].recv()[0] != "aborted":
                    pass
            except (OSError, EOFError):
                pass  # a dead replica: the next call reports it

    def reset_prefix_cache(self) -> bool:
        """Empty every replica's prefix cache; False if any replica still holds blocks."""
        results = []
        for i, conn in enumerate(self.conns):
            conn.send(("reset_prefix_cache",))
            results.append(self._receive(i)[1])
        return all(results)
