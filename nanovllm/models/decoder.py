"""The decoder shared by Qwen3, Qwen2 and Llama: pre-norm blocks of GQA attention with rotary
embeddings and a SwiGLU MLP. Qwen3 normalises q and k per head (q_norm/k_norm), Qwen2 has a
bias on q/k/v, Llama has neither; the three classes at the end only set those flags.

Every module takes `tp` (this rank's TensorParallel), the attention backend and the linear
layers' quant_method (layers/linear_method.py) when it is built; forward takes the step's
AttentionMetadata explicitly. A layer calls its attention and MLP blocks through one interface,
block(x, residual, norm, ...) -> (out, residual), each fusing the pre-norm into its first product:
another MLP (experts, say) is another block with that interface."""
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.layers.attention import Attention, AttentionBackend, AttentionMetadata
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, norm_linear
from nanovllm.layers.linear_method import LinearMethod
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.distributed.process_group import DOWN_PROJ_SLOT, O_PROJ_SLOT
from nanovllm.distributed.state import TensorParallel


class DecoderAttention(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool, tp: TensorParallel,
                 backend: AttentionBackend | None, quant_method: LinearMethod | None = None):
        super().__init__()
        hidden = config.hidden_size
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, tp, bias=qkv_bias,
                                          quant_method=quant_method)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, tp, slot=O_PROJ_SLOT,
                                        quant_method=quant_method)
        norms = None
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            norms = (self.q_norm, self.k_norm)
        rotary_emb = RotaryEmbedding(config, self.head_dim, config.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, layer_idx, rotary_emb, norms, backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_proj(attention(qkv_proj(norm(r)))), r) for r = x + residual (x alone when None)."""
        qkv, residual = norm_linear(x, residual, norm, self.qkv_proj)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        return self.o_proj(self.attn(q, k, v, meta)), residual


class DecoderMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate) * up) with [gate | up] = gate_up_proj(x)."""

    def __init__(self, config, tp: TensorParallel, quant_method: LinearMethod | None = None):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], tp, quant_method=quant_method)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp, slot=DOWN_PROJ_SLOT, gated=True,
                                           quant_method=quant_method)  # silu(gate) * up first

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(down_proj(swiglu(gate_up_proj(norm(r)))), r) for r = x + residual."""
        gate_up, residual = norm_linear(x, residual, norm, self.gate_up_proj)
        return self.down_proj(gate_up), residual


class DecoderLayer(nn.Module):
    """Attention, then `mlp` (a DecoderMLP, or another block with its interface: experts)."""

    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool, tp: TensorParallel,
                 backend: AttentionBackend | None, quant_method: LinearMethod | None, mlp: nn.Module):
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_idx, qkv_bias, qk_norm, tp, backend, quant_method)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, meta: AttentionMetadata):
        """Pre-norm: each norm (with the residual add) goes with the product after it (norm_linear)."""
        x, residual = self.self_attn(x, residual, self.input_layernorm, meta)
        return self.mlp(x, residual, self.post_attention_layernorm)


class DecoderModel(nn.Module):
    """make_mlp(layer_idx) builds each layer's MLP block. aux_layers (set by the model runner for an
    EAGLE-3 draft): layers whose input, the residual stream x + residual ([T, hidden_size]; layer
    0's: the embeddings), each step writes to aux_store [slots + 1, len(aux_layers) * hidden_size]
    at its tokens' KV slots, concatenated in that order (vLLM's eagle_aux_hidden_state_layer_ids
    count the same way: id j is the input of layer j). Slot -1 (graph padding) writes the last row."""
    aux_layers: tuple[int, ...] = ()
    aux_store: torch.Tensor | None = None

    def __init__(self, config, qkv_bias: bool, qk_norm: bool, tp: TensorParallel, backend: AttentionBackend | None,
                 quant_method: LinearMethod | None, make_mlp: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, qkv_bias, qk_norm, tp, backend, quant_method, make_mlp(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.group = tp.group

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, meta)
        if aux:  # slot -1 -> the last row: a plain index, so that CUDA graphs capture it
            rows = meta.slot_mapping.remainder(self.aux_store.size(0))
            self.aux_store[rows] = torch.cat([aux[i] for i in self.aux_layers], -1)
        # with tensor parallelism x is each rank's partial sums, summed with the norm
        x, _ = self.group.all_reduce_rms_norm(x, residual, self.norm) if self.group else self.norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    """forward(input_ids [T] int64, meta) -> hidden [T, hidden_size];
    compute_logits(hidden [N, hidden_size]) -> [N, vocab_size] in the model dtype (rank 0; None on others).
    backend may be None for a model that never runs (built on the meta device to count parameters);
    quant_method: every linear layer's (None: unquantized)."""
    qkv_bias = False
    qk_norm = False
    # checkpoint name fragment -> (packed parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, tp: TensorParallel = TensorParallel(), backend: AttentionBackend | None = None,
                 quant_method: LinearMethod | None = None):
        super().__init__()
        self.model = DecoderModel(config, self.qkv_bias, self.qk_norm, tp, backend, quant_method,
                                  lambda i: self.make_mlp(config, i, tp, quant_method))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config, layer_idx: int, tp: TensorParallel, quant_method: LinearMethod | None) -> nn.Module:
        """Layer layer_idx's MLP block, called as block(x, residual, norm) -> (out, residual) with
        the pre-norm fused in and, with tensor parallelism, partial sums out: SwiGLU here; a
        mixture-of-experts model returns its sparse block where its config says (models/moe.py)."""
        return DecoderMLP(config, tp, quant_method)

    @classmethod
    def split_sizes(cls, hf_config, expert_parallel: bool = False) -> dict[str, int]:
        """The config's sizes that tensor parallelism splits besides the attention heads: the MLP's
        (expert_parallel: a mixture of experts' count rather than each expert's size, models/moe.py)."""
        return {"intermediate_size": hf_config.intermediate_size}

    @classmethod
    def check_config(cls, hf_config, tp_size: int, expert_parallel: bool = False):
        """Raise ValueError, before anything is built, for a config this class cannot serve, or
        unless the model splits evenly over tp_size ranks: query heads and every size of
        split_sizes divisible by it, and KV heads either divisible by it or dividing it (then each
        KV head is replicated on tp_size / num_key_value_heads ranks)."""
        if tp_size == 1:
            return
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        sizes = {"num_attention_heads": heads, **cls.split_sizes(hf_config, expert_parallel)}
        if any(size % tp_size for size in sizes.values()) or (kv_heads % tp_size and tp_size % kv_heads):
            raise ValueError(f"tensor_parallel_size={tp_size} does not split this model: it needs to divide "
                             + " and ".join(f"{name}={size}" for name, size in sizes.items())
                             + f", and to divide or be a multiple of num_key_value_heads={kv_heads}")

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.gather(self.lm_head(hidden))


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: RMSNorm of q and k per head before the rotation."""
    qk_norm = True


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5: bias on the q, k, v projections."""
    qkv_bias = True


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2/3 (and SmolLM): no q/k norm, no bias; rope scaling comes from the config."""
