"""The user-facing entry point: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""
import threading
from dataclasses import replace
from itertools import count

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine_args import EngineArgs
from nanovllm.engine.base import EngineBase
from nanovllm.executor.llm_engine import LLMEngine, check_model
from nanovllm.lora.request import LoRARequest
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Owns one engine: an LLMEngine, or with data_parallel_size > 1 a DataParallelEngine of that
    many replicas (with distributed_executor_backend="ray", a RayDataParallelEngine, even of one).
    Engine arguments are vLLM's (EngineArgs' fields); ValueError for a bad value, TypeError for an
    unknown name, FileNotFoundError for a missing model, before anything is loaded. Calls from
    several threads are served one after another."""

    def __init__(self, model: str, **engine_args):
        self.config = Config.create(EngineArgs.from_kwargs(model, **engine_args))
        check_model(self.config)
        if self.config.distributed_executor_backend == "ray":
            from nanovllm.executor.ray_replicas import RayDataParallelEngine
            self.engine: EngineBase = RayDataParallelEngine(self.config)
        elif self.config.data_parallel_size > 1:
            from nanovllm.executor.data_parallel import DataParallelEngine
            self.engine = DataParallelEngine(self.config)
        else:
            self.engine = LLMEngine(self.config)
        self.config = self.engine.config  # max_model_len may have been lowered to what the KV cache holds
        self._request_ids = count()
        self._lock = threading.Lock()

    @property
    def llm_engine(self) -> EngineBase:
        """vLLM's name for the engine this LLM owns (`llm.llm_engine`), the same as `engine`."""
        return self.engine

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer, or None when it has none (token-id prompts only)."""
        return self.config.tokenizer

    def get_tokenizer(self):
        return self.config.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults overridden by the model's generation_config.json (temperature, top_p,
        top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens), unless the engine has
        generation_config="vllm"."""
        return SamplingParams(**self.config.generation_defaults)

    def generate(self, prompts=None, sampling_params=None, use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 priority: list[int] | None = None, *, prompt_token_ids=None) -> list[RequestOutput]:
        """Complete every prompt (strings, token-id lists, or {"prompt_token_ids": ...} dicts) with its
        SamplingParams (one for all, or one per prompt; None: get_default_sampling_params()) and
        its LoRA adapter (lora_request: one for all, or one per prompt, None for the base model;
        the engine needs enable_lora=True). Returns one finished RequestOutput per prompt, in input
        order. prompt_token_ids: vLLM's former keyword, the prompts as one token-id list or a list
        of them (instead of prompts). priority: vLLM's, for its priority scheduling; requests here
        run first come, first served, so only None or zeros are taken (ValueError otherwise, as
        vLLM's without scheduling_policy="priority").

        Raises ValueError("request i: ...") before any work if any request is invalid; then none of
        the call's requests run (the whole call is refused, so a batch never half-runs); TypeError
        when sampling_params is neither a SamplingParams nor a list of them. If an exception or
        KeyboardInterrupt interrupts the call, its requests are dropped, their blocks freed, and
        the engine is ready for the next call."""
        if prompt_token_ids is not None:
            if prompts is not None:
                raise ValueError("pass the prompts once, as prompts or as prompt_token_ids (a {\"prompt\": text, "
                                 "\"prompt_token_ids\": ids} dict gives both)")
            one = prompt_token_ids and all(isinstance(t, int) for t in prompt_token_ids)
            prompts = [prompt_token_ids] if one else prompt_token_ids
        if priority is not None and any(priority):
            raise ValueError(f"got priority {priority}, but requests are scheduled first come, first served "
                             f"(there is no priority scheduling)")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        processor = self.engine.processor
        pairs = processor.normalize(prompts, sampling_params)
        if not isinstance(lora_request, (list, tuple)):
            lora_request = [lora_request] * len(pairs)
        elif len(lora_request) != len(pairs):
            raise ValueError(f"got {len(lora_request)} lora_requests for {len(pairs)} prompts; pass one, "
                             f"or one per prompt")
        requests = []
        for i, ((prompt, params), lora) in enumerate(zip(pairs, lora_request)):
            try:  # validate all before queuing any, tokenizing each prompt once
                request = processor.make_request("", prompt, params, lora)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
            requests.append(({"prompt_token_ids": request.prompt_token_ids, "prompt": request.prompt}, params, lora))
        with self._lock:
            return self._run(requests, use_tqdm)

    def _run(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        ids = [str(next(self._request_ids)) for _ in requests]
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            for request_id, (prompt, params, lora) in zip(ids, requests):
                self.engine.add_request(request_id, prompt, replace(params, output_kind=RequestOutputKind.FINAL_ONLY),
                                        lora_request=lora)
            spec_metrics = getattr(self.engine, "spec_metrics", None) if self.config.speculative_config else None
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    outputs[out.request_id] = out
                    bar.update(1)
                    if spec_metrics is not None and use_tqdm:
                        bar.set_postfix_str(spec_metrics.postfix(), refresh=False)
        except BaseException:
            self.engine.abort_all_requests()
            raise
        finally:
            bar.close()
        return [outputs[i] for i in ids]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, lora_request=None,
             chat_template: str | None = None, add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list
        of them, each rendered by the tokenizer's chat template (or `chat_template`); tools (JSON
        schemas of functions) and chat_template_kwargs go to the template (e.g. {"enable_thinking":
        False} for Qwen3), whose keys override the arguments of the same name, as vLLM's. A
        content may also be a list of OpenAI-style text parts ({"type": "text", "text": ...}),
        joined with newlines for the template ("auto" or "string" chat_template_content_format,
        vLLM's) or passed as they are ("openai"); an assistant message with tool_calls may have no
        content. lora_request: as generate's, one per conversation.
        ValueError when the model has no tokenizer or no chat template, messages is not a
        conversation or a list of them, a message is not a dict with "role" and "content" (some
        templates would drop it without a word), or a content part is not text (no multimodal
        input here)."""
        if self.tokenizer is None:
            raise ValueError("chat needs the model's tokenizer, and it has none")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', "
                             f"got {chat_template_content_format!r}")
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"messages must be a conversation (a list of {{\"role\", \"content\"}} dicts) or a "
                             f"list of them, got {type(messages).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        join = chat_template_content_format != "openai"
        conversations = [[_text_message(message, i, j, join) for j, message in enumerate(conversation)]
                         for i, conversation in enumerate(conversations)]
        kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, tools=tools) | (chat_template_kwargs or {})
        try:
            prompts = [self.tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
                       for conversation in conversations]
        except ValueError as e:  # transformers: no chat template
            raise ValueError(f"cannot apply the chat template: {e}") from None
        # the template already holds the special tokens (e.g. BOS); encode must not add them again
        prompts = [{"prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False), "prompt": p}
                   for p in prompts]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (e.g. between benchmark runs); False while requests hold blocks."""
        with self._lock:
            return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list:
        """vLLM's LLM.get_metrics(): metric records with .name, .labels and .value (Counter, Gauge) or
        .values (Vector), counted since the engine started. With speculative decoding:
        vllm:spec_decode_num_drafts (verify runs), vllm:spec_decode_num_draft_tokens,
        vllm:spec_decode_num_accepted_tokens, vllm:spec_decode_num_accepted_tokens_per_pos (a
        Vector: runs whose i-th draft was accepted) and nanovllm:spec_decode_proposal_seconds (host
        time proposing); mean acceptance length = 1 + accepted tokens / drafts."""
        with self._lock:
            return self.engine.get_metrics()

    # vLLM's LLM methods for what nanovllm does not do: each raises NotImplementedError saying so

    def beam_search(self, *args, **kwargs):
        raise NotImplementedError("beam search (LLM.beam_search) is not supported; sample n completions with "
                                  "SamplingParams(n=..., logprobs=0) and rank them by cumulative_logprob")

    def encode(self, *args, **kwargs):
        raise _pooling_unsupported("encode")

    def embed(self, *args, **kwargs):
        raise _pooling_unsupported("embed")

    def classify(self, *args, **kwargs):
        raise _pooling_unsupported("classify")

    def score(self, *args, **kwargs):
        raise _pooling_unsupported("score")

    def reward(self, *args, **kwargs):
        raise _pooling_unsupported("reward")

    def sleep(self, *args, **kwargs):
        raise NotImplementedError("LLM.sleep and wake_up are not supported: delete the LLM to free its GPU "
                                  "memory, and create another when needed")

    def wake_up(self, *args, **kwargs):
        self.sleep()

    def collective_rpc(self, *args, **kwargs):
        raise NotImplementedError("LLM.collective_rpc and apply_model are not supported; with one GPU the model "
                                  "runs in this process: llm.llm_engine.model_runner.model")

    def apply_model(self, *args, **kwargs):
        self.collective_rpc()

    def start_profile(self, *args, **kwargs):
        raise NotImplementedError("LLM.start_profile and stop_profile are not supported: run generate under "
                                  "torch.profiler.profile (the engine runs in this process with one GPU), or "
                                  "bench.py --profile DIR")

    def stop_profile(self, *args, **kwargs):
        self.start_profile()


def _pooling_unsupported(method: str) -> NotImplementedError:
    return NotImplementedError(f"LLM.{method} runs a pooling model (embeddings, classification, scores, rewards), "
                               f"which nanovllm does not support: it generates text (LLM.generate, LLM.chat)")


def _text_message(message, i: int, j: int, join: bool) -> dict:
    """Message j of conversation i, its content as one string if it came as a list of text parts
    and join; content None for a message of tool_calls without one (as OpenAI allows)."""
    if isinstance(message, dict) and "content" not in message and "tool_calls" in message:
        message = {**message, "content": None}
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise ValueError(f"conversation {i}, message {j}: a message is a dict with \"role\" and \"content\", "
                         f"got {message!r}")
    content = message["content"]
    if not isinstance(content, list):
        return message
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"conversation {i}, message {j}: content parts must be text, "
                             f"{{\"type\": \"text\", \"text\": str}} (no multimodal input), got {part!r}")
    return {**message, "content": "\n".join(part["text"] for part in content)} if join else message
