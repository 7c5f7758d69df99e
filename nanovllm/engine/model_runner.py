"""Builds the model on this rank's device and runs one packed forward per step: K/V go into the
paged cache, logits are computed for the sampled rows only and sampled on rank 0. Uniform steps
(decode; verify runs of one length) replay CUDA graphs. Under tensor parallelism every rank has a ModelRunner; rank 0 plans each step
and sends the plan to the others (nanovllm/executor/tp_workers.py), and each rank computes the
logits of its shard of the vocabulary, which the StepSampler (nanovllm/sampling) of every rank
samples together."""
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.kv_cache import KVCacheSpec, num_kv_blocks
from nanovllm.engine.lora_manager import LoRAManager
from nanovllm.sequence import Sequence
from nanovllm.engine.step_inputs import Stager, StepPlan, draft_offsets, plan_step
from nanovllm.engine.trace import region
from nanovllm.layers.attention import Attention, make_backend
from nanovllm.layers.linear import process_weights_after_loading
from nanovllm.layers.linear_method import linear_method
from nanovllm.sampling.sampler import SamplingTensors, TokenLogprobs, token_logprobs
from nanovllm.sampling.step_sampler import StepSampler
from nanovllm.loader.source import iter_weights
from nanovllm.loader.weights import check_weights_fit, dummy_weights, load_weights
from nanovllm.models.registry import model_class
from nanovllm.distributed.process_group import init_process_group
from nanovllm.distributed.state import TensorParallel
from nanovllm.sampling_params import SamplingParams

PROMPT_LOGITS_ROWS = 1024  # logits rows made at once for prompt logprobs: 0.6 GB in float32 for a 151,936 vocabulary


def greedy_chain(model, input_ids: torch.Tensor, meta, block_size: int, tokens: torch.Tensor) -> torch.Tensor:
    """tokens.size(0) greedy decode steps from input_ids [B] (meta: the first step's, advanced in
    place), each step's argmax the next step's input: tokens [steps, B] int64, written."""
    valid = meta.slot_mapping >= 0
    for t in range(tokens.size(0)):
        tokens[t] = model.lm_head(model(input_ids, meta)).argmax(-1)
        if t + 1 < tokens.size(0):
            input_ids.copy_(tokens[t])
            meta.advance(valid, block_size)
    return tokens


