"""Runs one packed forward per step: builds the step's inputs, writes K/V into the paged cache,
computes logits for the sampled rows only and samples them. Decode-only steps replay CUDA graphs.
Under tensor parallelism every rank has a ModelRunner; rank 0 plans each step and sends the plan
to the others (see workers.py), and only rank 0 samples."""
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import record_function

from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import Attention, select_backend
from nanovllm.layers.sampler import Sampler
from nanovllm.models.registry import model_class
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.context import Context, reset_context, set_context
from nanovllm.utils.distributed import init_process_group, tensor_parallel
from nanovllm.utils.loader import dummy_weights, load_weights
from nanovllm.utils.source import ModelSource


@dataclass
class StepPlan:
    """One step's inputs as host arrays (int64), T tokens of S sequences; what rank 0 sends to
    the other tensor-parallel ranks, with input_ids and pending left out (the ids are broadcast)."""
    input_ids: np.ndarray | None  # [T]; PLACEHOLDER where the previous step's sampled token goes
    pending: np.ndarray | None  # [P, 2]: (token index, row of the previous step's sampled tokens)
    positions: np.ndarray  # [T]
    cu_seqlens_q: np.ndarray  # [S + 1]
    context_lens: np.ndarray  # [S]: tokens in the cache after this step
    slot_mapping: np.ndarray  # [T]: KV cache slot of each new token
    block_tables: np.ndarray  # [S, max blocks], -1 padded
    sample_rows: np.ndarray  # token rows whose logits are sampled
    is_decode: bool
    max_seqlen_q: int


