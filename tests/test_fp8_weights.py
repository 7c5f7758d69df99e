"""FP8 weights (quantization="fp8") on CPU: the float8 linear math against float64 references
and e4m3's error bound, the loader of block-quantized checkpoints in Qwen's format (written here,
tiny), and the whole engine against transformers' model given the same quantized weights and
activations; on CUDA, the compiled norm and gate that quantize their output. Their accuracy on
real weights is in test_real_weights.py; the GPU GEMM in test_gpu_engine.py."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.fp8 import FP8_MAX, dequantize_blocks, fp8_linear, quantize_fp8
from tests.conftest import random_prompts

E4M3 = torch.float8_e4m3fn
REL, SUB = 2.0**-4, 2.0**-10  # e4m3 rounding: half an ulp of 3 mantissa bits; half the subnormal step 2^-9


def _bound(x: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """Largest |x W^T - deq(q(x)) deq(q(W))^T| from rounding each factor to e4m3: an element v with
    scale s moves by at most REL |v| + SUB s (OCP FP8 spec's e4m3: 3 mantissa bits, subnormal step
    2^-9 of the scale)."""
    ex = REL * x.abs() + SUB * sx[:, None]
    ew = REL * w.abs() + SUB * sw[:, None]
    return ex @ w.abs().t() + (x.abs() + ex) @ ew.t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_against_float64(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 48, generator=g) * torch.logspace(-3, 1, 48)).to(dtype)  # channels of varied range
    w = torch.randn(40, 48, generator=g, dtype=torch.float64) * 0.1
    bias = torch.randn(40, generator=g).to(dtype)
    qw, sw = quantize_fp8(w)
    assert qw.dtype == E4M3 and sw.shape == (40,) and (qw.float().abs().amax(1) == FP8_MAX).all()
    y = fp8_linear(x, qw, sw, bias)
    assert y.dtype == dtype and y.shape == (7, 40)
    # the same quantized operands, multiplied in float64
    qx, sx = quantize_fp8(x)
    same = (qx.double() * sx.double()[:, None]) @ (qw.double() * sw.double()[:, None]).t() + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    assert torch.allclose(y.double(), same, rtol=tol, atol=tol * same.abs().max().item())
    # and the unquantized product within e4m3's bound (plus the output's own rounding)
    exact = x.double() @ w.t() + bias.double()
    bound = _bound(x.double(), sx.double(), w, sw.double()) + tol * exact.abs() + 1e-6
    assert ((y.double() - exact).abs() <= bound).all()
    # a leading batch dim and zero rows pass through
    x3 = torch.cat([x, torch.zeros(1, 48, dtype=dtype)]).view(2, 4, 48)
    y3 = fp8_linear(x3, qw, sw)
    assert y3.shape == (2, 4, 40) and (y3[1, 3] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_kernel_writes_quantize_fp8s_bytes(dtype):
    """The one-kernel activation quantizer of CUDA's fp8_linear (Triton's interpreter without
    CUDA): the very values and scales of quantize_fp8 (a zero may lose its sign: -0 and 0 multiply
    alike), on awkward widths, a zero row, values that land on e4m3's subnormals and its largest
    values, and a strided input."""
    pytest.importorskip("triton")
    from nanovllm.kernels.fp8_gemm import quantize_rows
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(2)
    for n in (3, 100, 1000, 4097):
        x = torch.randn(5, n, generator=g) * torch.logspace(-4, 4, n)
        x[1] = 0
        x[2, : n // 2] = 1e-6  # ~2^-9 of the row's scale and below: e4m3 subnormals and zeros
        x = x.to(dtype).to(device)
        out, scale = quantize_rows(x)
        ref, ref_scale = quantize_fp8(x)
        assert torch.equal(out.float(), ref.float()) and torch.equal(scale, ref_scale), n
    wide = torch.randn(4, 2 * 100, generator=g).to(dtype).to(device)[:, ::2]  # a row stride of 200, step 2
    out, scale = quantize_rows(wide)
    assert torch.equal(out.float(), quantize_fp8(wide)[0].float())


def test_fp8_weight_gemm_kernel():
    """The small-batch FP8 GEMM (activations in the model dtype, float8 weights widened in
    registers; Triton's interpreter without CUDA, in float16 there: the interpreter multiplies
    bfloat16 as integers) against x times the dequantized weights in float64, to the float16
    output's rounding, on awkward sizes: partial tiles in M, N and K, and rows of x 2k apart."""
    pytest.importorskip("triton")
    from nanovllm.kernels.fp8_gemm import fp8_weight_gemm
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    for m, n, k in ((1, 48, 80), (5, 100, 272), (37, 33, 130)):
        x = (torch.randn(m, 2 * k, generator=g) * torch.logspace(-2, 1, 2 * k)).half().to(device)[:, :k]
        qw, sw = quantize_fp8(torch.randn(n, k, generator=g) * 0.1)
        ref = x.double() @ (qw.double() * sw.double()[:, None]).t().to(device)
        y = fp8_weight_gemm(x, qw.to(device), sw.to(device), (32, 64, 4, 2))
        assert y.dtype == torch.float16 and y.shape == (m, n)
        assert torch.allclose(y.double(), ref, rtol=2**-10, atol=2**-10 * ref.abs().max().item()), (m, n, k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled on CUDA only (eager elsewhere)")
def test_compiled_norm_and_gate_quantize_as_eager():
    """rms_norm_fp8 and swiglu_fp8, each one compiled kernel on CUDA, against their eager math
    (the norm or gate in bf16, then quantize_fp8): the residual sum exact; each dequantized value
    within one e4m3 step of the eager one (the compiled norm may round its bf16 output an ulp
    apart, which can move a value across a rounding boundary or the row's scale by 2^-7)."""
    from nanovllm.kernels.activation import swiglu
    from nanovllm.kernels.fp8 import rms_norm_fp8, swiglu_fp8
    from nanovllm.kernels.rms_norm import rms_norm
    g = torch.Generator().manual_seed(5)
    for rows, k in ((17, 1000), (300, 4096)):
        x, res = (torch.randn(rows, k, generator=g).cuda().bfloat16() for _ in range(2))
        w = torch.randn(k, generator=g).cuda().bfloat16()
        gate_up = torch.randn(rows, 2 * k, generator=g).cuda().bfloat16()
        for residual in (None, res):
            (q, s), r = rms_norm_fp8(x, residual, w, 1e-6)
            y, r_eager = rms_norm(x, residual, w, 1e-6)
            assert torch.equal(r, r_eager)
            _assert_one_step_apart(q, s, *quantize_fp8(y))
        _assert_one_step_apart(*swiglu_fp8(gate_up), *quantize_fp8(swiglu(gate_up)))


def _assert_one_step_apart(q, s, q_ref, s_ref):
    """Both quantize values y, y_ref a bf16 ulp (<= 2^-7 |y|) apart: each dequantized value is within
    REL |y| + SUB s of its y, so they are within (2 REL + 2^-7) |y| + 2 SUB s of each other, and
    |y| <= (|v_ref| + SUB s) / (1 - REL)."""
    assert q.dtype == E4M3 and ((s - s_ref).abs() <= 2.0**-7 * s_ref).all()
    v, v_ref, sub = q.float() * s[:, None], q_ref.float() * s_ref[:, None], SUB * s_ref[:, None]
    assert ((v - v_ref).abs() <= (2 * REL + 2.0**-7) * (v_ref.abs() + sub) / (1 - REL) + 2.01 * sub).all()


def test_dequantize_blocks_awkward_shapes():
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(40, 50, generator=g) * 100).to(E4M3)
    scale_inv = torch.rand(3, 4, generator=g) + 0.1  # blocks of 16 x 16, the last ones partial
    out = dequantize_blocks(weight, scale_inv, (16, 16))
    expected = torch.empty(40, 50)
    for i in range(40):
        for j in range(50):
            expected[i, j] = weight[i, j].float() * scale_inv[i // 16, j // 16]
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"in blocks of 16 x 16 needs scales of shape \(3, 4\), got \(3, 7\)"):
        dequantize_blocks(weight, torch.ones(3, 7), (16, 16))


