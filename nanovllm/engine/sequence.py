from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


PLACEHOLDER = -1  # a sampled token whose value is still on the GPU


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens (prompt then completion), its KV blocks and its progress.

    num_computed_tokens counts the tokens whose K/V are in the cache; the tokens after it are
    what the next step must run (a prompt chunk, or the one token sampled last).
    """
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks of block_table registered in the prefix cache
        self.sampling_params = sampling_params
        self.finish_reason: str | None = None
        self.pending_row: int | None = None  # row of the PLACEHOLDER last token in the last step's sampled tokens
        self.generator = None  # torch.Generator of a request with a seed, made by the ModelRunner

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

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)
