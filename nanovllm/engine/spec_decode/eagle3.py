"""EAGLE-3 proposals: a one-layer head (models/eagle3.py) drafts from the target's own hidden states."""
import numpy as np
import torch

from nanovllm.config import Config
from nanovllm.engine.spec_decode.draft_model import DraftModelProposer, draft_config, draft_params
from nanovllm.sequence import Sequence

NUM_AUX_LAYERS = 3  # EAGLE-3 reads the target's hidden states at three layers


def aux_layers(draft_hf, target_hf) -> tuple[int, ...]:
    """The target layers whose inputs the head reads: the checkpoint's eagle_aux_hidden_state_layer_ids
    (top level, or in its eagle_config), else vLLM's default (2, L // 2, L - 3) for L target layers.
    ValueError unless they are three layers of the target."""
    ids = getattr(draft_hf, "eagle_aux_hidden_state_layer_ids", None) \
        or (getattr(draft_hf, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    num_layers = target_hf.num_hidden_layers
    ids = tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(ids) != NUM_AUX_LAYERS or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
        raise ValueError(f"an EAGLE-3 head reads {NUM_AUX_LAYERS} target layers' inputs, ids in [0, {num_layers}); "
                         f"got eagle_aux_hidden_state_layer_ids {list(ids)} (a target of {num_layers} layers)")
    return ids


class Eagle3Proposer(DraftModelProposer):
    """vLLM's "eagle3" method: speculative_config {"method": "eagle3", "model": head, "num_speculative_tokens": k}.

    The head runs as DraftModelProposer's draft model does (its own runner, paged KV pool and CUDA
    graphs; a shadow sequence per speculating sequence; a proposal is a catch-up step and k - 1
    one-token steps on the device), with two differences (Li et al. 2025, vLLM's EagleProposer):
    - A shadow is its sequence shifted by one: shadow position p holds token p + 1 and the
      target's hidden states at position p (the three aux_layers' inputs, which the target's
      steps keep per KV slot: kv_cache.hidden), so its step at p drafts token p + 2. The catch-up
      step runs every position the target has computed since the last proposal, each with fc of
      the target's hidden states read at the target's slots; a drafted position takes the prenorm
      of the head's step before it instead.
    - Drafted positions are therefore computed again by the next catch-up (their KV and hidden
      states were the head's own), even where the target accepted their tokens.
    The head's embedding is the target's, copied in once the target is built (bind). Sampled
    completions draw drafts with the target's noise, as DraftModelProposer says."""

    def __init__(self, config: Config):
        draft = draft_config(config, head=True)
        target_hidden = getattr(draft.hf_config, "target_hidden_size", None) or draft.hf_config.hidden_size
        if target_hidden != config.hf_config.hidden_size:
            raise ValueError(f"speculative_config model {config.speculative_config.model!r} is an EAGLE-3 head for a "
                             f"target of hidden_size {target_hidden}; this target's is {config.hf_config.hidden_size}")
        self.aux_layers = aux_layers(draft.hf_config, config.hf_config)
        super().__init__(config, draft, draft_head=True)
        self.target_hidden: torch.Tensor | None = None  # the target's kv_cache.hidden (bind)
        self.verified: dict[int, int] = {}  # seq_id -> its shadow's positions from the target's states (the last catch-up's)

    def bind(self, runner) -> None:
        model = self.runner.model
        model.embed_weight.copy_(runner.model.model.embed_tokens.weight)
        self.target_hidden = runner.kv_cache.hidden

    def _follow(self, shadow: Sequence | None, seq: Sequence) -> Sequence:
        tokens = seq.token_ids[1:]
        if shadow is None:
            shadow = Sequence(tokens, draft_params(seq))
            shadow.num_prompt_tokens = seq.num_prompt_tokens - 1  # its rows sample seq's completion indices
            return shadow
        self.block_manager.truncate(shadow, min(self.verified.get(seq.seq_id, 0), len(tokens) - 1))
        shadow.token_ids = tokens
        return shadow

    def _catch_up(self, scheduled, owners, sampling):
        bs, model = self.config.kvcache_block_size, self.runner.model
        slots, self.verified = [], {}
        for (shadow, n), seq in zip(scheduled, owners):
            positions = np.arange(shadow.num_computed_tokens - n, shadow.num_computed_tokens)
            slots.append(np.asarray(seq.block_table)[positions // bs] * bs + positions % bs)
            self.verified[seq.seq_id] = shadow.num_computed_tokens
        # each drafting shadow's last row, whose prenorm feeds its next step (drafting order): sent
        # with the slots, before the launch, since a copy after it would wait for the whole step
        drafting = {id(shadow) for _, shadow in sampling}
        ends = np.cumsum([n for _, n in scheduled]) - 1
        rows = ends[[id(shadow) in drafting for shadow, _ in scheduled]]
        index = torch.from_numpy(np.concatenate([*slots, rows])).to(self.target_hidden.device)
        index, rows = index.split([index.numel() - len(rows), len(rows)])
        model.hidden_input(len(index)).copy_(model.combine(self.target_hidden[index]))
        launched = self.runner.run(scheduled)
        if len(rows):
            model.hidden_input(len(rows)).copy_(model.hidden_in[rows])
        return launched
