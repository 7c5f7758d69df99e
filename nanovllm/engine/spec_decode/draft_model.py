"""Draft-model proposals: a smaller model of the same vocabulary guesses the next k tokens."""
from dataclasses import replace

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.spec_decode.proposer import Proposer
from nanovllm.engine_args import DTYPES, EngineArgs
from nanovllm.models.registry import model_class
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import PLACEHOLDER, Sequence

GREEDY = SamplingParams(temperature=0.0)
DRAFT_POOL_TOKENS = 32768  # the most tokens of the draft's KV pool (3.8 GB for Qwen3-0.6B in bf16)


def draft_config(config: Config, head: bool = False) -> Config:
    """The draft model's engine configuration: the target's dtype, device, attention backend, block
    size and step budget, one rank, and a KV pool of its own for the sequences that speculate:
    min(max_num_seqs, disable_by_batch_size) of max_model_len, DRAFT_POOL_TOKENS at most (and one
    max_model_len sequence at least). head: an EAGLE-3 head, which takes the target's max_model_len
    whatever its config's max_position_embeddings (its rotary table is then made that long, as
    vLLM does). ValueError when the model is not of the kind asked for (a model, or a head), its
    vocabulary is not the target's, or a draft model has fewer positions than max_model_len."""
    spec, block_size = config.speculative_config, config.kvcache_block_size
    most = min(config.max_num_seqs, spec.disable_by_batch_size or config.max_num_seqs)
    tokens = max(min(most * config.max_model_len, DRAFT_POOL_TOKENS), config.max_model_len)
    dtype = next(name for name, d in DTYPES.items() if d == config.dtype)
    try:
        draft = Config.create(EngineArgs(
            spec.model, max_num_seqs=most, max_num_batched_tokens=config.max_num_batched_tokens,
            kvcache_block_size=block_size, num_kvcache_blocks=-(-tokens // block_size), enable_prefix_caching=False,
            enforce_eager=config.enforce_eager, dtype=dtype, device=config.device.type,
            load_format="dummy" if config.load_format == "dummy" else "auto", attention_backend=config.attention_backend,
            seed=config.seed, trust_remote_code=config.trust_remote_code), with_tokenizer=False)
    except (FileNotFoundError, ValueError) as e:  # say which of the two models it is about
        raise type(e)(f"speculative_config model {spec.model!r}: {e}") from None
    hf = draft.hf_config
    model_class(hf, draft_head=head)
    if hf.vocab_size != config.hf_config.vocab_size:
        raise ValueError(f"speculative_config model {spec.model!r} has a vocabulary of {hf.vocab_size} "
                         f"tokens, the target {config.hf_config.vocab_size}: a draft model must share the target's")
    if head:
        hf.max_position_embeddings = max(hf.max_position_embeddings, config.max_model_len)
    elif config.max_model_len > hf.max_position_embeddings:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the draft model's max_position_embeddings="
                         f"{hf.max_position_embeddings} (speculative_config model {spec.model!r}); lower max_model_len")
    return replace(draft, eos_token_ids=config.eos_token_ids, max_model_len=config.max_model_len)


