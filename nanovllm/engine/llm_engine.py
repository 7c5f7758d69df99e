import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function
from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.source import resolve_model


@dataclass
class _Inflight:
    seqs: list[Sequence]  # the sequences that sample in the step, in row order
    positions: list[int]  # where each one's PLACEHOLDER sits
    tokens: torch.Tensor  # host tensor the sampled ids are copied into
    event: object  # CUDA event after the copy, or None on CPU


@dataclass
class RequestOutput:
    """One finished request. `token_ids` holds the completion only; finish_reason is "stop"
    (EOS or a stop token) or "length" (max_tokens or max_model_len). out["text"] works too."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def __getitem__(self, key: str):
        return getattr(self, key)


class LLMEngine:
    """Drives the Scheduler, BlockManager and ModelRunner; see Config for the engine arguments."""

    def __init__(self, model: str, **engine_args):
        self.config = config = Config(model, **engine_args)
        source = resolve_model(model, config.load_format)
        hf_config = source.hf_config
        max_pos = hf_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_pos:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        self.max_model_len = config.max_model_len or max_pos
        self.tokenizer = source.tokenizer
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = self._eos_token_ids(hf_config, self.tokenizer)
        self.model_runner = ModelRunner(config, source, self.max_model_len)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.block_manager)
        self._inflight: _Inflight | None = None  # the launched step whose tokens are not read yet
        self._last_sampled = None  # its sampled tokens on the device

    @staticmethod
    def _eos_token_ids(hf_config, tokenizer) -> set[int]:
        ids = getattr(hf_config, "eos_token_id", None)
        ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return ids

    # ---- requests ----------------------------------------------------------------------------

    def add_requests(self, prompts, sampling_params=None) -> list[Sequence]:
        """Validate every request, then queue them all (see generate for the arguments)."""
        seqs = self._to_sequences(prompts, sampling_params)
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs

    def _to_sequences(self, prompts, sampling_params) -> list[Sequence]:
        """Validate every request before any work; ValueError names the request index and the problem."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or (prompts and all(isinstance(p, int) for p in prompts)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; "
                             f"pass one, or one per prompt")
        seqs = []
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            try:
                if not isinstance(sp, SamplingParams):
                    raise ValueError(f"sampling params must be SamplingParams, got {type(sp).__name__}")
                sp.validate()
                seqs.append(Sequence(self._token_ids(prompt), sp))
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        return seqs

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token-id lists")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        else:
            raise ValueError(f"a prompt must be a string or a list of ints, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        return ids

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
        if step.event is not None:
            step.event.synchronize()
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
        return [self._output(i, p, seq) for i, (p, seq) in enumerate(zip(prompts, seqs))]

    def _output(self, index: int, prompt, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True) if self.tokenizer else ""
        return RequestOutput(index, prompt if isinstance(prompt, str) else None, seq.prompt_token_ids, text,
                             seq.completion_token_ids, seq.finish_reason, seq.num_cached_tokens)
