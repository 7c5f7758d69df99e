"""CUDA graphs of decode steps: one captured forward and LM head per batch size, replayed for any
decode step of at most that many sequences. The attention backend owns the static metadata the
graphs read (init_graph_state, graph_metadata); this module owns the token ids in, the hidden
states and this rank's logits out (the LM head inside the graph costs the host no launch: ~0.1 ms
a step at one sequence, docs/perf-log.md, 2026-11-24), and writes a step's ids and
metadata into the static buffers before each replay (graph_inputs.py: one kernel). With LoRA
adapters each batch size has graphs by the kinds of layers whose deltas they compute (none, some
for small batches, all: LoRAContext.graph_variants), on the LoRA context's static mapping."""
import torch

from nanovllm.kernels.graph_inputs import write_graph_inputs
from nanovllm.sequence import PLACEHOLDER
from nanovllm.layers.attention import AttentionBackend, AttentionMetadata
from nanovllm.layers.lora import LoRAContext


class CUDAGraphRunner:
    """graphs: the dict ((batch size, LoRA variant) -> torch.cuda.CUDAGraph) to fill; tensor-parallel
    rank 0 shares it with its workers' handle, which frees the graphs before the process group (see
    TPWorkers). lora: the model's LoRAContext, or None."""

    def __init__(self, model, backend: AttentionBackend, max_num_seqs: int, max_blocks_per_seq: int,
                 hidden_size: int, vocab_shard: int, dtype: torch.dtype, device: torch.device, graphs: dict,
                 lora: LoRAContext | None = None):
        self.model, self.backend, self.graphs, self.lora = model, backend, graphs, lora
        self.batch_sizes = sorted({b for b in [1, 2, 4, 8, *range(16, max_num_seqs + 1, 16), max_num_seqs]
                                   if b <= max_num_seqs})
        max_bs = self.batch_sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.outputs = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.logits = torch.zeros(max_bs, vocab_shard, dtype=dtype, device=device)  # 78 MB for 256 x 151,936 bf16
        backend.init_graph_state(max_bs, max_blocks_per_seq, device)
        if lora is not None:
            lora.init_graph_state(max_bs, device)

    @torch.inference_mode()
    def capture(self):
        """Capture one decode forward per batch size, largest first, sharing one memory pool."""
        pool = None
        for bs in reversed(self.batch_sizes):
            meta = self.backend.graph_metadata(bs)
            for variant in self.lora.graph_variants(bs) if self.lora else [None]:
                if self.lora:
                    self.lora.use_graph(bs, variant)
                self._forward(bs, meta)  # warm-up (compiles)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self._forward(bs, meta)
                pool = graph.pool()
                self.graphs[bs, variant] = graph
                graph.replay()  # a graph's first replay uploads it: paid here rather than in the first generate
                torch.cuda.synchronize()
        if self.lora:
            self.lora.clear()

    def _forward(self, bs: int, meta: AttentionMetadata):
        self.outputs[:bs] = self.model(self.input_ids[:bs], meta)
        self.model.lm_head(self.outputs[:bs], out=self.logits[:bs])

    def batch_size_for(self, meta: AttentionMetadata) -> int | None:
        """The captured size that serves this step, or None (not a decode step, or too large)."""
        if not meta.is_decode or not self.graphs:
            return None
        n = meta.context_lens.size(0)
        return next((b for b in self.batch_sizes if b >= n), None)

    def replay(self, batch_size: int, input_ids: torch.Tensor, pending: torch.Tensor | None,
               sampled: torch.Tensor | None, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step of n <= batch_size sequences: (hidden states [n, hidden_size], this rank's
        logits [n, vocab_shard]), views of static buffers that the next replay overwrites.
        input_ids, pending, sampled: as graph_inputs.write_graph_inputs takes them."""
        n = input_ids.size(0)
        write_graph_inputs(batch_size, input_ids, pending, sampled, meta, self.input_ids, self.backend.graph_meta,
                           PLACEHOLDER)
        variant = self.lora.write_graph_inputs(batch_size) if self.lora else None
        self.graphs[batch_size, variant].replay()
        return self.outputs[:n], self.logits[:n]