@dataclass
class LaunchedStep:
    """A step launched on the device, whose sampled tokens (one a row) the engine reads later (read_tokens)."""
    seqs: list[Sequence]  # each sampled row's sequence, in row order (a verify run's once per row)
    host: torch.Tensor | None  # [len(seqs)] int64: the sampled tokens, being copied to the host
    event: object  # CUDA event recorded after that copy, or None on CPU
    logprobs: TokenLogprobs | None = None  # of the rows whose request asked for logprobs, being copied too
    prompt_logprobs: tuple[list, TokenLogprobs] | None = None  # plan_step's prompt spans and their logprobs
    runs: list[tuple] = ()  # plan_step's verify runs: (sequence, its first row, its drafts)


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, store_path: str | None = None, workers=None,
                 symmetric: bool = False, aux_layers: tuple[int, ...] = (), draft_head: bool = False,
                 chain_steps: int = 0):
        """rank, store_path: this process's tensor-parallel rank and the FileStore where the ranks
        meet (tensor_parallel_size > 1); workers: rank 0's TPWorkers (whose store_path and symmetric
        it uses); symmetric: sum decode-sized partial sums through symmetric memory (process_group).
        aux_layers: the layers whose input hidden states an EAGLE-3 draft reads, kept per KV slot
        (kv_cache.hidden; one rank only). draft_head: the model is an EAGLE-3 head (models/registry.py).
        chain_steps: a draft model's greedy chains of that many steps get CUDA graphs (run_chain)."""
        self.config, self.hf_config = config, config.hf_config
        self.rank, self.world_size, self.workers = rank, config.tensor_parallel_size, workers
        self.device, self.dtype = config.device, config.dtype
        self.tp_group = None  # this rank's TPGroup, with tensor parallelism
        if self.world_size > 1:
            if self.device.type == "cuda":
                torch.cuda.set_device(rank)
                self.device = torch.device("cuda", rank)
            symmetric = workers.symmetric if workers else symmetric
            self.tp_group = init_process_group(rank, self.world_size, store_path or workers.store_path, self.device,
                               (config.max_num_seqs, config.max_num_batched_tokens, self.hf_config.hidden_size)
                               if symmetric else None, self.dtype)
            if workers:
                workers.group.append(self.tp_group)
        self.block_size = config.kvcache_block_size
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.backend = make_backend(config.attention_backend)
        self.lora = LoRAManager(config) if config.enable_lora else None  # LoRA adapters' slots
        self.model = self._build_model(draft_head)
        if draft_head:  # its static hidden-state input, before the warm-up and the graphs use it
            self.model.allocate(config.max_num_batched_tokens)
        self.aux_layers = aux_layers
        if aux_layers:
            self.model.model.aux_layers = aux_layers
        self.sampler = StepSampler(config, self.model.lm_head, self.device)
        # what execute() uses, set before the warm-up step that sizes the KV cache runs it
        self.stager = Stager(self.device)
        self._prev_rows: dict[int, int] = {}  # seq_id -> row of the last launched step's sampled tokens
        self._prev_sampled: torch.Tensor | None = None  # those tokens, on the device
        self.graph_runner = None
        layer = next(m for m in self.model.modules() if isinstance(m, Attention))
        # a step without cached prefixes spans at most this many blocks: the staging area's size
        step_blocks = -(-config.max_num_batched_tokens // self.block_size) + config.max_num_seqs
        self.kv_spec = KVCacheSpec(self.hf_config.num_hidden_layers, self.block_size, layer.num_kv_heads,
                                   layer.head_dim, config.kv_cache_dtype,
                                   step_blocks if self.backend.stages_float8_prefill else 0, self.dtype,
                                   len(aux_layers) * self.hf_config.hidden_size)
        self.num_kvcache_blocks = num_kv_blocks(config, self.kv_spec, self.max_blocks_per_seq, self._warmup,
                                                self.device, self.world_size)
        # what one sequence may hold: max_model_len, or all of the pool when max_model_len was left
        # unset and the model's maximum does not fit (the engine then lowers max_model_len)
        self.max_model_len = min(config.max_model_len, self.num_kvcache_blocks * self.block_size)
        self.kv_cache = self.kv_spec.allocate(self.num_kvcache_blocks, self.device)
        self._bind_kv_cache(self.kv_cache)
        if self.device.type == "cuda":
            # allocating pinned memory per step would synchronize the device; events are reused likewise
            rows = config.max_num_seqs + config.max_num_batched_tokens  # sampled rows: a step's drafts add theirs
            self._pinned = [(torch.empty(rows, dtype=torch.int64, pin_memory=True), torch.cuda.Event()) for _ in range(2)]
            if not config.enforce_eager and self.backend.supports_cuda_graphs:
                from nanovllm.engine.cuda_graphs import CUDAGraphRunner  # Triton's: with CUDA only
                self.graph_runner = CUDAGraphRunner(self.model, self.backend, config, self.max_blocks_per_seq,
                                                    self.hf_config.hidden_size, self.model.lm_head.logits_width,
                                                    self.dtype, self.device, workers.graphs if workers else {},
                                                    self.lora and self.lora.context)
                self.graph_runner.capture()
                if chain_steps:
                    self.graph_runner.capture_chains(chain_steps, lambda ids, meta, tokens: greedy_chain(
                        self.model, ids, meta, self.block_size, tokens))

    def _build_model(self, draft_head: bool):
        cls, tp = model_class(self.hf_config, draft_head), TensorParallel(self.rank, self.world_size, self.tp_group,
                                                                   self.config.enable_expert_parallel)
        torch.manual_seed(self.config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            if self.device.type == "cuda":
                check_weights_fit(cls, self.hf_config, tp, self.dtype, self.config.gpu_memory_utilization)
            with torch.device(self.device):
                method = linear_method(self.config.quantization)
                model = cls(self.hf_config, tp, self.backend, self.lora.wrap(method) if self.lora else method)
        finally:
            torch.set_default_dtype(default_dtype)
        cfg = self.config
        weights = dummy_weights(cls, self.hf_config, cfg.seed, self.device, self.dtype) if cfg.load_format == "dummy" \
            else iter_weights(cfg.model, cfg.load_format, self.hf_config)
        load_weights(model, weights)
        process_weights_after_loading(model)
        if self.lora:
            self.lora.attach(model)
        if cfg.quantization and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the model-dtype weights' memory, for the KV cache
        return model

    @torch.inference_mode()
    def _warmup(self) -> int:
        """One prefill step of max_num_batched_tokens tokens and sampling of max_num_seqs rows, with a
        temporary KV cache just big enough; returns that cache's size in bytes. Every rank runs it."""
        cfg, bs = self.config, self.block_size
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
        num_seqs = max(1, min(cfg.max_num_seqs, num_tokens // cfg.max_model_len))
        scheduled, next_block = [], 0
        for _ in range(num_seqs):
            n = num_tokens // num_seqs
            seq = Sequence([0] * n, SamplingParams(temperature=0.0, max_tokens=1))
            seq.block_table = list(range(next_block, next_block + -(-n // bs)))
            seq.num_computed_tokens = n
            next_block += len(seq.block_table)
            scheduled.append((seq, n))
        cache = self.kv_spec.allocate(next_block, self.device)
        self._bind_kv_cache(cache)
        plan, seqs, _, _ = plan_step(scheduled, bs, {})
        self.execute(plan, st=self.sampler.prepare(seqs, {}, None))  # greedy: under tensor parallelism, from shards
        logits = torch.zeros(cfg.max_num_seqs, self.model.lm_head.logits_width, device=self.device, dtype=self.dtype)
        self.sampler(logits, SamplingTensors(torch.ones(cfg.max_num_seqs, device=self.device)))  # compiles its kernel
        del logits
        self._bind_kv_cache(None)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return cache.nbytes

    def _bind_kv_cache(self, cache):
        self.backend.bind_kv_cache(cache)
        if self.aux_layers:
            self.model.model.aux_store = cache and cache.hidden

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]], forks: dict[int, list[Sequence]] | None = None,
            block_copies: list[tuple[int, int]] = (), drafts: dict[int, list[int]] | None = None) -> LaunchedStep | None:
        """Launch one step without waiting for it (rank 0); None when it has nothing to read back
        (no sampled row, no prompt logprobs). A token a sequence has not read back yet (PLACEHOLDER)
        is taken from the last launched step's sampled tokens on the device. forks, block_copies:
        sequences forked this step; drafts: the draft tokens of verifying sequences (see plan_step)."""
        with region("prepare_inputs"):
            plan, seqs, prompt_spans, runs = plan_step(scheduled, self.block_size, self._prev_rows, forks,
                                                       block_copies, drafts)
            if self.lora:
                graphs = self.graph_runner.batch_sizes if self.graph_runner else ()
                plan.lora = self.lora.plan(scheduled, plan.is_decode or plan.uniform_q_len in graphs)
        st = None
        if seqs:
            with region("sampling"):
                st = self.sampler.prepare(seqs, self._prev_rows, self._prev_sampled, draft_offsets(runs, len(seqs)),
                                          {seq.seq_id: run for seq, _, run in runs})
        if self.workers is None:
            out, prompt_lp = self.execute(plan, self._prev_sampled, st)
        else:
            with self.workers.step_guard():
                self.workers.send(replace(plan, input_ids=None, pending=None), st and st.for_workers())
                out, prompt_lp = self.execute(plan, self._prev_sampled, st)
        self._prev_rows = {seq.seq_id: row for row, seq in enumerate(seqs)}  # a run's last row: its pending token
        self._prev_sampled = sampled = logprobs = None
        if out is None and prompt_lp is None:
            return None
        if out is not None:
            sampled, logprobs = out
            self._prev_sampled = sampled
        if self.device.type != "cuda":
            return LaunchedStep(seqs, sampled, None, logprobs, prompt_lp and (prompt_spans, prompt_lp), runs)
        self._pinned.reverse()  # two buffers in turn: at most two steps' tokens are unread at once
        buffer, event = self._pinned[0]
        host = buffer[:len(seqs)]
        if sampled is not None:
            host.copy_(sampled, non_blocking=True)
        logprobs, prompt_lp = (x.to("cpu", non_blocking=True) if x is not None else None for x in (logprobs, prompt_lp))
        event.record(self.stager.stream)
        return LaunchedStep(seqs, host, event, logprobs, prompt_lp and (prompt_spans, prompt_lp), runs)

    @torch.inference_mode()
    def run_chain(self, scheduled: list[tuple[Sequence, int]], steps: int) -> list[list[int]]:
        """A draft model's greedy chain: `steps` decode steps of the scheduled (sequence, 1) pairs
        (one rank), each step's argmax the next step's input on the device, planned once (the first
        step's inputs, then AttentionMetadata.advance) and, where captured, one CUDA graph. A
        sequence's new token may be PLACEHOLDER (the last launched step's sampled token); its
        blocks must hold its steps - 1 later tokens too. Returns the tokens, [steps][sequences],
        once they are on the host."""
        plan, seqs, _, _ = plan_step(scheduled, self.block_size, self._prev_rows, lookahead=steps - 1)
        graph = self.graph_runner.graph_for(plan) if self.graph_runner else None
        if graph is not None and self.graph_runner.chain_tokens.size(0) == steps:
            self.stager.upload_plan(plan, {}, *self.graph_runner.staging_for(graph))
            tokens = self.graph_runner.replay_chain(graph[0], len(seqs),
                                                    self._prev_sampled if len(plan.pending) else None)
        else:
            tensors = self.stager.upload_plan(plan, {})
            meta = self.backend.build_metadata(plan, tensors)
            input_ids, pending = tensors["input_ids"], tensors["pending"] if len(plan.pending) else None
            if pending is not None:
                index, rows = pending.unbind(1)
                input_ids[index] = self._prev_sampled[rows]
            tokens = greedy_chain(self.model, input_ids, meta, self.block_size,
                                  torch.empty(steps, len(seqs), dtype=torch.int64, device=self.device))
        self._prev_rows, self._prev_sampled = {}, None
        return tokens.tolist()

    def read_tokens(self, step: LaunchedStep) -> list[int]:
        """Wait for a launched step and return its sampled token ids, in row order (step.seqs')."""
        if step.event is not None:
            if self.workers is None:
                step.event.synchronize()
            else:
                self.workers.wait(step.event)
        return step.host.tolist() if step.host is not None else []

    @torch.inference_mode()
    def execute(self, plan: StepPlan, prev_sampled: torch.Tensor | None = None, st: SamplingTensors | None = None):
        """Run the forward of one step on this rank and sample plan.sample_rows with st (rank 0's
        SamplingTensors; for_workers() of it on the other ranks); returns, on rank 0, (their token
        ids, TokenLogprobs or None) and the TokenLogprobs of plan.prompt_rows (each None when
        there are none; both None on the other ranks)."""
        with region("prepare_inputs"):
            graph = self.graph_runner.graph_for(plan) if self.graph_runner else None
            arrays = self.backend.host_arrays(plan, graphed=graph is not None)
            if self.lora:
                arrays = arrays | LoRAManager.host_arrays(plan.lora)
            # a graph's inputs go to its staging area, where its first kernel reads them; its pending
            # tokens too, unless rank 0 fills them in before broadcasting the ids
            staging = self.graph_runner.staging_for(graph) if graph is not None else ()
            tensors = self.stager.upload_plan(plan, arrays, *staging, pending_in_graph=self.world_size == 1)
            if self.lora:
                self.lora.begin_step(plan.lora, tensors)
            meta = self.backend.build_metadata(plan, tensors) if graph is None else None  # a graph has its own
            pending = tensors.get("pending") if plan.input_ids is not None and len(plan.pending) else None
            if plan.input_ids is None and graph is None:  # a tensor-parallel worker: rank 0 broadcasts the ids
                input_ids = torch.empty(int(plan.cu_seqlens_q[-1]), dtype=torch.int64, device=self.device)
            else:
                input_ids = tensors["input_ids"]
                if pending is not None and (graph is None or self.world_size > 1):
                    index, rows = pending.unbind(1)
                    input_ids[index] = prev_sampled[rows]
                    pending = None
            if self.world_size > 1:
                dist.broadcast(input_ids, 0)
        with region("forward"):
            if graph is None:
                hidden, logits = self.model(input_ids, meta), None
            else:  # the graph computes every row's logits (this rank's slice) and gathers pending ids
                hidden, logits = self.graph_runner.replay(graph, input_ids.size(0),
                                                          prev_sampled if pending is not None else None)
        if len(plan.block_copies):  # forked sequences' own copy of a shared, partial block, written just now
            src, dst = tensors["block_copies"].unbind(1)  # staged with the plan: a blocking copy would wait for the GPU
            self.kv_cache.copy_blocks(src, dst)
        prompt_lp = self._prompt_logprobs(plan, hidden, tensors) if len(plan.prompt_rows) else None
        if not len(plan.sample_rows):
            return None, prompt_lp
        with region("compute_logits"):
            rows = plan.sample_rows  # every row once (a decode step, a step of verify runs only) needs no gather
            gather_rows = len(rows) != hidden.size(0) or not np.array_equal(rows, np.arange(len(rows)))
            if logits is None:
                logits = self.model.lm_head(hidden[tensors["sample_rows"]] if gather_rows else hidden)
            elif gather_rows:
                logits = logits[tensors["sample_rows"]]
        with region("sampling"):
            return self.sampler(logits, st), prompt_lp

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor, tensors: dict) -> TokenLogprobs | None:
        """The raw logprobs of the prompt tokens after plan.prompt_rows (vLLM's prompt_logprobs), with
        logits made PROMPT_LOGITS_ROWS rows at a time (a long prompt's would not fit at once)."""
        parts, rows, targets = [], tensors["prompt_rows"], tensors["prompt_targets"]
        for start in range(0, len(rows), PROMPT_LOGITS_ROWS):
            logits = self.model.compute_logits(hidden[rows[start:start + PROMPT_LOGITS_ROWS]])
            if logits is not None:  # rank 0
                parts.append(token_logprobs(logits, targets[start:start + PROMPT_LOGITS_ROWS], plan.num_prompt_logprobs))
        return TokenLogprobs(*map(torch.cat, zip(*(vars(p).values() for p in parts)))) if parts else None

    def lora_call(self, method: str, *args):
        """LoRAManager.method(*args) (add, remove, pin: the engine's add_lora, remove_lora,
        pin_lora) on this rank, then from rank 0 on every other (each keeps a host cache of its
        own shards), after the steps sent before, returning once all have run it (TPWorkers.call).
        Returns this rank's result; what this rank raises (a bad adapter, an unknown id) no other
        rank runs; RuntimeError when a worker has died or failed in it."""
        result = getattr(self.lora, method)(*args)
        if self.workers:
            self.workers.call("lora_call", method, *args)
        return result

    def reset(self):
        """Forget the last launched step (after its requests were aborted)."""
        self._prev_rows, self._prev_sampled = {}, None
        self.sampler.reset()
        if self.lora:
            self.lora.forget_slots()

    def synchronize(self):
        if self.device.type == "cuda" and not (self.workers and self.workers.broken):
            torch.cuda.synchronize()  # (a broken tensor-parallel group could hang it)
