"""SamplingParams: how each request is completed; fields, defaults and meanings are vLLM's."""
import copy
import dataclasses
import json
import logging
import math
import typing
from dataclasses import dataclass, field
from enum import Enum
from numbers import Integral, Real


logger = logging.getLogger(__name__)

# vLLM's: logits divided by a smaller temperature overflow float32 (inf, then NaN probabilities)
MIN_TEMPERATURE = 0.01


class RequestOutputKind(Enum):
    """What LLMEngine.step reports of an unfinished request (vLLM's names): CUMULATIVE, everything
    so far; DELTA, only the new tokens and text; FINAL_ONLY, nothing until it finishes."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """A constraint on the completion (vLLM's StructuredOutputsParams), exactly one of:
    json: a JSON schema (dict, or its JSON text) the completion must satisfy; regex: a regular
    expression it must match in full; choice: strings it must be one of; grammar: a context-free
    grammar in Lark syntax, or GBNF (llama.cpp's EBNF, rules written `name ::= ...`); json_object:
    True for any JSON object.
    Options: disable_any_whitespace: JSON without whitespace between its tokens (else any
    whitespace is allowed there); disable_additional_properties: every object of the schema that
    does not say otherwise gets additionalProperties false; whitespace_pattern: a regular
    expression for the whitespace JSON may hold (backend "guidance" only).
    ValueError (naming the field) when none or several constraints are set or one has the wrong
    type; whether the schema, regex or grammar itself is valid is checked by the engine, which
    compiles it, before the request runs."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        self.validate()

    @property
    def kind(self) -> str:
        """The constraint's field name: "json", "regex", "choice", "grammar" or "json_object"."""
        return self._kinds()[0]

    def _kinds(self) -> list[str]:
        return [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None] + \
            (["json_object"] if self.json_object else [])

    def validate(self):
        """Raise ValueError naming the field that is wrong and what it allows."""
        kinds = self._kinds()
        if len(kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar or json_object, "
                             f"got {kinds or 'none'}")
        if self.json is not None:
            try:
                schema = self.schema()
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (a dict, or its JSON text), "
                                 f"got {self.json!r}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be True or False, got {getattr(self, name)!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be True, False or None, got {self.json_object!r}")

    def cache_key(self) -> tuple:
        """What makes two constraints the same grammar (a schema's key order aside)."""
        kind = self.kind
        spec = getattr(self, kind)
        if kind == "json":
            spec = json.dumps(self.schema(), sort_keys=True)
        elif kind == "choice":
            spec = tuple(spec)
        return kind, spec, self.disable_any_whitespace, self.disable_additional_properties, self.whitespace_pattern

    def schema(self) -> dict | bool:
        """The JSON schema of json (parsed when given as text), or {"type": "object"} for json_object."""
        if self.json_object:
            return {"type": "object"}
        return json.loads(self.json) if isinstance(self.json, str) else self.json


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name (with SamplingParams' guided_decoding)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop (vLLM's `SamplingParams`).

    n: independent completions of the prompt (the prompt is prefilled once).
    temperature: 0 is greedy (argmax); otherwise logits are divided by it (at least 0.01: a smaller
    one is raised to it, with a warning, as vLLM does).
    top_k: keep the k most likely tokens (0, -1, or the vocabulary's size or more: all). top_p: keep
    the smallest set whose probability reaches top_p, in (0, 1]. min_p: drop tokens below min_p
    times the top one's, in [0, 1].
    presence_penalty, frequency_penalty: in [-2, 2], subtracted from the logit of every token the
    completion holds, once / per occurrence (OpenAI's definition).
    repetition_penalty: > 0; logits of tokens in the prompt or completion are divided by it when
    positive and multiplied when negative (Keskar et al. 2019, CTRL; as transformers).
    seed: the same seed, prompt and parameters give the same completion, whatever the batch.
    stop: strings that end the completion (cut from the text unless include_stop_str_in_output).
    stop_token_ids: token ids that end it (kept in token_ids; their text, like EOS's, is left out of
    text unless include_stop_str_in_output). ignore_eos: go on past EOS.
    max_tokens: most completion tokens (None: up to max_model_len). min_tokens: EOS and
    stop_token_ids are masked (and stop strings ignored) until this many were generated.
    logprobs: return the log-probabilities of the sampled token and this many top tokens per step
    (-1: the whole vocabulary). prompt_logprobs: likewise for each prompt token. flat_logprobs:
    return them as a FlatLogprobs sequence whose {token id: Logprob} dicts are made when read
    (cheaper when few are read), not as a list of dicts. detokenize: produce text.
    skip_special_tokens, spaces_between_special_tokens: how text is decoded (as transformers' decode).
    logit_bias: {token id: bias added to its logit}. allowed_token_ids: only these may be sampled.
    bad_words: words never generated (each token sequence of the word, with and without a leading
    space, is blocked at its last token).
    truncate_prompt_tokens: keep only the prompt's last k tokens (-1: the last max_model_len).
    output_kind: what LLMEngine.step reports of unfinished requests (LLM.generate sets FINAL_ONLY).
    extra_args: arguments for custom logits processors (nanovllm/sampling/processors), which read
    them in their applies() and prepare(); no built-in one does.
    structured_outputs: a StructuredOutputsParams constraint (JSON schema, regex, choice,
    grammar): only tokens it allows are sampled, and the completion ends (finish_reason "stop")
    when it is complete. guided_decoding: vLLM's older name for it (moved to structured_outputs).
    best_of (beyond n), use_beam_search: vLLM's, not supported here (NotImplementedError, with
    what to use instead).
    """
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None
    # vLLM's, for what nanovllm does not do: validate() raises NotImplementedError when one is used
    best_of: int | None = field(default=None, repr=False, compare=False)
    use_beam_search: bool = field(default=False, repr=False, compare=False)
    # derived by validate(): `stop` as a tuple and what a stream holds back of the text, whether a
    # penalty applies, and whether anything but temperature and the filters may shape the logits
    # (penalties, logit_bias, banned or allowed tokens, min_tokens, extra_args for a custom
    # processor, structured_outputs): the logits processors look only at those; and whether
    # speculative drafts may be verified (none of the processors whose state follows one sampled
    # row per sequence: structured outputs may)
    stop_strings: tuple[str, ...] = field(init=False, repr=False, compare=False, default=())
    output_text_buffer_length: int = field(init=False, repr=False, compare=False, default=0)
    has_penalties: bool = field(init=False, repr=False, compare=False, default=False)
    needs_processing: bool = field(init=False, repr=False, compare=False, default=False)
    takes_drafts: bool = field(init=False, repr=False, compare=False, default=True)

    def __post_init__(self):
        self.validate()

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """SamplingParams from arguments that may be None where the field takes none (vLLM's
        SamplingParams.from_optional, as an OpenAI request's absent fields arrive): such a None
        gives the field's default (n=None -> 1, temperature=None -> 1.0); a None where the field
        means something by it is kept (max_tokens=None: up to max_model_len). logit_bias's keys
        become ints and its biases are clamped to [-100, 100] (OpenAI's range). TypeError for a
        name that is not a field; then validate()'s errors."""
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise TypeError(f"SamplingParams has no field(s) {unknown}")
        kwargs = {name: value for name, value in kwargs.items()
                  if value is not None or type(None) in typing.get_args(fields[name].type)}
        if kwargs.get("logit_bias") is not None:
            kwargs["logit_bias"] = {int(t): min(100.0, max(-100.0, b)) for t, b in kwargs["logit_bias"].items()}
        return cls(**kwargs)

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's SamplingParams.clone), to change fields of without touching this one."""
        return copy.deepcopy(self)

    def validate(self):
        """Raise ValueError naming the first field that is wrong and what it allows, NotImplementedError
        for a vLLM feature nanovllm lacks (best_of > n, use_beam_search). Checks that need the model
        (token ids inside its vocabulary; whether a schema, regex or grammar compiles) are the
        engine's (Processor)."""
        self._unsupported()
        _int(self, "n", 1)
        _real(self, "presence_penalty", -2, 2)
        _real(self, "frequency_penalty", -2, 2)
        _real(self, "repetition_penalty", 0, math.inf, low_open=True)
        _real(self, "temperature", 0, math.inf)
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, which overflows the logits; using %s (as vLLM)",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        _real(self, "top_p", 0, 1, low_open=True)
        _real(self, "min_p", 0, 1)
        _int(self, "top_k", -1)
        if self.seed is not None:
            _int(self, "seed", -2**63, 2**64 - 1)
        if self.max_tokens is not None:
            _int(self, "max_tokens", 1)
        if self.max_tokens is not None and isinstance(self.min_tokens, Integral) and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        _int(self, "min_tokens", 0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, Integral) or isinstance(value, bool) or value < -1):
                raise ValueError(f"{name} must be None, -1 (the whole vocabulary) or an integer >= 0, got {value!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, Integral) or isinstance(k, bool) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 (max_model_len) or an integer >= 1, got {k!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "flat_logprobs", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are found in the text)")
        self.stop_strings = tuple(stop)
        # vLLM's: the characters a stream holds back, where a stop string may yet complete and be cut
        self.output_text_buffer_length = max(map(len, stop)) - 1 if stop and not self.include_stop_str_in_output else 0
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and (not isinstance(ids, (list, tuple, set)) or not all(_is_id(t) for t in ids)):
                raise ValueError(f"{name} must be a list of non-negative integer token ids, got {ids!r}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (nothing could be sampled)")
        if self.logit_bias is not None and (not isinstance(self.logit_bias, dict) or not all(
                _is_id(t) and _finite(b) for t, b in self.logit_bias.items())):
            raise ValueError(f"logit_bias must map token ids to finite numbers, got {self.logit_bias!r}")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple))
                                           or not all(isinstance(w, str) and w for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r}")
        if self.guided_decoding is not None:  # vLLM's older name, as vLLM moves it
            if self.structured_outputs is not None and self.structured_outputs is not self.guided_decoding:
                raise ValueError("set structured_outputs or its older name guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams (e.g. "
                                 f"StructuredOutputsParams(json=schema)), got {type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()
        self.has_penalties = bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)
        # processors whose state follows one sampled row per sequence; a grammar checks drafts itself
        one_row = bool(self.has_penalties or self.logit_bias or self.bad_words or self.allowed_token_ids is not None
                       or self.min_tokens or self.extra_args is not None)
        self.needs_processing = one_row or self.structured_outputs is not None
        self.takes_drafts = not one_row

    def _unsupported(self):
        if isinstance(self.best_of, Integral) and isinstance(self.n, Integral) and self.best_of < self.n:
            raise ValueError(f"best_of must be at least n, got n={self.n} and best_of={self.best_of}")
        if self.best_of is not None and self.best_of != self.n:
            raise NotImplementedError(f"best_of={self.best_of} is not supported: ask for n={self.best_of} completions with logprobs=0 and keep the one of "
                                      f"highest cumulative_logprob")
        if self.use_beam_search:
            raise NotImplementedError("beam search (use_beam_search) is not supported; sample n completions with "
                                      "logprobs=0 and rank them by cumulative_logprob")


def _is_id(t) -> bool:
    return isinstance(t, Integral) and not isinstance(t, bool) and t >= 0


def _finite(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _int(params, name: str, low: int, high: int | None = None):
    value = getattr(params, name)
    if not isinstance(value, Integral) or isinstance(value, bool) or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")


def _real(params, name: str, low: float, high: float, low_open: bool = False):
    value = getattr(params, name)
    if not (isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
            and (value > low if low_open else value >= low) and value <= high):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high == math.inf else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