BLOCK = 16
PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen's FP8 checkpoint format, in BLOCK x BLOCK blocks: (float8 weight, weight_scale_inv)."""
    rows, cols = -(-w.size(0) // BLOCK), -(-w.size(1) // BLOCK)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=E4M3)
    for i in range(rows):
        for j in range(cols):
            block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            scale[i, j] = block.abs().max().clamp_min(1e-12) / FP8_MAX
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / scale[i, j]).to(E4M3)
    return q, scale


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_qwen3, tmp_path_factory):
    """The tiny Qwen3 with its linear weights in Qwen's FP8 format (16 x 16 blocks here, 128 x 128
    in Qwen3-*-FP8), and the weights that format stands for (dequantized, float32)."""
    path, hf_model = tiny_qwen3
    out = tmp_path_factory.mktemp("qwen3_fp8")
    tensors, dequantized = {}, {}
    for name, tensor in load_file(os.path.join(path, "model.safetensors")).items():
        if name.rsplit(".", 2)[-2] in PROJS:
            q, scale = _block_quantize(tensor)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_blocks(q, scale, (BLOCK, BLOCK))
        else:
            tensors[name] = tensor
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return str(out), dequantized


def _fake_quantized_reference(hf_model, weights: dict):
    """transformers' model computing what quantization="fp8" computes: each linear layer's weight
    quantized per output channel and its input per token (quantize then dequantize, float32)."""
    import copy
    model = copy.deepcopy(hf_model)
    state = model.state_dict()
    for name in state:
        if name.rsplit(".", 2)[-2] in PROJS:
            q, s = quantize_fp8(weights.get(name, state[name]))
            state[name] = q.float() * s[:, None]
    model.load_state_dict(state)

    def quantize_input(module, args):
        q, s = quantize_fp8(args[0])
        return (q.float() * s[..., None],)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJS:
            module.register_forward_pre_hook(quantize_input)
    return model