class DraftModelProposer(Proposer):
    """vLLM's "draft_model" method: speculative_config {"model": draft, "num_speculative_tokens": k}.
    The draft model runs in a ModelRunner of its own (its weights, paged KV pool and CUDA graphs;
    built before the target's, so that the target's KV cache is sized from what is left; one rank,
    rank 0's device, also beside a tensor-parallel target, whose ranks then size their KV caches
    by rank 0's room). Each
    sequence that speculates has a shadow sequence there: its tokens, with the draft's KV of
    those that are still the sequence's (after a verify step the rejected drafts' KV is truncated).
    A proposal is k steps of the draft: the first runs the tokens it has not computed yet (the
    whole prompt the first time, else the last verify step's accepted tokens) and draws the next
    token, each next one runs that token, on the device (the runner's pending tokens), without
    waiting for the host.

    Greedy completions' drafts are the draft's argmax. A sampled completion's are drawn with the
    target's own noise at their positions: both models sample by Gumbel-max, and a seeded row's
    noise is a hash of (the completion's seed, the completion index it samples; sampler.py), so
    the shadow takes the completion's seed, temperature and filters (an unseeded completion has a
    seed of the engine's for this: Sequence.noise_seed). The target's token at a position is
    then its own draw whatever the drafts, and accepting a draft where it equals that token keeps
    the target's distribution exactly (seed for seed, the tokens of the plain engine), while a
    draft close to the target draws the same token under the same noise far more often than its
    argmax is drawn at temperature > 0 (coupling by shared noise, rather than Leviathan et al.'s
    rejection of drafts drawn with noise of their own: no probabilities to keep or compare).
    A sequence whose catch-up does not fit the step budget, or whose KV does not fit the pool,
    gets no drafts this time."""

    def __init__(self, config: Config, draft: Config | None = None, draft_head: bool = False):
        """draft, draft_head: a subclass's draft configuration and model kind (ModelRunner's)."""
        self.k = config.speculative_config.num_speculative_tokens
        self.config = draft or draft_config(config)
        self.runner = ModelRunner(self.config, draft_head=draft_head, chain_steps=self.k - 1)
        self.block_manager = BlockManager(self.runner.num_kvcache_blocks, self.config.kvcache_block_size, False)
        self.shadows: dict[int, Sequence] = {}  # seq_id -> its shadow

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        shadows, self.shadows = self.shadows, {}
        for seq_id in shadows.keys() - {seq.seq_id for seq in seqs}:  # no longer decoding: its KV goes
            self.block_manager.free(shadows[seq_id])
        budget, scheduled, owners, sampling = self.config.max_num_batched_tokens, [], [], []  # sampling: (seq, shadow)
        for seq in seqs:
            shadow = self._follow(shadows.get(seq.seq_id), seq)
            n = min(len(shadow) - shadow.num_computed_tokens, budget)
            whole = n == len(shadow) - shadow.num_computed_tokens
            if n <= 0 or not self.block_manager.allocate_slots(shadow, n + (self.k - 1 if whole else 0)):
                self.block_manager.free(shadow)
                continue
            self.shadows[seq.seq_id] = shadow
            shadow.num_computed_tokens += n
            scheduled.append((shadow, n))
            owners.append(seq)
            budget -= n + (self.k - 1 if whole else 0)
            if whole:
                sampling.append((seq, shadow))
        if not scheduled:
            return [[] for _ in seqs]
        launched = [self._catch_up(scheduled, owners, sampling)]
        tokens = []  # per draft step, each sampling shadow's token
        if sampling and self.k > 1 and all(shadow.sampling_params.temperature == 0 for _, shadow in sampling):
            # greedy: the k - 1 steps in one launch (a CUDA graph of the chain), planned once
            for _, shadow in sampling:
                shadow.token_ids.append(PLACEHOLDER)
                shadow.num_computed_tokens += 1
            chain = self.runner.run_chain([(shadow, 1) for _, shadow in sampling], self.k - 1)
            tokens = [self.runner.read_tokens(launched[0])] + chain
            for _, shadow in sampling:
                shadow.token_ids += [PLACEHOLDER] * (self.k - 2)
                shadow.num_computed_tokens += self.k - 2
        for _ in range(self.k - 1 if sampling and not tokens else 0):  # sampled: each next draft from the last
            if len(launched) > 1:  # the runner keeps two steps' tokens unread at most: read the older first
                tokens.append(self.runner.read_tokens(launched[-2]))
            for _, shadow in sampling:
                shadow.token_ids.append(PLACEHOLDER)
                shadow.num_computed_tokens += 1
            launched.append(self.runner.run([(shadow, 1) for _, shadow in sampling]))
        tokens += [self.runner.read_tokens(step) for step in launched[len(tokens):] if step is not None]
        drafts = {}
        for i, (seq, shadow) in enumerate(sampling):
            drafts[seq.seq_id] = run = [step_tokens[i] for step_tokens in tokens]
            shadow.token_ids[len(shadow) - len(run) + 1:] = run[:-1]  # its computed drafts (the last is not)
        return [drafts.get(seq.seq_id, []) for seq in seqs]

    def _catch_up(self, scheduled: list[tuple[Sequence, int]], owners: list[Sequence], sampling: list[tuple]):
        """Launch a proposal's first draft step: the scheduled (shadow, new tokens) of owners' (the
        target's sequences), the shadows of `sampling` drawing the first draft."""
        return self.runner.run(scheduled)

    def _follow(self, shadow: Sequence | None, seq: Sequence) -> Sequence:
        """seq's shadow, made to hold seq's tokens: the draft's KV kept for the longest common prefix
        of what it computed and seq's tokens (a new shadow computes them all)."""
        if shadow is None:
            shadow = Sequence(seq.token_ids, draft_params(seq))
            shadow.num_prompt_tokens = seq.num_prompt_tokens  # its rows sample seq's completion indices
            return shadow
        computed = shadow.num_computed_tokens
        common = next((i for i, (a, b) in enumerate(zip(shadow.token_ids[:computed], seq.token_ids)) if a != b),
                      min(computed, len(seq)))
        self.block_manager.truncate(shadow, min(common, len(seq) - 1))
        shadow.token_ids = list(seq.token_ids)
        return shadow

    def finished(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)


def draft_params(seq: Sequence) -> SamplingParams:
    """How seq's shadow draws its drafts: greedy for a greedy completion, else with seq's
    temperature, filters and seed (its noise), the processors left out (a completion with some
    gets no drafts: EngineCore.draft_room)."""
    sp = seq.sampling_params
    if sp.temperature == 0 or seq.seed is None:
        return GREEDY
    return SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, seed=seq.seed)
