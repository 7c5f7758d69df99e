import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function
from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.requests import RequestOutput, RequestProcessor
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from nanovllm.engine.workers import TPWorkers
from nanovllm.utils.distributed import check_tensor_parallel
from nanovllm.utils.source import resolve_model


@dataclass
class _Inflight:
    seqs: list[Sequence]  # the sequences that sample in the step, in row order
    positions: list[int]  # where each one's PLACEHOLDER sits
    tokens: torch.Tensor  # host tensor the sampled ids are copied into
    event: object  # CUDA event after the copy, or None on CPU


class LLMEngine:
    """Drives the Scheduler, BlockManager and ModelRunner; see Config for the engine arguments.
    With tensor_parallel_size > 1 this process is rank 0 and starts the other ranks' processes."""

    def __init__(self, model: str, **engine_args):
        self.config = config = Config(model, **engine_args)
        if config.data_parallel_size > 1:
            raise ValueError("LLMEngine is one replica; LLM(..., data_parallel_size=N) runs several")
        source = resolve_model(model, config.load_format)
        check_tensor_parallel(source.hf_config, config.tensor_parallel_size)
        self.processor = processor = RequestProcessor(config, source)
        self.max_model_len, self.eos_token_ids = processor.max_model_len, processor.eos_token_ids
        workers = TPWorkers(model, config, self.max_model_len) if config.tensor_parallel_size > 1 else None
        self.model_runner = ModelRunner(config, source, self.max_model_len, workers=workers)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.block_manager)
        self._inflight: _Inflight | None = None  # the launched step whose tokens are not read yet
        self._last_sampled = None  # its sampled tokens on the device

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer, or None when it has none (token-id prompts only)."""
        return self.processor.tokenizer

    def add_requests(self, prompts, sampling_params=None) -> list[Sequence]:
        """Validate every request, then queue them all (see generate for the arguments)."""
        seqs = self.processor.to_sequences(prompts, sampling_params)
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs

    # ---- stepping ----------------------------------------------------------------------------

    def abort_all_requests(self):
        """Drop every unfinished request, freeing its KV blocks (finish_reason "abort")."""
        self.model_runner.synchronize()
        for seq in self.scheduler.abort_all():
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self._inflight = self._last_sampled = None

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (e.g. between benchmark runs); False while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished() or self._inflight is not None

    def step(self) -> tuple[list[Sequence], int, int]:
        """Schedule and launch one step, then finish the previous one.

        Steps overlap (as vLLM's async scheduling): the step launched here runs on the GPU while
        the host reads the previous step's sampled tokens, checks stop conditions and schedules
        the next step. A token that is sampled but not yet read sits in its sequence as
        PLACEHOLDER and the next step takes its value straight from the GPU. A sequence that
        stopped is found one step late; the one extra token computed for it is dropped.
        Returns (sequences finished, prompt tokens launched, tokens decoded).
        """
        with record_function("scheduling"):
            scheduled = self.scheduler.schedule()
        num_prefill = num_decode = 0
        launched = None
        if scheduled:
            sampled = self.model_runner.run(scheduled, self._last_sampled)
            launched = self._after_launch(scheduled, sampled)
            for seq, n in scheduled:
                is_prefill = seq.num_computed_tokens - n < seq.num_prompt_tokens
                num_prefill += n if is_prefill else 0
                num_decode += 0 if is_prefill else 1
        finished = self._process(self._inflight) if self._inflight else []
        self._inflight = launched
        return finished, num_prefill, num_decode

    def _after_launch(self, scheduled, sampled) -> _Inflight | None:
        """Advance the bookkeeping of a launched step: computed tokens, one PLACEHOLDER per sampled
        sequence, and the end of sequences that reach max_tokens or max_model_len whatever they sample."""
        seqs = []
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq):
                seqs.append(seq)
        self._last_sampled = sampled
        if not seqs:
            return None
        positions = []
        for row, seq in enumerate(seqs):
            positions.append(len(seq))
            seq.append_token(PLACEHOLDER)
            seq.pending_row = row
            if seq.num_completion_tokens >= seq.sampling_params.max_tokens or len(seq) >= self.max_model_len:
                self.scheduler.finish(seq, "length")  # its blocks are reused only by later, stream-ordered steps
        return _Inflight(seqs, positions, *self.model_runner.to_host(sampled))

    def _process(self, step: _Inflight) -> list[Sequence]:
        """Read a launched step's sampled tokens, put them in place and finish stopped sequences."""
        self.model_runner.wait(step.event)
        finished = []
        for seq, pos, token in zip(step.seqs, step.positions, step.tokens.tolist()):
            if pos >= len(seq):
                continue  # the sequence stopped at an earlier token; this one was extra
            seq.token_ids[pos] = token
            if seq.pending_row is not None and pos == len(seq) - 1:
                seq.pending_row = None
            sp = seq.sampling_params
            if (not sp.ignore_eos and token in self.eos_token_ids) or (sp.stop_token_ids and token in sp.stop_token_ids):
                del seq.token_ids[pos + 1:]
                self.scheduler.finish(seq, "stop")
            if seq.is_finished:
                if pos == len(seq) - 1:  # its last token: reported once (a "length" finish is decided earlier)
                    finished.append(seq)
            elif seq.status == SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq, pos + 1)
        return finished

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (strings or token-id lists) with its SamplingParams (one for all, or
        one per prompt). Returns one RequestOutput per prompt, in input order.

        Raises ValueError("request i: ...") before any work if any request is invalid; then none of
        the call's requests run (the whole call is refused, so a batch never half-runs). If an
        exception or KeyboardInterrupt interrupts the call, its requests are dropped, their blocks
        freed, and the engine is ready for the next call."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        seqs = self.add_requests(prompts, sampling_params)
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        start, prefill_tokens, decode_tokens = time.perf_counter(), 0, 0
        try:
            while self.has_unfinished_requests():
                finished, num_prefill, num_decode = self.step()
                prefill_tokens += num_prefill
                decode_tokens += num_decode
                elapsed = time.perf_counter() - start
                bar.set_postfix(prefill=f"{prefill_tokens / elapsed:.0f}tok/s", decode=f"{decode_tokens / elapsed:.0f}tok/s")
                bar.update(len(finished))
        except BaseException:
            self.abort_all_requests()
            raise
        finally:
            bar.close()
        return [self.processor.output(i, p, seq) for i, (p, seq) in enumerate(zip(prompts, seqs))]
