"""CUDA graphs of uniform steps: one captured forward and LM head per (batch size, q_len), replayed
for any step of at most that many sequences with q_len new tokens each (q_len 1: decode steps;
1 + k: verifying k draft tokens per sequence). The attention backend owns the static metadata the
graphs read (init_graph_state, graph_metadata); this module owns the token ids in, the hidden
states and this rank's logits out (the LM head inside the graph costs the host no launch: ~0.1 ms
a step at one sequence, docs/perf-log.md, 2026-11-24). A step's ids and metadata reach the static
buffers through a static staging area (step_inputs.GraphLayout), which the step's upload fills
and the graph's first kernel (graph_inputs.py) reads: a step launches its upload and its graph
(and, with pending tokens, a copy of the last sampled ones). With LoRA adapters each (batch size,
q_len) has graphs by the kinds of layers whose deltas they compute (none, some for small batches,
all: LoRAContext.graph_variants), on the LoRA context's static mapping."""
import torch

from nanovllm.config import Config
from nanovllm.engine.step_inputs import GraphLayout
from nanovllm.kernels.graph_inputs import write_graph_inputs
from nanovllm.sequence import PLACEHOLDER
from nanovllm.layers.attention import AttentionBackend, AttentionMetadata
from nanovllm.layers.lora import LoRAContext

CAPTURE_Q_LENS = (1,)  # the q_lens whose uniform steps get graphs: decode; with speculation also 1 + k (capture_q_lens)


def capture_q_lens(config: Config) -> dict[int, int]:
    """q_len -> the most sequences its graphs hold: CAPTURE_Q_LENS' max_num_seqs, and with
    speculative decoding verify steps of k drafts (q_len 1 + k) up to disable_by_batch_size
    sequences (no larger step speculates)."""
    q_lens = dict.fromkeys(CAPTURE_Q_LENS, config.max_num_seqs)
    spec = config.speculative_config
    if spec is not None:
        q_lens[1 + spec.num_speculative_tokens] = min(config.max_num_seqs,
                                                      spec.disable_by_batch_size or config.max_num_seqs)
    return q_lens


