"""Requests in and out: validating and tokenizing prompts into a Request (its Sequences), and
a Request's state into the RequestOutput that step() reports."""
import random
from dataclasses import dataclass, field, replace
from numbers import Integral

from nanovllm.config import Config
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.loader.lora import check_adapter, lora_targets
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling.structured.compiler import Grammar, GrammarCompiler
from nanovllm.sampling.structured.state import GrammarState
from nanovllm.sequence import PLACEHOLDER, Sequence
from nanovllm.outputs import CompletionOutput, FlatLogprobs, RequestOutput, position_logprobs
from nanovllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class Request:
    """One request: its prompt and its n completions (seqs, by index; the first holds the prompt
    until the others are forked from it)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list | None = None  # [None, then (step arrays, row) per prompt token] when asked
    lora_request: LoRARequest | None = None
    grammar: Grammar | None = None  # params.structured_outputs, compiled (or compiling)

    @property
    def finished(self) -> bool:
        """Every completion ended and its last token read back."""
        return len(self.seqs) == self.params.n and all(seq.is_finished and seq.token_ids[-1] != PLACEHOLDER
                                                       for seq in self.seqs)


class Processor:
    """config: the engine's resolved Config (tokenizer, vocabulary size, max_model_len)."""

    def __init__(self, config: Config):
        self.tokenizer = config.tokenizer
        self._token_texts: dict[int, str] = {}
        self.vocab_size, self.eos_token_ids = config.hf_config.vocab_size, config.eos_token_ids
        self.max_model_len, self.max_logprobs = config.max_model_len, config.max_logprobs
        self.enable_lora, self.max_lora_rank = config.enable_lora, config.max_lora_rank
        self.hf_config = config.hf_config
        self._loras: dict[int, str] = {}  # lora_int_id -> lora_path of every adapter checked so far
        self._lora_targets = None
        self.grammars = GrammarCompiler((config.structured_outputs_config or {}).get("backend"), config.tokenizer,
                                        self.vocab_size, config.eos_token_ids)
        spec = config.speculative_config
        # a draft model draws its drafts with the noise of the completion's seed (spec_decode/draft_model.py)
        self._noise_seeds = random.Random(config.seed) if spec is not None and spec.method == "draft_model" else None

    def normalize(self, prompts, sampling_params) -> list[tuple[object, SamplingParams]]:
        """A generate call's prompts paired with their SamplingParams (one for all, or one per
        prompt; None is the defaults). ValueError when the two do not pair up."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or (prompts and all(isinstance(p, Integral) for p in prompts)):
            flat = isinstance(prompts, (list, tuple))  # one prompt's token ids, not wrapped
            raise ValueError("prompts must be a string, a {\"prompt_token_ids\": [...]} dict, or a list of "
                             "strings, token-id lists or such dicts" +
                             (f"; for one prompt of token ids pass [[{', '.join(map(str, prompts[:3]))}"
                              f"{', ...' if len(prompts) > 3 else ''}]]" if flat else ""))
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                            f"got {type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; "
                             f"pass one, or one per prompt")
        return list(zip(prompts, sampling_params))

    def make_request(self, request_id: str, prompt, params: SamplingParams,
                     lora_request: LoRARequest | None = None, priority: int = 0,
                     arrival_time: float | None = None) -> Request:
        """Validate one request. prompt: a string, a list of token ids, or a dict with
        "prompt_token_ids" (and optionally its "prompt" text) or "prompt"; lora_request: its
        adapter, or None; priority: vLLM's, 0 only (requests are served first come, first served);
        arrival_time: a number or None (EngineBase.add_request says why it is not used). Raises
        ValueError. A structured_outputs constraint is validated here (GrammarCompiler; it
        compiles on a thread pool once the scheduler first considers the request)."""
        if arrival_time is not None and not isinstance(arrival_time, (int, float)):
            raise ValueError(f"arrival_time must be a time in seconds (time.time()) or None, got "
                             f"{type(arrival_time).__name__}; an adapter goes in as lora_request=")
        if priority:
            raise ValueError(f"got priority {priority}, but requests are scheduled first come, first served "
                             f"(there is no priority scheduling); only 0")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        self._check_limits(params)
        if -1 in (params.logprobs, params.prompt_logprobs):  # vLLM's "the whole vocabulary", for this model
            params = replace(params, **{name: self.vocab_size for name in ("logprobs", "prompt_logprobs")
                                     if getattr(params, name) == -1})
        if lora_request is not None:
            self.check_lora(lora_request)
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                raise ValueError(f"a prompt dict needs \"prompt\" (text) or \"prompt_token_ids\", got keys "
                                 f"{sorted(prompt)}")
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown:  # vLLM's other keys (multimodal data, cache_salt, ...): refused, not ignored
                multimodal = any(k.startswith(("multi_modal", "mm_")) for k in unknown)
                why = ("multimodal input is not supported (text-only models)" if multimodal
                       else "a prompt dict takes only \"prompt\" and \"prompt_token_ids\"")
                raise ValueError(f"prompt dict key(s) {unknown}: {why}")
            prompt = prompt.get("prompt_token_ids", text)
        ids = self._token_ids(prompt, params.truncate_prompt_tokens)
        if self.tokenizer is None and (params.stop_strings or params.bad_words):
            raise ValueError("stop strings and bad_words need the model's tokenizer, and it has none")
        grammar = self.grammars.get(params.structured_outputs) if params.structured_outputs is not None else None
        request = Request(request_id, text, ids, params, prompt_logprobs=[None] if params.prompt_logprobs is not None
                          else None, lora_request=lora_request, grammar=grammar)
        request.seqs.append(self.new_sequence(request, 0))
        request.seqs[0].num_forks = params.n - 1
        return request

    def new_sequence(self, request: Request, index: int) -> Sequence:
        """Completion `index` of `request`, with its detokenizer when text is needed token by token
        (stop strings, or outputs before the end), its own grammar matcher (structured outputs), and
        with a draft model, a seed of the engine's when the request has none (Sequence.noise_seed)."""
        seq = Sequence(request.prompt_token_ids, request.params, request.request_id, index, request.lora_request)
        if self._noise_seeds is not None and request.params.seed is None:
            seq.noise_seed = self._noise_seeds.getrandbits(31)
        if request.grammar is not None:
            seq.grammar = GrammarState(request.grammar)
        params = request.params
        for word in params.bad_words or ():  # as vLLM: the word alone and after a space
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in seq.bad_words_ids:
                    seq.bad_words_ids.append(ids)
        if self.tokenizer is not None and params.detokenize and (
                params.stop_strings or params.output_kind != RequestOutputKind.FINAL_ONLY):
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                     params.skip_special_tokens, params.spaces_between_special_tokens)
        return seq

    def _check_limits(self, params: SamplingParams):
        """What only the engine knows: logprobs within max_logprobs, token ids inside the vocabulary,
        allowed_token_ids that min_tokens does not mask every one of (it masks EOS ids)."""
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            k = self.vocab_size if asked == -1 else asked
            if k is not None and self.max_logprobs != -1 and k > self.max_logprobs:
                whole = f" (the whole vocabulary, {k})" if asked == -1 else ""
                raise ValueError(f"{name}={asked}{whole} is more than max_logprobs={self.max_logprobs}; "
                                 f"raise the engine argument max_logprobs (-1: no limit)")
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name}={k} is more than the vocabulary's {self.vocab_size} tokens")
        if params.min_tokens and params.allowed_token_ids is not None and set(params.allowed_token_ids) <= \
                set(params.stop_token_ids or ()) | (set() if params.ignore_eos else self.eos_token_ids):
            raise ValueError(f"min_tokens={params.min_tokens} masks every one of allowed_token_ids "
                             f"{sorted(params.allowed_token_ids)} (end-of-sequence or stop_token_ids) until then: "
                             f"nothing could be sampled")
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(params, name) or () if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def check_lora(self, lora_request: LoRARequest):
        """A request's adapter, or add_lora's: a LoRARequest, on an engine with enable_lora, whose
        files fit the model (loader/lora.py check_adapter, once per lora_int_id), one path per
        lora_int_id (for good: the prefix cache keeps its blocks by the id). ValueError otherwise."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if not self.enable_lora:
            raise ValueError("a lora_request needs an engine with LoRA enabled: LLM(model, enable_lora=True, "
                             "max_loras=..., max_lora_rank=...)")
        path = self._loras.get(lora_request.lora_int_id)
        if path is None:
            if self._lora_targets is None:
                self._lora_targets = lora_targets(self.hf_config)
            check_adapter(lora_request, self._lora_targets, self.max_lora_rank)
            self._loras[lora_request.lora_int_id] = lora_request.lora_path
        elif path != lora_request.lora_path:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} names the adapter at {path}, not "
                             f"{lora_request.lora_path}: each adapter needs its own lora_int_id")

    def _token_ids(self, prompt, truncate: int | None = None) -> list[int]:
        """The prompt's token ids, the last `truncate` of them when set (-1: max_model_len)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token-id lists")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            if set(map(type, prompt)) <= {int}:  # the common case, checked at C speed (bool is not int here)
                ids = list(prompt)
            else:
                wrong = next((i for i, t in enumerate(prompt) if not isinstance(t, Integral) or isinstance(t, bool)),
                             None)
                if wrong is not None:
                    raise ValueError(f"prompt token {wrong} is {prompt[wrong]!r}, not an integer token id")
                ids = [int(t) for t in prompt]
            if ids and not (min(ids) >= 0 and max(ids) < self.vocab_size):
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        else:
            raise ValueError(f"a prompt must be a string or a list of ints, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        if truncate is not None:
            ids = ids[-(self.max_model_len if truncate == -1 else truncate):]
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        return ids

    def output(self, request: Request) -> RequestOutput | None:
        """What step() reports of `request` now, by its output_kind: None for an unfinished
        FINAL_ONLY request or a DELTA one with nothing new."""
        kind = request.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not request.finished:
            return None
        completions = [self._completion(seq, kind == RequestOutputKind.DELTA) for seq in request.seqs]
        if kind == RequestOutputKind.DELTA and not any(c.token_ids or c.finish_reason for c in completions):
            return None
        prompt_lp = request.prompt_logprobs
        if prompt_lp is not None:
            prompt_lp = self._logprobs(prompt_lp, 0, len(prompt_lp), request.params.prompt_logprobs, request.params)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, prompt_lp,
                             completions, request.finished, request.seqs[0].num_cached_tokens, request.lora_request)

    def _completion(self, seq: Sequence, delta: bool) -> CompletionOutput:
        end = seq.num_known_tokens
        known = seq.token_ids[seq.num_prompt_tokens:end]
        params, start = seq.sampling_params, seq.num_reported_tokens if delta else 0
        done = seq.is_finished and end == len(seq.token_ids)  # ended, and its last token read back
        if seq.detokenizer is not None:
            text = seq.detokenizer.text
            if not done and params.output_text_buffer_length:  # a stop string may yet complete there and go
                text = text[:max(len(text) - params.output_text_buffer_length, seq.num_reported_chars)]
        elif params.detokenize and self.tokenizer is not None:
            # ended by EOS or a stop id (not by a stop string, nor after its grammar's last token)
            by_token = seq.finish_reason == "stop" and (isinstance(seq.stop_reason, int) or (
                seq.stop_reason is None and bool(known) and known[-1] in self.eos_token_ids))
            text = self.tokenizer.decode(known[:-1] if by_token and not params.include_stop_str_in_output else known,
                                         skip_special_tokens=params.skip_special_tokens,
                                         spaces_between_special_tokens=params.spaces_between_special_tokens)
            # a character max_tokens cut short is left out, as the incremental detokenizer leaves it
            text = text.rstrip("\ufffd")
        else:
            text = ""
        if delta:
            text = text[seq.num_reported_chars:]
            seq.num_reported_chars += len(text)
            seq.num_reported_tokens = len(known)
        logprobs = None if seq.logprobs is None else self._logprobs(seq.logprobs, start, len(known), params.logprobs,
                                                                    params)
        return CompletionOutput(seq.index, text, known[start:], seq.cumulative_logprob if logprobs is not None else None,
                                logprobs, seq.finish_reason if done else None, seq.stop_reason if done else None)

    def _logprobs(self, positions: list, start: int, end: int, k: int, params: SamplingParams) -> list | FlatLogprobs:
        """positions[start:end] as vLLM's logprobs, a new list of {token id: Logprob} (the token and
        top k; None for a prompt's first position), or with params.flat_logprobs a FlatLogprobs
        that makes each dict when read. positions holds per position the step's host arrays and
        row, (arrays, row); a dict made here replaces them there, so each is made once however
        often the request is reported (a CUMULATIVE stream reports every step)."""
        decode = self._token_text if params.detokenize and self.tokenizer is not None else _no_text
        if params.flat_logprobs:
            return FlatLogprobs(positions[start:end], k, decode)
        for i in range(start, end):
            if type(positions[i]) is tuple:
                positions[i] = position_logprobs(positions[i], k, decode)
        return positions[start:end]

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)  # one entry per token id ever read (at most the vocabulary)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _no_text(token_id: int) -> None:
    return None
