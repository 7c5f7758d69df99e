from enum import Enum, auto
from itertools import count

from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import SamplingParams


PLACEHOLDER = -1  # a sampled token whose value is still on the GPU


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One completion's state: its tokens (prompt then completion), its KV blocks and its progress.

    Who writes what: the Scheduler status, finish_reason, num_cached_tokens and
    num_computed_tokens (the tokens whose K/V are in the cache or computed by a launched step;
    the tokens after it are what the next step must run); the BlockManager block_table and
    num_hashed_blocks; the LLMEngine token_ids and the output state (stop_reason, logprobs,
    detokenizer); its Processor bad_words_ids and grammar. index: which of its request's n
    completions this is; lora_request: the adapter it runs with (None: the base model).
    """
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, request_id: str | None = None,
                 index: int = 0, lora_request: LoRARequest | None = None):
        self.seq_id = next(Sequence._ids)
        self.request_id = str(self.seq_id) if request_id is None else request_id
        self.index = index
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks of block_table registered in the prefix cache
        self.sampling_params = sampling_params
        self.lora_request = lora_request
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = None  # an IncrementalDetokenizer when text is needed token by token
        self.bad_words_ids: list[list[int]] = []  # token sequences of sampling_params.bad_words
        self.grammar = None  # the GrammarState of sampling_params.structured_outputs (sampling/structured)
        self.num_forks = 0  # completions still to fork from this one once its prompt is computed (n > 1)
        self.logprobs: list | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.num_reported_tokens = self.num_reported_chars = 0  # completion already sent as DELTA outputs
        self.noise_seed: int | None = None  # the engine's seed for a completion without one (speculative drafts)

    @property
    def seed(self) -> int | None:
        """The seed of this completion's noise: the request's seed + index (as vLLM's parallel sampling);
        without one, noise_seed where the engine set it."""
        seed = self.sampling_params.seed
        return self.noise_seed if seed is None else seed + self.index

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_known_tokens(self) -> int:
        """The tokens whose values are on the host: all but the trailing PLACEHOLDERs (sampled by
        launched steps, not read back yet; a verify run's: one per position)."""
        end = len(self.token_ids)
        while end > self.num_prompt_tokens and self.token_ids[end - 1] == PLACEHOLDER:
            end -= 1
        return end