class ModelRunner:
    def __init__(self, config: Config, source: ModelSource, max_model_len: int, rank: int = 0,
                 store_path: str | None = None, workers=None):
        """rank, store_path: this process's tensor-parallel rank and the FileStore where the ranks
        meet (tensor_parallel_size > 1); workers: rank 0's TPWorkers (whose store_path it uses)."""
        self.config = config
        self.hf_config = hf_config = source.hf_config
        self.rank, self.world_size, self.workers = rank, config.tensor_parallel_size, workers
        self.device = config.torch_device
        if self.world_size > 1:
            if self.device.type == "cuda":
                torch.cuda.set_device(rank)
                self.device = torch.device("cuda", rank)
            init_process_group(rank, self.world_size, store_path or workers.store_path, self.device)
        self.dtype = config.torch_dtype(hf_config)
        self.block_size = config.kvcache_block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = (max_model_len + self.block_size - 1) // self.block_size
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        cls = model_class(hf_config)
        try:
            with tensor_parallel(rank, self.world_size):
                if self.device.type == "cuda":
                    self._check_weights_fit(cls)
                with torch.device(self.device):
                    self.model = cls(hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        weights = source.weights() if source.weights is not None else \
            dummy_weights(cls, hf_config, config.seed, self.device, self.dtype)
        load_weights(self.model, weights)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.backend = select_backend(config.attention_backend, self.device, self.attn_layers[0].head_dim)
        for layer in self.attn_layers:
            layer.backend = self.backend
        self.sampler = Sampler(config.seed)
        self.graphs = workers.graphs if workers else {}  # batch size -> CUDAGraph
        self._staging: dict[torch.dtype, list] = {}  # dtype -> two [pinned buffer, event] (see _upload)
        max_bs = config.max_num_seqs
        self.graph_batch_sizes = sorted({b for b in [1, 2, 4, 8, *range(16, max_bs + 1, 16), max_bs] if b <= max_bs})
        self.num_kvcache_blocks = self._allocate_kv_cache()
        if self.device.type == "cuda":
            # allocating pinned memory per step would synchronize the device
            self._pinned = [torch.empty(max_bs, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            if not config.enforce_eager and self.backend.supports_cuda_graphs:
                self._capture_cudagraphs()

    def _check_weights_fit(self, cls):
        """Raise MemoryError, before allocating anything, when the weights alone exceed the engine's
        share of the GPU: gpu_memory_utilization x total memory, less what is already in use (after
        this process's allocator returns its cached free memory, e.g. a deleted LLM's)."""
        with torch.device("meta"):
            params = {id(p): p for p in cls(self.hf_config).parameters()}.values()
        need = sum(p.numel() for p in params) * self.dtype.itemsize
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        share = total * self.config.gpu_memory_utilization - (total - free)
        if need > share:
            raise MemoryError(f"the weights need {need / 2**30:.2f} GiB in {self.dtype}, but the engine may use "
                              f"{max(share, 0) / 2**30:.2f} GiB (gpu_memory_utilization={self.config.gpu_memory_utilization}"
                              f" of {total / 2**30:.1f} GiB, {(total - free) / 2**30:.2f} GiB already in use); raise "
                              f"gpu_memory_utilization, pick a smaller dtype, or free the GPU")

    # ---- KV cache ----------------------------------------------------------------------------

    def _block_bytes(self) -> int:
        layer = self.attn_layers[0]
        return 2 * len(self.attn_layers) * self.block_size * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize

    def _allocate_kv_cache(self) -> int:
        """Size the KV pool (num_kvcache_blocks, else from gpu_memory_utilization after a warm-up
        forward on GPU, else cpu_kvcache_space_gib on CPU) and hand each Attention layer its slice.
        Raises ValueError when not even one max_model_len sequence fits."""
        cfg, block_bytes = self.config, self._block_bytes()
        if cfg.num_kvcache_blocks is not None:
            num_blocks, budget = cfg.num_kvcache_blocks, "num_kvcache_blocks"
        elif self.device.type == "cuda":
            num_blocks, budget = self._blocks_from_gpu_memory(block_bytes), "gpu_memory_utilization"
        else:
            limit = cfg.max_num_seqs * self.max_blocks_per_seq  # more would never be used at once
            num_blocks, budget = min(int(cfg.cpu_kvcache_space_gib * 2**30) // block_bytes, limit), "cpu_kvcache_space_gib"
        if self.world_size > 1:  # every rank holds the same blocks (of its own KV heads): the fewest that fit
            count = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(count, dist.ReduceOp.MIN)
            num_blocks = int(count.item())
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {max(num_blocks, 0)} blocks of {self.block_size} tokens "
                f"({max(num_blocks, 0) * block_bytes / 2**30:.2f} GiB), but one sequence of max_model_len="
                f"{self.max_model_len} needs {self.max_blocks_per_seq} ({self.max_blocks_per_seq * block_bytes / 2**30:.2f} GiB); "
                f"raise {budget} or lower max_model_len"
                + ("" if budget == "num_kvcache_blocks" else " (or set num_kvcache_blocks)"))
        self._bind_kv_cache(num_blocks)
        return num_blocks

    def _bind_kv_cache(self, num_blocks: int):
        """Allocate kv_cache [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim] and give
        each Attention layer its k and v slices."""
        layer = self.attn_layers[0]
        shape = (2, len(self.attn_layers), num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
        self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _blocks_from_gpu_memory(self, block_bytes: int) -> int:
        """Blocks that fit in gpu_memory_utilization * total memory after the weights and the
        activations of a warm-up step at the largest batch (max_num_batched_tokens tokens)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        warmup_bytes = self._warmup()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        peak = stats["allocated_bytes.all.peak"] - warmup_bytes  # the warm-up's own KV cache is not activation
        used_outside = (total - free) - stats["reserved_bytes.all.current"]  # CUDA context, other processes
        available = total * self.config.gpu_memory_utilization - used_outside - peak
        return int(available // block_bytes)

    @torch.inference_mode()
    def _warmup(self) -> int:
        """One prefill step of max_num_batched_tokens tokens and sampling of max_num_seqs rows, with a
        temporary KV cache just big enough; returns that cache's size in bytes. Every rank runs it."""
        cfg = self.config
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * self.max_model_len)
        num_seqs = max(1, min(cfg.max_num_seqs, num_tokens // self.max_model_len))
        lens = [num_tokens // num_seqs] * num_seqs
        self._bind_kv_cache(sum((n + self.block_size - 1) // self.block_size for n in lens))
        seqs, next_block = [], 0
        for n in lens:
            seq = Sequence([0] * n, SamplingParams(temperature=0.0, max_tokens=1))
            seq.block_table = list(range(next_block, next_block + (n + self.block_size - 1) // self.block_size))
            next_block += len(seq.block_table)
            seqs.append((seq, n))
        self.execute(self._plan(seqs)[0])
        if self.rank == 0:
            logits = torch.zeros(cfg.max_num_seqs, self.model.lm_head.num_embeddings, device=self.device, dtype=self.dtype)
            self.sampler(logits, torch.ones(cfg.max_num_seqs, device=self.device))  # compiles the sampling kernel
            del logits
        cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        del self.kv_cache
        for attn in self.attn_layers:
            attn.k_cache = attn.v_cache = torch.tensor([])
        torch.cuda.synchronize()
        return cache_bytes

    # ---- one step ----------------------------------------------------------------------------

    def _plan(self, scheduled: list[tuple[Sequence, int]]) -> tuple[StepPlan, list[Sequence]]:
        """Pack the step's new tokens into a StepPlan; also returns the sequences sampled this step
        (those whose last new token reaches their end), in row order. Index math is vectorised."""
        bs = self.block_size
        num_seqs = len(scheduled)
        starts = np.fromiter((seq.num_computed_tokens for seq, _ in scheduled), np.int64, num_seqs)
        counts = np.fromiter((n for _, n in scheduled), np.int64, num_seqs)
        cu_q = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(counts, out=cu_q[1:])
        context_lens = starts + counts
        width = int(-(-context_lens.max() // bs))
        block_tables = np.full((num_seqs, width), -1, np.int64)
        input_ids, pending = [], []
        for i, (seq, n) in enumerate(scheduled):
            table = seq.block_table[:width]
            block_tables[i, :len(table)] = table
            input_ids.extend(seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n])
            if seq.pending_row is not None:
                pending.append((len(input_ids) - 1, seq.pending_row))
        seq_of_token = np.repeat(np.arange(num_seqs), counts)
        positions = np.arange(cu_q[-1]) - cu_q[seq_of_token] + starts[seq_of_token]
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        samples = [(i, seq) for i, (seq, n) in enumerate(scheduled) if seq.num_computed_tokens + n == len(seq)]
        plan = StepPlan(np.array(input_ids, np.int64), np.array(pending, np.int64).reshape(-1, 2), positions, cu_q,
                        context_lens, slot_mapping, block_tables, cu_q[[i + 1 for i, _ in samples]] - 1,
                        bool((counts == 1).all()), int(counts.max()))
        return plan, [seq for _, seq in samples]

    def _to_device(self, plan: StepPlan, prev_sampled: torch.Tensor | None):
        """input_ids, positions and the Context on the device. PLACEHOLDER ids take their value from
        prev_sampled, the previous step's sampled tokens still on the device; under tensor
        parallelism rank 0 then broadcasts the ids to the other ranks."""
        cu_seqlens_q, context_lens, block_tables = self._upload(
            [plan.cu_seqlens_q, plan.context_lens, plan.block_tables], torch.int32)
        ids = [] if plan.input_ids is None else [plan.input_ids, plan.pending]
        positions, slot_mapping, sample_rows, *ids = self._upload(
            [plan.positions, plan.slot_mapping, plan.sample_rows, *ids], torch.int64)
        ctx = Context(is_decode=plan.is_decode, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=plan.max_seqlen_q,
                      context_lens=context_lens, slot_mapping=slot_mapping, block_tables=block_tables)
        if plan.input_ids is None:
            input_ids = torch.empty(int(plan.cu_seqlens_q[-1]), dtype=torch.int64, device=self.device)
        else:
            input_ids, pending = ids
            if len(plan.pending):
                index, rows = pending.unbind(1)
                input_ids[index] = prev_sampled[rows]
        if self.world_size > 1:
            dist.broadcast(input_ids, 0)
        return input_ids, positions, ctx, sample_rows

    def _upload(self, arrays: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        """The host arrays on the device as `dtype`, in one transfer. On CUDA they are packed into
        one of two pinned buffers per dtype, used in turn, and copied asynchronously; a buffer is
        refilled only after its last copy has run (its event), since steps that sample nothing
        (prompt chunks) and tensor-parallel workers may run ahead of the GPU. Every array starts
        16-byte aligned: Triton compiles a kernel anew for a pointer that is not."""
        align = 16 // dtype.itemsize
        starts = np.cumsum([0] + [-(-a.size // align) * align for a in arrays])
        total = int(starts[-1])
        if self.device.type != "cuda":
            flat = torch.empty(total, dtype=dtype)
            host = flat.numpy()
        else:
            if dtype not in self._staging:
                self._staging[dtype] = [[torch.empty(0, dtype=dtype), torch.cuda.Event()] for _ in range(2)]
            slots = self._staging[dtype]
            slots.reverse()
            slot = slots[0]
            slot[1].synchronize()
            if slot[0].numel() < total:  # grows during the start-up warm-up (the largest step), rarely later
                slot[0] = torch.empty(2 * total, dtype=dtype, pin_memory=True)
            host = slot[0].numpy()
        for a, start in zip(arrays, starts):
            host[start:start + a.size] = a.ravel()
        if self.device.type == "cuda":
            flat = slot[0][:total].to(self.device, non_blocking=True)
            slot[1].record()
        return [flat[start:start + a.size].view(a.shape) for a, start in zip(arrays, starts)]

    def _prepare_sampling(self, seqs: list[Sequence]) -> dict:
        params = [seq.sampling_params for seq in seqs]
        if all(p.temperature == 0 for p in params):
            return {}

        def dev(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        out = {"temperatures": dev([p.temperature for p in params], torch.float32)}
        if any(p.top_k > 0 for p in params):
            out["top_k"] = dev([p.top_k for p in params], torch.int64)
        if any(p.top_p < 1 for p in params):
            out["top_p"] = dev([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0 for p in params):
            out["min_p"] = dev([p.min_p for p in params], torch.float32)
        generators = {}
        for row, seq in enumerate(seqs):
            if seq.sampling_params.seed is not None and seq.sampling_params.temperature > 0:
                if seq.generator is None:
                    seq.generator = torch.Generator(self.device).manual_seed(seq.sampling_params.seed)
                generators[row] = seq.generator
        if generators:
            out["generators"] = generators
        return out

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]], prev_sampled: torch.Tensor | None = None):
        """Launch one step without waiting for it (rank 0). Returns the sampled tokens (int64, on
        the device) of the sequences that reach their end this step, in scheduled order, or None."""
        with record_function("prepare_inputs"):
            plan, sample_seqs = self._plan(scheduled)
        if self.workers is None:
            logits = self.execute(plan, prev_sampled)
        else:
            with self.workers.step_guard():
                self.workers.send(replace(plan, input_ids=None, pending=None))
                logits = self.execute(plan, prev_sampled)
        if logits is None:
            return None
        with record_function("sampling"):
            return self.sampler(logits, **self._prepare_sampling(sample_seqs))

    @torch.inference_mode()
    def execute(self, plan: StepPlan, prev_sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run the forward of one step on this rank; returns the logits of plan.sample_rows on rank 0
        (None on the other ranks, or when no row is sampled)."""
        with record_function("prepare_inputs"):
            input_ids, positions, ctx, sample_rows = self._to_device(plan, prev_sampled)
        with record_function("forward"):
            hidden = self._forward(input_ids, positions, ctx)
            reset_context()
        if not len(plan.sample_rows):
            return None
        with record_function("compute_logits"):
            if len(plan.sample_rows) < hidden.size(0):
                hidden = hidden[sample_rows]
            return self.model.compute_logits(hidden)

    def to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying `tokens` to the host; returns (host tensor, CUDA event to wait on, or None).
        Two pinned buffers alternate: at most two steps' tokens are unread at once."""
        if self.device.type != "cuda":
            return tokens, None
        self._pinned.reverse()
        host = self._pinned[0][:tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def wait(self, event):
        """Block until `event` (from to_host) has happened."""
        if event is None:
            return
        if self.workers is None:
            event.synchronize()
        else:
            self.workers.wait(event)

    def synchronize(self):
        if self.device.type == "cuda" and not (self.workers and self.workers.broken):
            torch.cuda.synchronize()  # (a broken tensor-parallel group could hang it)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor:
        num_tokens = input_ids.size(0)
        graph_bs = next((b for b in self.graph_batch_sizes if b >= num_tokens), None) if ctx.is_decode and self.graphs else None
        if graph_bs is None:
            set_context(ctx)
            return self.model(input_ids, positions)
        return self._replay(graph_bs, input_ids, positions, ctx)

    # ---- CUDA graphs for decode -------------------------------------------------------------

    @torch.inference_mode()
    def _capture_cudagraphs(self):
        """Capture one decode forward per batch size in graph_batch_sizes, largest first, sharing
        one memory pool. A step of n sequences replays the smallest captured size >= n with the
        padding rows' slots set to -1 (no KV write) and context length 0."""
        max_bs = max(self.graph_batch_sizes)
        hidden_size = self.model.model.embed_tokens.weight.size(1)
        self.graph_vars = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=self.device),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.arange(max_bs + 1, dtype=torch.int32, device=self.device),
            outputs=torch.zeros(max_bs, hidden_size, dtype=self.dtype, device=self.device),
        )
        v = self.graph_vars
        pool = None
        for bs in reversed(self.graph_batch_sizes):
            set_context(Context(is_decode=True, cu_seqlens_q=v["cu_seqlens_q"][:bs + 1], max_seqlen_q=1,
                                context_lens=v["context_lens"][:bs],
                                slot_mapping=v["slot_mapping"][:bs], block_tables=v["block_tables"][:bs]))
            v["outputs"][:bs] = self.model(v["input_ids"][:bs], v["positions"][:bs])  # warm-up (compiles)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                v["outputs"][:bs] = self.model(v["input_ids"][:bs], v["positions"][:bs])
            pool = graph.pool()
            self.graphs[bs] = graph
            # One-time costs of a batch size, paid here rather than in the first generate: a graph's
            # first replay uploads it, and CUDA loads the LM head's GEMM kernel for it lazily.
            graph.replay()
            self.model.compute_logits(v["outputs"][:bs])
            torch.cuda.synchronize()
        reset_context()

    def _replay(self, bs: int, input_ids, positions, ctx: Context) -> torch.Tensor:
        v, n = self.graph_vars, input_ids.size(0)
        v["input_ids"][:n] = input_ids
        v["positions"][:n] = positions
        v["slot_mapping"].fill_(-1)
        v["slot_mapping"][:n] = ctx.slot_mapping
        v["context_lens"].zero_()
        v["context_lens"][:n] = ctx.context_lens
        v["block_tables"][:n, :ctx.block_tables.size(1)] = ctx.block_tables
        self.graphs[bs].replay()
        return v["outputs"][:n]

