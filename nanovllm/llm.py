"""The user-facing entry point: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""
from itertools import count

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.base import EngineBase
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput


class LLM:
    """Owns one engine: an LLMEngine, or with data_parallel_size > 1 a DataParallelEngine of that
    many replicas. Engine arguments are vLLM's names (see Config); ValueError or TypeError for a
    bad one, FileNotFoundError for a missing model, before anything is loaded."""

    def __init__(self, model: str, **engine_args):
        self.config = config = Config.create(model, **engine_args)
        if config.data_parallel_size > 1:
            from nanovllm.parallel.data_parallel import DataParallelEngine
            self.engine: EngineBase = DataParallelEngine(config)
        else:
            self.engine = LLMEngine(config)
        self._request_ids = count()

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer, or None when it has none (token-id prompts only)."""
        return self.config.tokenizer

    def get_tokenizer(self):
        return self.config.tokenizer

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (strings, token-id lists, or {"prompt_token_ids": ...} dicts) with its
        SamplingParams (one for all, or one per prompt). Returns one RequestOutput per prompt, in
        input order.

        Raises ValueError("request i: ...") before any work if any request is invalid; then none of
        the call's requests run (the whole call is refused, so a batch never half-runs). If an
        exception or KeyboardInterrupt interrupts the call, its requests are dropped, their blocks
        freed, and the engine is ready for the next call."""
        requests = self.engine.processor.normalize(prompts, sampling_params)
        for i, (prompt, params) in enumerate(requests):  # validate all before queuing any
            try:
                self.engine.processor.make_sequence("", prompt, params)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        ids = [str(next(self._request_ids)) for _ in requests]
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            for request_id, (prompt, params) in zip(ids, requests):
                self.engine.add_request(request_id, prompt, params)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    outputs[out.request_id] = out
                    bar.update(1)
        except BaseException:
            self.engine.abort_all_requests()
            raise
        finally:
            bar.close()
        return [outputs[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (e.g. between benchmark runs); False while requests hold blocks."""
        return self.engine.reset_prefix_cache()
