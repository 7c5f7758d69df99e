"""Structured outputs on a tiny random Qwen3 with a tiny byte-level BPE tokenizer (300 tokens for
the model's 320 logits, so the padding columns are masked too): the token bitmask kernel against
numpy; constrained greedy completions equal the argmax of transformers' logits under the
library's own mask, step by step, in a batch with free rows that equal transformers' greedy
ones; the grammars' stop tokens are the engine's EOS ids; sampled completions validate and repeat
with their seed; n > 1, preemption, max_tokens, stop strings and the grammar's end; rollback;
speculative drafts verified under the grammar (right ones all accepted, refused ones none),
beside free speculating sequences; bad input;
the scheduler's rule for compiling grammars, beside LoRA's; tensor and data parallelism. On CUDA (skipped
here): the kernel at Qwen3's size, and the engine with CUDA graphs and truly overlapped steps."""
import gc
import importlib.util
import json
import re
import shutil
from collections import deque

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.sampling_params import GuidedDecodingParams
from tests.conftest import hf_greedy

jsonschema = pytest.importorskip("jsonschema")
BACKENDS = [name for name, package in (("guidance", "llguidance"), ("xgrammar", "xgrammar"))
            if importlib.util.find_spec(package)]
TOKENIZER_SIZE, EOS = 300, 299
CORPUS = ['{"name": "Alice", "age": 30, "tags": ["a", "b"]}', '{"city": "Paris", "zip": "75001", "ok": true}',
          "The quick brown fox jumps over the lazy dog. 0123456789", "[1, 2, 3], null, false, -4.5e3",
          "yes no maybe red green blue", '{"id": 12, "items": [{"x": 1}, {"x": 2}]}']
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    "home": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
             "required": ["zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "home"], "additionalProperties": False}
REGEX = r"[a-c]{2}-[0-9]{1,3}"
LARK = 'start: "(" expr ")"\nexpr: NUM | NUM "+" NUM\nNUM: /[0-9]{1,2}/'
GBNF = 'root ::= "<" item ("," item)? ">"\nitem ::= [a-z] [a-z]?'


def json_params():
    return StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)


@pytest.fixture(scope="module")
def tiny(tiny_qwen3, tmp_path_factory):
    """(model folder with a tokenizer, transformers model, tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    path, hf = tiny_qwen3
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    shutil.copytree(path, folder, dirs_exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(vocab_size=TOKENIZER_SIZE - 1, special_tokens=[],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_special_tokens(["<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.save_pretrained(folder)
    assert len(tokenizer) == TOKENIZER_SIZE and tokenizer.eos_token_id == EOS
    return str(folder), hf, tokenizer


ARGS = dict(device="cpu", kvcache_block_size=16, max_model_len=160)


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request, tiny):
    return LLM(tiny[0], structured_outputs_config={"backend": request.param}, **ARGS)


def numpy_masked(x: torch.Tensor, rows, bitmask: np.ndarray) -> torch.Tensor:
    """x with rows[i] masked by bitmask[i] (bit b of word w: token 32 w + b), by numpy's unpackbits."""
    out = x.clone()
    for i, row in enumerate(rows):
        bits = np.unpackbits(bitmask[i].view(np.uint8), bitorder="little").astype(bool)
        allowed = np.zeros(x.size(1), bool)
        allowed[:min(len(bits), x.size(1))] = bits[:x.size(1)]
        out[row, torch.from_numpy(~allowed)] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_bitmask_kernel_and_torch_path(dtype):
    """The Triton kernel (its interpreter without CUDA) and the torch path mask exactly the clear
    bits of rows 3 and 0 of 4, bit 31 included, and every column past the bitmask's words (a
    1,000-token vocabulary under 30 words = 960 bits, and under 32 words covering 1,024)."""
    pytest.importorskip("triton")
    from nanovllm.kernels.token_bitmask import apply_token_bitmask_kernel
    from nanovllm.sampling.processors.grammar_bitmask import apply_token_bitmask
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 1000, generator=g) * 3).to(dtype)
    rows = torch.tensor([3, 0])
    for words in (30, 32):
        bitmask = torch.randint(-2**31, 2**31, (2, words), generator=g, dtype=torch.int64).to(torch.int32)
        bitmask[0, 0] = -2**31  # only bit 31 of the first word
        expected = numpy_masked(x, rows.tolist(), bitmask.numpy())
        assert expected[3, 31] == x[3, 31] and torch.isinf(expected[3, :31]).all()
        for apply in (apply_token_bitmask_kernel, apply_token_bitmask):
            out = x.clone().to(device)
            apply(out, rows.to(device), bitmask.to(device))
            assert torch.equal(out.cpu(), expected), (apply.__name__, words)
        assert torch.equal(expected[1:3], x[1:3]) and bool(torch.isinf(expected[0, 960:]).all()) == (words == 30)