class CUDAGraphRunner:
    """graphs: the dict ((batch size, q_len) -> torch.cuda.CUDAGraph; with LoRA, (batch size, q_len,
    LoRA variant) -> graph) to fill; tensor-parallel rank 0 shares it with its workers' handle, which
    frees the graphs before the process group (see TPWorkers). A q_len's batch sizes stop where
    batch size x q_len passes max_num_batched_tokens. lora: the model's LoRAContext, or None."""

    def __init__(self, model, backend: AttentionBackend, config: Config, max_blocks_per_seq: int, hidden_size: int,
                 vocab_shard: int, dtype: torch.dtype, device: torch.device, graphs: dict,
                 lora: LoRAContext | None = None):
        self.model, self.backend, self.graphs, self.lora = model, backend, graphs, lora
        max_seqs, max_tokens = config.max_num_seqs, config.max_num_batched_tokens
        sizes = sorted({b for b in [1, 2, 4, 8, *range(16, max_seqs + 1, 16), max_seqs] if b <= max_seqs})
        self.batch_sizes = {}  # q_len -> its batch sizes, ascending, up to the first that holds its most sequences
        for q, most in capture_q_lens(config).items():
            cap = min(b for b in sizes if b >= most)
            if q <= max_tokens:
                self.batch_sizes[q] = [b for b in sizes if b <= cap and b * q <= max_tokens]
        num_tokens = max(bs[-1] * q for q, bs in self.batch_sizes.items())  # the largest graph's
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.outputs = torch.zeros(num_tokens, hidden_size, dtype=dtype, device=device)
        self.logits = torch.zeros(num_tokens, vocab_shard, dtype=dtype, device=device)  # 78 MB for 256 x 151,936 bf16
        backend.init_graph_state(max(bs[-1] for bs in self.batch_sizes.values()), max_blocks_per_seq,
                                 list(self.batch_sizes), device)
        if lora is not None:
            lora.init_graph_state(num_tokens, device)
        self.layouts = {(b, q): GraphLayout(b, q, max_blocks_per_seq) for q, bs in self.batch_sizes.items() for b in bs}
        # then what a graphed step uploads after its layout's fields: sample rows and cu_seqlens_q
        # (under 2 int64 a token), block copies (2 a sequence), the LoRA mapping (int32, its tiles
        # padded to the graphs')
        rest = 16 * (2 * num_tokens + 3 * max_seqs + 8)
        if lora is not None:
            rest += 4 * (3 * lora.graph_tiles + num_tokens) + 16
        self.staging = torch.zeros(max(x.nbytes for x in self.layouts.values()) + rest, dtype=torch.uint8,
                                   device=device)
        # the last step's sampled tokens, where a graph gathers its pending ones (sampled rows: a step's drafts add theirs)
        self.sampled = torch.zeros(max_seqs + max_tokens, dtype=torch.int64, device=device)

    @torch.inference_mode()
    def capture(self):
        """Capture one forward per (batch size, q_len), most tokens first, sharing one memory pool."""
        pool = None
        keys = [(bs, q) for q, sizes in self.batch_sizes.items() for bs in sizes]
        for bs, q_len in sorted(keys, key=lambda key: key[0] * key[1], reverse=True):
            meta, staged = self.backend.graph_metadata(bs, q_len), self._staged(bs, q_len)
            for variant in self.lora.graph_variants(bs * q_len) if self.lora else [None]:
                if self.lora:
                    self.lora.use_graph(bs * q_len, variant)
                self._forward(staged, q_len, meta)  # warm-up (compiles)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self._forward(staged, q_len, meta)
                pool = graph.pool()
                self.graphs[(bs, q_len, variant) if self.lora else (bs, q_len)] = graph
                graph.replay()  # a graph's first replay uploads it: paid here rather than in the first generate
                torch.cuda.synchronize()
        if self.lora:
            self.lora.clear()

    @torch.inference_mode()
    def capture_chains(self, steps: int, chain):
        """Graphs of a draft model's greedy chains of `steps` decode steps, one per decode batch size
        bs, in the pool of the graphs captured before: chain(input_ids [bs], meta, tokens [steps,
        bs]) on the static buffers, its tokens in chain_tokens."""
        self.chain_tokens = torch.zeros(steps, self.batch_sizes[1][-1], dtype=torch.int64, device=self.input_ids.device)
        self.chains, pool = {}, next(iter(self.graphs.values())).pool()
        for bs in reversed(self.batch_sizes[1]):
            staged, args = self._staged(bs, 1), (self.input_ids[:bs], self.backend.graph_metadata(bs, 1),
                                                 self.chain_tokens[:, :bs])
            def run():
                write_graph_inputs(staged, self.sampled, self.input_ids, self.backend.graph_meta, PLACEHOLDER, 1)
                chain(*args)
            run()  # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                run()
            self.chains[bs] = graph
            graph.replay()
            torch.cuda.synchronize()

    def replay_chain(self, batch_size: int, num_seqs: int, sampled: torch.Tensor | None) -> torch.Tensor:
        """The chain of num_seqs <= batch_size sequences from their first step (staged and sampled as
        replay's): its tokens [steps, num_seqs], a view of a static buffer that the next replay overwrites."""
        if sampled is not None:
            self.sampled[:sampled.size(0)].copy_(sampled)
        self.chains[batch_size].replay()
        return self.chain_tokens[:, :num_seqs]

    def staging_for(self, key: tuple[int, int]) -> tuple[GraphLayout, torch.Tensor]:
        """What Stager.upload_plan takes to stage a step for the graph of key (batch size, q_len)."""
        return self.layouts[key], self.staging

    def _staged(self, batch_size: int, q_len: int) -> dict[str, torch.Tensor]:
        """The staging area's fields for this graph shape, its header set to a step of no sequences:
        the warm-up and capture write padding only, into the static metadata graph_metadata set."""
        staged = self.layouts[(batch_size, q_len)].views(self.staging)
        staged["header"].zero_()
        return staged

    def _forward(self, staged: dict[str, torch.Tensor], q_len: int, meta: AttentionMetadata):
        write_graph_inputs(staged, self.sampled, self.input_ids, self.backend.graph_meta, PLACEHOLDER, q_len)
        num_tokens = staged["input_ids"].size(0)
        self.outputs[:num_tokens] = self.model(self.input_ids[:num_tokens], meta)
        self.model.lm_head(self.outputs[:num_tokens], out=self.logits[:num_tokens])

    def graph_for(self, plan) -> tuple[int, int] | None:
        """The captured (batch size, q_len) that serves a step (its StepPlan), or None (not uniform,
        a q_len without graphs, or too many sequences)."""
        sizes = self.batch_sizes.get(plan.uniform_q_len)
        if sizes is None or not self.graphs:
            return None
        n = len(plan.context_lens)
        return next(((b, plan.uniform_q_len) for b in sizes if b >= n), None)

    def replay(self, key: tuple[int, int], num_tokens: int,
               sampled: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform step of n <= batch size sequences of q_len tokens, key = (batch size, q_len),
        staged with staging_for(key): (hidden states [num_tokens = n * q_len, hidden_size], this rank's
        logits [num_tokens, vocab_shard]), views of static buffers that the next replay overwrites.
        sampled: the last step's sampled tokens [rows] int64 where the step stages pending ones (the
        graph gathers them from a static copy), else None. With LoRA, the graph of the step's variant."""
        if sampled is not None:
            self.sampled[:sampled.size(0)].copy_(sampled)
        if self.lora:
            key = (*key, self.lora.write_graph_inputs(key[0] * key[1]))
        self.graphs[key].replay()
        return self.outputs[:num_tokens], self.logits[:num_tokens]
