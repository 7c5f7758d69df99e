"""The GPU kernels, in Triton and Gluon, as functions over tensors: paged attention (attention.py's
tiles, prefill_attention.py, decode_attention.py, and gluon_prefill.py's persistent Hopper kernel),
the fused q/k norm + rotary embedding + KV store (qk_norm_rope.py), the one-row GEMV and few-row
GEMM with the RMSNorm and SwiGLU gate fused in (gemv.py, skinny_gemm.py), float8 (fp8.py,
fp8_gemm.py), mixture-of-experts routing and experts (moe_routing.py, fused_moe.py), sampling
and logprob reductions (sampling.py, logits_stats.py), penalties (penalty.py), a grammar's token
bitmask (token_bitmask.py), LoRA's shrink and expand for steps of mixed adapters (lora.py), a CUDA
graph's inputs (graph_inputs.py), the two-GPU all-reduce + RMSNorm (all_reduce_norm.py), and
programmatic dependent launch (pdl.py). The torch.compile'd norms and activation (rms_norm.py,
activation.py, compile.py) live here too. Nothing here imports the rest of nanovllm; each kernel is
checked against a float32 torch reference in tests/.
"""