def reference(hf, backend: str, tokenizer, prompt, params: StructuredOutputsParams, max_tokens: int):
    """Greedy tokens of transformers' float32 logits under the library's own masks, built here
    with its API directly: (token ids, whether the grammar ended them)."""
    if backend == "guidance":
        import llguidance
        import llguidance.hf
        from nanovllm.sampling.structured.guidance import GuidanceBackend
        grammar = GuidanceBackend(tokenizer, 320, [EOS]).source(params)
        matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=320, eos_token=EOS), grammar)
        fill = lambda bm: matcher.unsafe_compute_mask_ptr(bm.data_ptr(), bm.numel() * 4)  # noqa: E731
        accept = matcher.consume_token
        stopped, only_eos = matcher.is_stopped, lambda bm: False
    else:
        import xgrammar
        from nanovllm.sampling.structured.xgrammar_backend import XGrammarBackend
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=320, stop_token_ids=[EOS])
        compiled = xgrammar.GrammarCompiler(info).compile_grammar(XGrammarBackend(tokenizer, 320, [EOS]).source(params))
        matcher = xgrammar.GrammarMatcher(compiled)
        fill, accept, stopped = matcher.fill_next_token_bitmask, matcher.accept_token, matcher.is_terminated
        only_eos = lambda bm: matcher.is_completed() and set(  # noqa: E731
            np.flatnonzero(np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little"))) <= {EOS}
    ids, bitmask = list(prompt), torch.zeros(1, 10, dtype=torch.int32)
    for _ in range(max_tokens):
        if stopped():
            return ids[len(prompt):], True
        fill(bitmask)
        if only_eos(bitmask):
            return ids[len(prompt):], True
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1:].float()
        token = int(numpy_masked(logits, [0], bitmask.numpy()).argmax())
        assert accept(token)
        ids.append(token)
    return ids[len(prompt):], False


@pytest.mark.parametrize("parallel_accept", [False, True], ids=["tokens_one_by_one", "tokens_on_threads"])
def test_constrained_greedy_is_the_masked_argmax(llm, tiny, parallel_accept, monkeypatch):
    """A batch of JSON-schema, regex, choice, Lark and GBNF rows between free rows: each constrained
    row's tokens are the argmax of transformers' logits under its grammar's mask, step by step,
    ending ("stop") where the grammar is complete; free rows equal transformers' greedy ones.
    Constrained tokens stay inside the tokenizer's 300 ids, and their text satisfies the constraint.
    With llguidance, each step's tokens taken one by one and on the library's threads."""
    path, hf, tokenizer = tiny
    backend = llm.config.structured_outputs_config["backend"]
    if parallel_accept and backend != "guidance":
        pytest.skip("only llguidance takes a step's tokens on its threads")
    if backend == "guidance":
        monkeypatch.setattr(llm.engine.processor.grammars._backend(), "parallel_accept", parallel_accept)
    constraints = [json_params(), None, StructuredOutputsParams(regex=REGEX),
                   StructuredOutputsParams(choice=["red", "green", "blue"]), None,
                   StructuredOutputsParams(grammar=LARK), StructuredOutputsParams(grammar=GBNF)]
    prompts = [tokenizer.encode(p) for p in ["Alice", "The quick", "yes no", "red green", "null", "[1, 2", "a, b"]]
    params = [SamplingParams(temperature=0, max_tokens=60 if c else 12, ignore_eos=c is None, structured_outputs=c)
              for c in constraints]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, c, out in zip(prompts, constraints, outs):
        got = out.outputs[0]
        if c is None:
            assert got.token_ids == hf_greedy(hf, prompt, 12)
            continue
        expected, ended = reference(hf, backend, tokenizer, prompt, c, 60)
        assert got.token_ids == expected and ended and got.finish_reason == "stop", (c.kind, got.text)
        assert max(got.token_ids) < TOKENIZER_SIZE
        assert got.text == tokenizer.decode(got.token_ids, skip_special_tokens=True)
        if c.kind == "json":
            jsonschema.validate(json.loads(got.text), PERSON)
        elif c.kind == "regex":
            assert re.fullmatch(REGEX, got.text)
        elif c.kind == "choice":
            assert got.text in c.choice
        elif c.grammar == LARK:
            assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})?\)", got.text)
        else:
            assert re.fullmatch(r"<[a-z]{1,2}(,[a-z]{1,2})?>", got.text)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_engines_eos_ids_are_the_stop_tokens(tiny, backend):
    """Given a bare tokenizer (no EOS set, from which the libraries would guess), a complete
    grammar allows the engine's EOS ids and nothing else."""
    from transformers import PreTrainedTokenizerFast
    from nanovllm.sampling.structured.compiler import GrammarCompiler
    from nanovllm.sampling.structured.state import GrammarState
    bare = PreTrainedTokenizerFast(tokenizer_object=tiny[2].backend_tokenizer)
    assert bare.eos_token_id is None
    eos = {EOS, 7}
    grammars = GrammarCompiler(backend, bare, 320, eos)
    state, seq = GrammarState(grammars.get(StructuredOutputsParams(choice=["ab", "abc"]))), type("Seq", (), {})()
    seq.num_prompt_tokens, seq.request_id = 0, "eos"
    seq.token_ids = [bare.convert_tokens_to_ids(c) for c in "ab"]  # "ab" is complete, "abc" may follow
    assert not state.advance(seq)
    bitmask = torch.zeros(1, 10, dtype=torch.int32)
    grammars.backend.fill_bitmask([state.matcher], bitmask, [0])
    allowed = set(np.flatnonzero(np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")).tolist())
    assert eos < allowed and allowed - eos and all(bare.convert_ids_to_tokens(t).startswith("c") for t in allowed - eos)
    seq.token_ids.append(bare.convert_tokens_to_ids("c"))
    state.advance(seq)
    grammars.backend.fill_bitmask([state.matcher], bitmask, [0])
    assert set(np.flatnonzero(np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")).tolist()) == eos


def test_sampled_outputs_validate_and_repeat_with_their_seed(llm, tiny):
    """At temperature 1 with seeds: n=3 JSON completions, regex, json_object and whitespace-free
    JSON all validate; each seeded request alone gives what it gave in the batch."""
    tokenizer = tiny[2]
    sp = lambda c, **kw: SamplingParams(**{"temperature": 1.0, "seed": 7, "max_tokens": 80,  # noqa: E731
                                           "structured_outputs": c, **kw})
    params = [sp(json_params(), n=3), sp(StructuredOutputsParams(regex=REGEX)), SamplingParams(max_tokens=10),
              sp(StructuredOutputsParams(json_object=True, disable_any_whitespace=True), max_tokens=40),
              sp(StructuredOutputsParams(json={"type": "array", "items": {"type": "integer", "maximum": 999},
                                               "maxItems": 3}, disable_any_whitespace=True))]
    prompts = [tokenizer.encode(p) for p in ["Alice", "green", "dog", "{", "[1"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs[0].outputs) == 3
    for c in outs[0].outputs:
        jsonschema.validate(json.loads(c.text), PERSON)
    assert len({c.text for c in outs[0].outputs}) > 1  # one matcher per completion, each its own draw
    assert re.fullmatch(REGEX, outs[1].outputs[0].text)
    obj = outs[3].outputs[0]
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict)
    assert all(isinstance(v, int) for v in json.loads(outs[4].outputs[0].text))
    for i in (1, 4):
        alone = llm.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == outs[i].outputs[0].token_ids


def test_preemption_keeps_each_matcher(tiny):
    """Six JSON completions in a KV pool too small for them all: sequences are preempted mid-JSON
    and recomputed, each keeping its matcher (one made per completion), and every completion is
    the greedy one of a roomy engine."""
    from nanovllm.sampling.structured import compiler
    path, _, tokenizer = tiny
    prompts = [tokenizer.encode(p) for p in ["Alice", "Paris", "dog", "yes", "red", "items"]]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=json_params(), n=1)
    args = {**ARGS, "max_model_len": 128}
    roomy = LLM(path, **args).generate(prompts, params, use_tqdm=False)
    tight = LLM(path, num_kvcache_blocks=9, **args)
    made = []
    matcher = compiler.Grammar.matcher
    compiler.Grammar.matcher = lambda self: made.append(1) or matcher(self)
    try:
        outs = tight.generate(prompts, params, use_tqdm=False)
    finally:
        compiler.Grammar.matcher = matcher
    assert tight.engine.scheduler.num_preemptions > 0 and len(made) == len(prompts)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_max_tokens_stop_strings_and_the_grammars_end(llm, tiny):
    """max_tokens cuts a JSON completion ("length") to a prefix its grammar accepts; a stop string
    cuts its text; a grammar's end ends a completion ("stop") also with ignore_eos and before
    min_tokens, with its last token's text kept."""
    from nanovllm.sampling.structured.state import GrammarState
    tokenizer = tiny[2]
    choice = StructuredOutputsParams(choice=["red", "green", "blue"])
    params = [SamplingParams(temperature=0, max_tokens=5, structured_outputs=json_params()),
              SamplingParams(temperature=0, max_tokens=60, stop=['"age"'], structured_outputs=json_params()),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, structured_outputs=choice),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=20, structured_outputs=choice)]
    cut, stopped, *ends = llm.generate([tokenizer.encode("Alice")] * 4, params, use_tqdm=False)
    cut = cut.outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    grammar = llm.engine.processor.grammars.get(json_params())
    state, seq = GrammarState(grammar), type("Seq", (), {})()
    seq.token_ids, seq.num_prompt_tokens, seq.request_id = list(cut.token_ids), 0, "cut"
    assert not state.advance(seq) and state.num_accepted == 5 and not state.refused
    stopped = stopped.outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"age"' and stopped.text.startswith('{"name"')
    assert '"age"' not in stopped.text
    for end in ends:
        assert end.outputs[0].finish_reason == "stop" and end.outputs[0].text in choice.choice
        assert end.outputs[0].stop_reason is None and EOS not in end.outputs[0].token_ids


def test_rollback_takes_tokens_back(llm, tiny):
    """A completion's tokens taken back (as speculative decoding's rejected drafts will be) are
    rolled back in its matcher, which then takes other tokens."""
    from nanovllm.sampling.structured.state import GrammarState
    tokenizer = tiny[2]
    grammar = llm.engine.processor.grammars.get(StructuredOutputsParams(choice=["red", "green"]))
    grammar.wait()
    state, seq = GrammarState(grammar), type("Seq", (), {})()
    seq.num_prompt_tokens, seq.request_id = 0, "r"
    seq.token_ids = [tokenizer.convert_tokens_to_ids(c) for c in "re"]
    assert not state.advance(seq) and state.num_accepted == 2
    seq.token_ids = []
    assert not state.advance(seq) and state.num_accepted == 0
    seq.token_ids = [tokenizer.convert_tokens_to_ids(c) for c in "green"]
    state.advance(seq)
    assert state.num_accepted == 5 and not state.refused
    seq.token_ids.append(EOS)  # xgrammar ends on it; llguidance ended after "green"
    assert state.advance(seq) and not state.refused


@pytest.mark.parametrize("right", [True, False], ids=["right-drafts", "wrong-drafts"])
def test_a_constrained_sequence_verifies_drafts(llm, tiny, right):
    """Speculative decoding's seam with a grammar: a constrained completion verifies drafts, each
    draft's row masked by the grammar after the drafts before it. Its own completion's next tokens
    as drafts (each row then needs the grammar advanced through the drafts before it to sample
    them) are all accepted; drafts the grammar refuses (EOS, then tokens after it) none; either way
    the completion is the one made alone, and its matcher has taken exactly its tokens."""
    from nanovllm.sequence import SequenceStatus
    tokenizer = tiny[2]
    engine = llm.engine
    prompt = tokenizer.encode("Alice")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=json_params())
    [alone] = llm.generate([prompt], params, use_tqdm=False)
    want = list(alone.outputs[0].token_ids)
    engine.add_request("json", {"prompt_token_ids": prompt}, params)
    seq = engine.requests["json"].seqs[0]
    metrics, before = engine.spec_metrics, (engine.spec_metrics.num_draft_tokens, engine.spec_metrics.num_accepted_tokens)
    finished = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished = out if out.finished else finished
        done = seq.num_completion_tokens  # its last token may still be on the device: want[done - 1]
        if (seq.status == SequenceStatus.RUNNING and seq.num_computed_tokens == len(seq) - 1
                and seq.seq_id not in engine.scheduler.drafts and done + 5 < len(want)):
            assert engine.add_draft_tokens(seq, want[done:done + 3] if right else [EOS, 5, 6]) == 3
    drafted, accepted = metrics.num_draft_tokens - before[0], metrics.num_accepted_tokens - before[1]
    assert drafted >= 6 and accepted == (drafted if right else 0)
    assert finished.outputs[0].token_ids == want
    assert seq.grammar.num_accepted == len(want) - (want[-1] == EOS)


def test_constrained_requests_decode_beside_speculating_ones(tiny):
    """With speculative_config, a constrained request verifies n-gram drafts in the same steps as a
    free one; both completions are the ones made without speculation."""
    path, _, tokenizer = tiny
    prompts = [tokenizer.encode("Alice"), tokenizer.encode("Bob and Bob and Bob and Bob and")]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=json_params()),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    plain = LLM(path, **ARGS).generate(prompts, params, use_tqdm=False)
    spec = LLM(path, **ARGS, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    ours = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.spec_metrics.num_drafts > 0


@pytest.mark.parametrize("bad, field", [
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "structured_outputs.json"),
    (dict(json={"type": "nonsense"}), "structured_outputs.json"),
    (dict(regex="[a-"), "structured_outputs.regex"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_invalid_constraints_fail_before_any_work(llm, tiny, bad, field):
    """An invalid schema, regex or grammar in a generate call's second request: ValueError naming
    request and field, nothing queued, and the engine serves the next call."""
    tokenizer = tiny[2]
    good = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    bad_params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(**bad))
    with pytest.raises(ValueError, match=rf"request 1: {re.escape(field)}"):
        llm.generate([tokenizer.encode("a")] * 2, [good, bad_params], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert re.fullmatch("[0-9]+", llm.generate([tokenizer.encode("a")], good, use_tqdm=False)[0].outputs[0].text)


def test_a_grammar_left_no_token_by_other_constraints_aborts(llm, tiny, caplog):
    """allowed_token_ids that the grammar allows none of: what is sampled is refused, and the
    completion ends as "abort" (logged), not as a grammar's "stop"."""
    tokenizer = tiny[2]
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    params = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=digits,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with caplog.at_level("WARNING"):
        out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "abort" and "its grammar does not allow token" in caplog.text
    fine = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate(["Hello"], fine, use_tqdm=False)[0].outputs[0].text in ("yes", "no")


def test_bad_structured_outputs_arguments(tiny, tiny_qwen3):
    """Wrong types and combinations name the field; a backend option another backend lacks, a
    model without a tokenizer, and a bad engine argument are refused up front."""
    for kwargs, message in [(dict(), "exactly one of"), (dict(regex="a", choice=["b"]), "exactly one of"),
                            (dict(json="{oops"), "structured_outputs.json is not valid JSON"),
                            (dict(choice="ab"), "structured_outputs.choice must be"),
                            (dict(regex="a", disable_any_whitespace=None), "disable_any_whitespace")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       guided_decoding=StructuredOutputsParams(regex="b"))
    old = SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"))  # vLLM's older names
    assert old.structured_outputs.regex == "a" and old.guided_decoding is None and old.needs_processing
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs_config backend must be one of"):
        LLM(tiny[0], structured_outputs_config={"backend": "outlines"}, **ARGS)
    with pytest.raises(ValueError, match=r"structured_outputs_config takes only \"backend\", got \['engine'\]"):
        LLM(tiny[0], structured_outputs_config={"engine": "xgrammar"}, **ARGS)
    with pytest.raises(ValueError, match="structured_outputs_config must be a dict"):
        LLM(tiny[0], structured_outputs_config="xgrammar", **ARGS)
    no_tokenizer = LLM(tiny_qwen3[0], **ARGS)
    with pytest.raises(ValueError, match="request 0: structured_outputs needs the model's tokenizer"):
        no_tokenizer.generate([[1, 2]], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
    if "xgrammar" in BACKENDS:
        xgr = LLM(tiny[0], structured_outputs_config={"backend": "xgrammar"}, **ARGS)
        with pytest.raises(ValueError, match="whitespace_pattern needs"):
            xgr.generate([[1, 2]], SamplingParams(structured_outputs=StructuredOutputsParams(
                json_object=True, whitespace_pattern=" ?")), use_tqdm=False)


def test_scheduler_starts_a_sequence_once_its_grammar_is_compiled():
    """A waiting sequence whose grammar is compiling is passed over for the ones behind it; with
    nothing else to run, the scheduler waits for the grammar."""
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.sequence import Sequence

    class Compiling:
        ready, waits = False, 0

        def wait(self):
            Compiling.waits += 1
            self.ready = True

    scheduler = Scheduler(4, 64, BlockManager(16, 16, False))
    held, free = Sequence([1, 2, 3], SamplingParams()), Sequence([4, 5], SamplingParams())
    held.grammar = Compiling()
    scheduler.waiting = deque([held, free])
    assert [s for s, _ in scheduler.schedule()] == [free] and list(scheduler.waiting) == [held]
    scheduler.running.clear()  # as if free had finished
    assert [s for s, _ in scheduler.schedule()] == [held] and Compiling.waits == 1


def test_the_grammar_and_lora_rules_pass_over_sequences_in_order():
    """A sequence whose grammar compiles and one of an adapter without a slot both wait, in their
    order, while those behind them start."""
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm import LoRARequest
    from nanovllm.sequence import Sequence

    class Compiling:
        ready = False

    scheduler = Scheduler(8, 100, BlockManager(64, 16), max_loras=1)
    lora = {i: LoRARequest(f"a{i}", i, "/x") for i in (1, 2)}
    running, held, other, free = (Sequence([1, 2, 3], SamplingParams(), lora_request=lora.get(i)) for i in (1, 0, 2, 1))
    scheduler.add(running)
    assert [s for s, _ in scheduler.schedule()] == [running]
    running.token_ids.append(4)  # its next token, as the engine appends it
    held.grammar = Compiling()
    for seq in (held, other, free):
        scheduler.add(seq)
    assert [s for s, _ in scheduler.schedule()] == [running, free] and list(scheduler.waiting) == [held, other]
    held.grammar.ready = True
    running.token_ids.append(5)
    free.token_ids.append(4)
    assert [s for s, _ in scheduler.schedule()] == [running, free, held] and list(scheduler.waiting) == [other]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_token_bitmask_kernel_at_qwen3s_size():
    """The kernel on 64 of 96 rows of Qwen3's 151,936 logits (bf16), masked by a tokenizer's
    151,669 tokens' worth of words (4,740: the last 267 columns are padding), against numpy."""
    from nanovllm.kernels.token_bitmask import apply_token_bitmask_kernel
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(96, 151936, generator=g) * 3).to(torch.bfloat16)
    rows = torch.randperm(96, generator=g)[:64]
    bitmask = torch.randint(-2**31, 2**31, (64, -(-151669 // 32)), generator=g, dtype=torch.int64).to(torch.int32)
    out = x.cuda()
    apply_token_bitmask_kernel(out, rows.cuda(), bitmask.cuda())
    assert torch.equal(out.cpu(), numpy_masked(x, rows.tolist(), bitmask.numpy()))


@needs_cuda
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_structured_outputs_on_the_gpu(tiny, enforce_eager):
    """On CUDA (float32, CUDA graphs on and off, steps overlapped for real: each mask waits for
    the previous step's draw on the device): constrained greedy rows are the masked argmax of
    transformers' logits, free rows in the same batch equal their unconstrained run, and seeded
    JSON completions at temperature 1 validate. Then the Qwen3-0.6B shape with dummy weights and
    this 300-token tokenizer: 151,636 padding columns masked, every completion valid."""
    path, hf, tokenizer = tiny
    backend = BACKENDS[0]
    llm = LLM(path, dtype="float32", enforce_eager=enforce_eager, kvcache_block_size=16, max_model_len=160,
              gpu_memory_utilization=0.25, structured_outputs_config={"backend": backend})
    constraints = [json_params(), None, StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(grammar=LARK)]
    prompts = [tokenizer.encode(p) for p in ["Alice", "The quick", "yes no", "[1, 2"]]
    params = [SamplingParams(temperature=0, max_tokens=60 if c else 12, ignore_eos=c is None, structured_outputs=c)
              for c in constraints]
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=80, n=4, structured_outputs=json_params())
    outs = llm.generate(prompts + [prompts[0]], params + [sampled], use_tqdm=False)
    free = llm.generate([prompts[1]], params[1], use_tqdm=False)[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == free
    for prompt, c, out in zip(prompts, constraints, outs):
        if c is not None:
            assert (out.outputs[0].token_ids, True) == reference(hf, backend, tokenizer, prompt, c, 60)
    for c in outs[-1].outputs:
        jsonschema.validate(json.loads(c.text), PERSON)
    del llm  # its share of the GPU's memory goes to the next engine
    gc.collect()
    torch.cuda.empty_cache()
    from nanovllm.loader.source import BUILTIN_CONFIGS
    folder = shutil.copytree(path, path + "-qwen3-0.6b", dirs_exist_ok=True)
    with open(BUILTIN_CONFIGS["qwen3-0.6b"]) as f:
        config = json.load(f)
    with open(f"{folder}/config.json", "w") as f:  # the stop token of this tokenizer, as a real model's is of its own
        json.dump(config | {"eos_token_id": EOS, "bos_token_id": EOS}, f)
    big = LLM(folder, load_format="dummy", enforce_eager=enforce_eager, max_model_len=256, gpu_memory_utilization=0.25)
    outs = big.generate(prompts * 8, SamplingParams(temperature=0.6, max_tokens=80, structured_outputs=json_params()),
                        use_tqdm=False)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert max(ids) < TOKENIZER_SIZE or (max(ids[:-1]) < TOKENIZER_SIZE and ids[-1] in big.config.eos_token_ids)
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    del big
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(data_parallel_size=2)])
def test_tensor_and_data_parallel(tiny, parallel):
    """Under tensor parallelism (rank 0 masks the gathered logits) and data parallelism (each
    replica compiles its own grammars), constrained greedy rows are still the masked argmax."""
    path, hf, tokenizer = tiny
    llm = LLM(path, **parallel, **ARGS)
    constraints = [json_params(), StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(grammar=LARK)]
    prompts = [tokenizer.encode(p) for p in ["Alice", "yes no", "[1, 2"]]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=60, structured_outputs=c)
                                  for c in constraints], use_tqdm=False)
    backend = llm.config.structured_outputs_config["backend"]
    for prompt, c, out in zip(prompts, constraints, outs):
        assert (out.outputs[0].token_ids, True) == reference(hf, backend, tokenizer, prompt, c, 60)
