"""Tensor-parallel worker processes, and rank 0's handle on them.

Rank r >= 1 runs in its own process with its own ModelRunner (its shard of the weights and
of the KV heads, on GPU r or on the CPU) and runs the ModelRunner calls that rank 0 pipes to it,
in order: each step's StepPlan, a few small arrays (positions, slot mapping, block tables), with
what its sampler needs of rank 0's SamplingTensors (SamplingTensors.for_workers), its token ids
reaching it by a broadcast on the device; and the engine's LoRA adapter calls (lora_call). The
processes exit when the engine is deleted, when the parent
process dies (the kernel kills them), or when their pipe closes.
"""
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref
from contextlib import contextmanager
from dataclasses import replace

import torch.distributed as dist
from tqdm import tqdm

from nanovllm.config import Config
from nanovllm.distributed.process_group import TPGroup, symmetric_memory_unused
from nanovllm.executor.processes import die_with_parent, died_while_starting, stop_processes


def process_local_progress_lock():
    """Give tqdm a lock of this process alone (a threading lock). Its default is a multiprocessing
    semaphore (made at the first progress bar, e.g. a GGUF conversion's), which a worker's os._exit
    would leak, and Python would then warn of it when the user's script exits."""
    tqdm.set_lock(threading.RLock())


def _worker_main(config: Config, rank: int, store_path: str, symmetric: bool, conn, parent_pid: int):
    die_with_parent(parent_pid)
    conn.send("started")  # past the spawn bootstrap, which re-imports the parent's main module
    process_local_progress_lock()
    from nanovllm.engine.model_runner import ModelRunner
    try:
        runner = ModelRunner(config, rank=rank, store_path=store_path, symmetric=symmetric)
        while (message := conn.recv()) is not None:
            method, args = message
            if method == "execute":  # a step: the ranks' collectives keep them together, nothing to answer
                runner.execute(*args)
                continue
            try:  # a call rank 0 waits for (TPWorkers.call): None once it ran, or why it failed
                getattr(runner, method)(*args)
                conn.send(None)
            except Exception:
                conn.send(traceback.format_exc())
        # rank 0 asked the ranks to stop, and leaves the group with them
        runner.tp_group.leave(runner.graph_runner.graphs if runner.graph_runner else {})
    except EOFError:
        pass  # rank 0 is gone
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)  # skip interpreter teardown: a broken process group could hang it


class TPWorkers:
    """Starts ranks 1..tensor_parallel_size-1 and sends them each step's plan, and the engine's
    LoRA adapter calls (rank 0 side)."""

    def __init__(self, config: Config):
        self.tmpdir = tempfile.mkdtemp(prefix="nanovllm-tp-")
        self.store_path = os.path.join(self.tmpdir, "store")
        self.broken: str | None = None  # why the ranks can no longer run steps together
        self.graphs = {}  # rank 0's CUDA graphs (its ModelRunner's): freed before the process group
        self.group: list[TPGroup] = []  # rank 0's TPGroup, once its ModelRunner has joined the group
        self.symmetric = symmetric_memory_unused()  # all-reduces through symmetric memory, on every rank or none
        ctx = mp.get_context("spawn")
        config = replace(config, tokenizer=None)  # the workers detokenize nothing
        self.procs, self.conns = [], []
        for rank in range(1, config.tensor_parallel_size):
            worker_end, conn = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"nanovllm-tp{rank}", daemon=False,
                               args=(config, rank, self.store_path, self.symmetric, worker_end, os.getpid()))
            proc.start()
            worker_end.close()
            self.procs.append(proc)
            self.conns.append(conn)
        shutdown = weakref.finalize(self, _shutdown, self.procs, self.conns, self.tmpdir, self.graphs,
                                    self.group)
        try:
            self._wait_started()
        except RuntimeError:
            shutdown()
            raise

    def _wait_started(self):
        """Wait until every worker runs _worker_main, so that one that died on the way (in the
        spawn bootstrap, say) fails the start at once instead of leaving rank 0 in the process
        group's rendezvous until its 10-minute timeout. Raises RuntimeError naming the rank."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            try:
                while not conn.poll(0.05):
                    if proc.exitcode is not None and not conn.poll():
                        raise EOFError
                conn.recv()
            except EOFError:  # it exited, or closed the pipe on its way out, before saying it started
                proc.join(10)
                raise died_while_starting(f"tensor-parallel worker rank {rank}", proc.exitcode) from None

    def check(self):
        """Raise RuntimeError if a worker has died or the ranks are out of step."""
        for rank, proc in enumerate(self.procs, 1):
            if self.broken is None and proc.exitcode is not None:
                self.broken = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                               f"{proc.exitcode}; this engine cannot run more steps, create a new LLM")
        if self.broken:
            raise RuntimeError(self.broken)

    def send(self, plan, st):
        """One step for the workers: its StepPlan (without input_ids and pending) and what their
        samplers need of its SamplingTensors (for_workers(); None when no row is sampled)."""
        for conn in self.conns:
            conn.send(("execute", (plan, None, st)))

    def call(self, method: str, *args):
        """Have every worker run its ModelRunner's method(*args) (ModelRunner.lora_call) after the
        steps sent before (its pipe keeps the order), and wait until they all have. RuntimeError
        when a worker has died, or its call raised (it stays up)."""
        self.check()
        for conn in self.conns:
            conn.send((method, args))
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            while not conn.poll(0.01):
                self.check()
            try:
                error = conn.recv()
            except EOFError:  # it died on the way: check() says how
                proc.join(10)
                self.check()
                raise
            if error is not None:
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed in {method}:\n{error}")

    @contextmanager
    def step_guard(self):
        """Wrap rank 0's launch of one step (sending the plan and running its forward). Ctrl-C is
        held until the launch ends, so that every rank joins the same collectives; any error
        inside leaves the ranks out of step, and is reported as a dead worker when one is."""
        self.check()
        interrupted = []
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True)) if in_main else None
        try:
            yield
        except Exception as e:
            time.sleep(0.05)  # let a dying worker's exit code arrive
            try:
                self.check()
            except RuntimeError as dead:
                raise dead from e
            self.broken = f"a step failed on rank 0 after it was sent to the other ranks ({e}); create a new LLM"
            stop_processes(self.procs, [], timeout=0)  # they may wait in a collective rank 0 never joins
            raise
        finally:
            if in_main:
                signal.signal(signal.SIGINT, previous)
            if interrupted:
                raise KeyboardInterrupt

    def wait(self, event):
        """Wait for a CUDA event, checking that the workers are alive (a dead rank would hang it)."""
        while not event.query():
            self.check()
            time.sleep(1e-4)


def _shutdown(procs, conns, tmpdir, graphs, group):
    """Rank 0's end of the engine: the workers are told to stop and leave the process group, rank
    0 leaves it with them, then they get 10 s to exit. When a worker has died, an NCCL group is
    not destroyed (that could wait for the dead rank); process exit ends it."""
    healthy = all(proc.exitcode is None for proc in procs)
    for conn in conns:
        try:
            conn.send(None)
            conn.close()
        except OSError:
            healthy = False  # that worker is gone
    if dist.is_initialized() and (healthy or dist.get_backend() == "gloo"):
        (group[0] if group else TPGroup(0, 0, None)).leave(graphs)  # (a group joined, its TPGroup not yet made)
    stop_processes(procs, [], timeout=10)
    shutil.rmtree(tmpdir, ignore_errors=True)
