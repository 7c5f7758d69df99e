"""EAGLE-3 draft heads (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"), in the published checkpoint format that vLLM and SGLang
load (architectures LlamaForCausalLMEagle3, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, or the
speculators format's Eagle3Speculator, loader/source.py): fc, one decoder layer `midlayer`
(`layers.0` in the speculators format), norm, lm_head over the draft's own vocabulary and d2t,
the target id of each draft id less that id.

A step of the head takes, per token, the token embedding and a hidden state, both [T, hidden_size]:
    e = input_layernorm(embed(x)); h' = hidden_norm(h)
    a = o_proj(attention(qkv_proj([e | h'])))          (qkv_proj reads 2 x hidden_size)
    out, residual = mlp(post_attention_layernorm(a + h)), a + h   (h' for h: norm_before_residual)
    prenorm = out + residual; logits = lm_head(norm(prenorm))
The hidden state h of a token the target computed is fc of the target's hidden states at three
layers' inputs, concatenated ([T, 3 x target hidden_size]); of a token the head drafted, the
prenorm of the head's own step before it. The embedding is the target's (EAGLE-3 heads are trained
with it frozen): the proposer copies it in (engine/spec_decode/eagle3.py)."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.state import TensorParallel
from nanovllm.layers.attention import AttentionBackend, AttentionMetadata
from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import QKVParallelLinear, ReplicatedLinear
from nanovllm.layers.linear_method import LinearMethod
from nanovllm.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderMLP


class DraftVocabHead(ParallelLMHead):
    """lm_head over the draft's vocabulary (draft_vocab_size rows), its logits written into the
    target's vocabulary ([N, vocab_size], -inf at tokens the head never proposes), so that the
    sampler draws target ids. d2t [draft_vocab_size] int64 (checkpoint): draft id d is target id
    d + d2t[d]."""

    def __init__(self, draft_vocab_size: int, vocab_size: int, hidden_size: int, tp: TensorParallel,
                 d2t: nn.Parameter):
        super().__init__(draft_vocab_size, hidden_size, tp)
        self.vocab_size = vocab_size
        self.d2t = d2t  # the model's (the checkpoint names it at the top level)

    @property
    def logits_width(self) -> int:
        return self.vocab_size

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(x)
        out = x.new_empty(x.size(0), self.vocab_size) if out is None else out
        out.fill_(float("-inf"))
        targets = self.d2t + torch.arange(self.d2t.size(0), device=x.device)
        return out.index_copy_(1, targets, logits)


class Eagle3Layer(nn.Module):
    """The head's decoder layer: Llama attention over [input_layernorm(embeds) | hidden_norm(hidden)]
    (no q/k norm), then the SwiGLU MLP, with `hidden` as the residual, or hidden_norm(hidden) where
    the config says norm_before_residual (as vLLM reads it; the speculators format's default)."""

    def __init__(self, config, tp: TensorParallel, backend: AttentionBackend | None, quant_method: LinearMethod | None):
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = attn = DecoderAttention(config, 0, bias, False, tp, backend, quant_method)
        attn.qkv_proj = QKVParallelLinear(2 * config.hidden_size, attn.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, tp, bias=bias, quant_method=quant_method)
        self.mlp = DecoderMLP(config, tp, quant_method)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata):
        """(mlp output, its residual: attention output + the residual above), each [T, hidden_size]."""
        attn, normed = self.self_attn, self.hidden_norm(hidden)
        qkv = attn.qkv_proj(torch.cat([self.input_layernorm(embeds), normed], -1))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], -1)
        residual = normed if self.norm_before_residual else hidden
        return self.mlp(attn.o_proj(attn.attn(q, k, v, meta)), residual, self.post_attention_layernorm)


class Eagle3LlamaForCausalLM(nn.Module):
    """An EAGLE-3 head as the draft model runner's model (one rank). forward(input_ids [T], meta)
    reads each token's hidden state from hidden_input(T) (a static buffer: allocate()), which the
    proposer fills before a step (fc of the target's, combine()), and leaves each token's prenorm
    there for the next step; it returns norm(prenorm) [T, hidden_size], which lm_head turns into
    logits over the target's vocabulary."""
    packed_modules_mapping = DecoderForCausalLM.packed_modules_mapping
    checkpoint_renames = {"layers.0.": "midlayer."}  # the speculators format's name
    tie_word_embeddings = False

    def __init__(self, config, tp: TensorParallel = TensorParallel(), backend: AttentionBackend | None = None,
                 quant_method: LinearMethod | None = None):
        super().__init__()
        if tp.size > 1:
            raise ValueError("an EAGLE-3 head runs on one rank")
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        self.fc = ReplicatedLinear(3 * target_hidden, hidden, tp, quant_method=quant_method)
        self.midlayer = Eagle3Layer(config, tp, backend, quant_method)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        if draft_vocab == config.vocab_size:
            self.lm_head = ParallelLMHead(draft_vocab, hidden, tp)
        else:
            self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.int64), requires_grad=False)
            self.lm_head = DraftVocabHead(draft_vocab, config.vocab_size, hidden, tp, self.d2t)
        # the target's embedding (Eagle3Proposer.bind copies it in); a buffer, as no checkpoint fills it
        self.register_buffer("embed_weight", torch.zeros(config.vocab_size, hidden), persistent=False)
        self.hidden_in: torch.Tensor | None = None

    def allocate(self, max_tokens: int) -> None:
        """The static hidden-state input [max_tokens, hidden_size], before the first forward: CUDA
        graphs capture it, and the proposer writes into it (the model runner calls this)."""
        self.hidden_in = self.embed_weight.new_zeros(max_tokens, self.embed_weight.size(1))

    def hidden_input(self, num_tokens: int) -> torch.Tensor:
        """The first num_tokens rows of the static hidden-state input."""
        return self.hidden_in[:num_tokens]

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """fc: the target's three hidden states [T, 3 x target hidden_size] -> [T, hidden_size]."""
        return self.fc(target_hidden)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.hidden_input(input_ids.size(0))
        x, residual = self.midlayer(F.embedding(input_ids, self.embed_weight), hidden, meta)
        x, prenorm = self.norm(x, residual)
        hidden.copy_(prenorm)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
