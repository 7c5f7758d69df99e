import time
from dataclasses import dataclass

from torch.profiler import record_function
from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.source import resolve_model


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

    def step(self) -> tuple[list[Sequence], int, int]:
        """Schedule and run one step. Returns (sequences finished in it, prompt tokens run, tokens decoded)."""
        with record_function("scheduling"):
            scheduled = self.scheduler.schedule()
        token_ids = self.model_runner.run(scheduled)
        finished, num_prefill, num_decode = [], 0, 0
        sampled = iter(token_ids)
        for seq, n in scheduled:
            was_prefill = seq.num_computed_tokens < seq.num_prompt_tokens
            num_prefill += n if was_prefill else 0
            num_decode += 0 if was_prefill else 1
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < len(seq):
                self.block_manager.cache_full_blocks(seq)
                continue  # mid-prefill: nothing sampled
            self.block_manager.cache_full_blocks(seq)
            seq.append_token(next(sampled))
            reason = self._finish_reason(seq)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                finished.append(seq)
        return finished, num_prefill, num_decode

    def _finish_reason(self, seq: Sequence) -> str | None:
        sp, token = seq.sampling_params, seq.token_ids[-1]
        if (not sp.ignore_eos and token in self.eos_token_ids) or (sp.stop_token_ids and token in sp.stop_token_ids):
            return "stop"
        if seq.num_completion_tokens >= sp.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (strings or token-id lists) with its SamplingParams (one for all, or
        one per prompt). Returns one RequestOutput per prompt, in input order. Raises ValueError,
        before any work, if any request is invalid. If interrupted, every request of this call is
        dropped and the engine is left clean for the next call."""
        seqs = self.add_requests(prompts, sampling_params)
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        start, prefill_tokens, decode_tokens = time.perf_counter(), 0, 0
        try:
            while not self.scheduler.is_finished():
                finished, num_prefill, num_decode = self.step()
                prefill_tokens += num_prefill
                decode_tokens += num_decode
                elapsed = time.perf_counter() - start
                bar.set_postfix(prefill=f"{prefill_tokens / elapsed:.0f}tok/s", decode=f"{decode_tokens / elapsed:.0f}tok/s")
                bar.update(len(finished))
        except BaseException:
            self.scheduler.abort_all()
            raise
        finally:
            bar.close()
        return [self._output(i, p, seq) for i, (p, seq) in enumerate(zip(prompts if not isinstance(prompts, str) else [prompts], seqs))]

    def _output(self, index: int, prompt, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True) if self.tokenizer else ""
        return RequestOutput(index, prompt if isinstance(prompt, str) else None, seq.prompt_token_ids, text,
                             seq.completion_token_ids, seq.finish_reason, seq.num_cached_tokens)