def _prompt_logprobs(llm, prompt) -> torch.Tensor:
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])


def _reference_logprobs(model, prompt) -> torch.Tensor:
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.mark.parametrize("source", ["fp8 checkpoint", "on the fly"])
def test_fp8_engine_matches_transformers_with_the_same_quantization(tiny_qwen3, fp8_checkpoint, source):
    """The engine with float8 weights against transformers' float32 model whose linear layers see
    the same quantized weights and inputs: prompt logprobs equal to float32 error (measured 2e-6;
    the tolerance also allows a rounding that flips between the two from float32 differences
    upstream, which moves one element by an e4m3 step), and each greedy token the reference's
    argmax. A pre-quantized checkpoint selects quantization="fp8" by itself."""
    path, hf_model = tiny_qwen3
    if source == "fp8 checkpoint":
        llm, weights = LLM(fp8_checkpoint[0], device="cpu"), fp8_checkpoint[1]
    else:
        llm, weights = LLM(path, device="cpu", quantization="fp8"), {}
    assert llm.config.quantization == "fp8"
    qkv = llm.engine.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == E4M3 and qkv.weight_scale.shape == (qkv.weight.size(0),)
    reference = _fake_quantized_reference(hf_model, weights)
    prompt = random_prompts([37], seed=3)[0]
    got, want = _prompt_logprobs(llm, prompt), _reference_logprobs(reference, prompt)
    assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].token_ids
    with torch.no_grad():  # each greedy token is the reference's argmax after the tokens before it
        logits = reference(torch.tensor([prompt + greedy])).logits[0, len(prompt) - 1:-1]
    assert (logits.amax(-1) - logits.gather(1, torch.tensor(greedy)[:, None])[:, 0]).max() < 1e-4


def test_fp8_loading_errors(tiny_qwen3, fp8_checkpoint, tmp_path):
    path, _ = tiny_qwen3
    with pytest.raises(ValueError, match=r"quantization must be one of \[None, 'fp8'\], got 'int4'"):
        LLM(path, device="cpu", quantization="int4")
    # a float8 weight without its scale
    tensors = load_file(os.path.join(fp8_checkpoint[0], "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    with open(os.path.join(fp8_checkpoint[0], "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight' is float8 but has no"):
        LLM(str(tmp_path), device="cpu")
    # another quantization method
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="quantized with 'awq'"):
        LLM(str(tmp_path), device="cpu")
