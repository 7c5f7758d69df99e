"""The logits processor interface (nanovllm/sampling/processors): the processors apply in vLLM's
order, and one registered from outside the package acts on exactly the rows that carry it,
through the engine, with and without tensor parallelism."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.sampling import processors
from nanovllm.sampling.inputs import sampling_tensors
from nanovllm.sampling.processors import PROCESSORS, LogitsProcessor
from nanovllm.sequence import Sequence
from tests.conftest import hf_greedy, random_prompts

ARGS = dict(device="cpu", kvcache_block_size=16, max_model_len=128, max_num_batched_tokens=48)


def test_logit_bias_applies_before_the_penalties():
    """vLLM's order: a row's logit_bias is added before its repetition and presence penalties."""
    seq = Sequence([5, 6], SamplingParams(temperature=0, logit_bias={6: 4.0}, repetition_penalty=2.0,
                                          presence_penalty=0.5))
    seq.token_ids.append(6)  # the completion so far: token 6, also in the prompt
    cpu = torch.device("cpu")
    st = sampling_tensors([seq], cpu, [cls(10, frozenset(), cpu) for cls in PROCESSORS], {}, None, 10)
    logits = torch.full((1, 10), -1.0)
    for processor, state in st.processors:
        processor.apply(logits, state)
    assert logits[0, 6].item() == 1.0  # (-1 + 4) / 2 - 0.5; penalties first would give -1 * 2 - 0.5 + 4 = 1.5
    assert logits[0, 5].item() == -2.0 and logits[0, 7].item() == -1.0  # a prompt token; an unseen one


class BanFromExtraArgs(LogitsProcessor):
    """Test-only: bans token extra_args["ban"] in the rows whose params carry it. Records, for each
    step it prepares, (its rows, the step's rows that carry the flag)."""
    prepared = []

    def applies(self, params) -> bool:
        return "ban" in (params.extra_args or {})

    def prepare(self, batch, rows):
        flagged = [row for row, seq in enumerate(batch.seqs) if "ban" in (seq.sampling_params.extra_args or {})]
        BanFromExtraArgs.prepared.append((rows, flagged))
        return (batch.upload(rows, torch.int64),
                batch.upload([batch.seqs[row].sampling_params.extra_args["ban"] for row in rows], torch.int64))

    def apply(self, logits, state):
        logits[state] = float("-inf")


def hf_greedy_without(model, prompt, max_new_tokens, token):
    """transformers' greedy completion with token suppressed (its logit -inf), EOS ignored."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             suppress_tokens=[token])
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("tp", [1, 2])
def test_registered_processor_changes_exactly_its_rows(tiny_qwen3, monkeypatch, tp):
    """A processor added to PROCESSORS bans a token in the two flagged requests (as transformers'
    suppress_tokens does) and is never asked for the others, which complete as transformers'
    greedy: also the one whose extra_args lack the flag; a batch without the flag never calls it.
    Under tensor parallelism the flagged steps sample on rank 0 from gathered logits."""
    path, hf = tiny_qwen3
    monkeypatch.setattr(processors, "PROCESSORS", [BanFromExtraArgs, *PROCESSORS])
    monkeypatch.setattr(BanFromExtraArgs, "prepared", [])
    prompts = random_prompts([7, 12, 9, 15], seed=41)
    greedy = [hf_greedy(hf, p, 8) for p in prompts]
    ban = {0: greedy[0][0], 2: greedy[2][3]}  # tokens the flagged requests would otherwise take
    extra = [{"ban": ban[0]}, None, {"ban": ban[2]}, {"other": 1}]
    llm = LLM(path, tensor_parallel_size=tp, **ARGS)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, extra_args=e) for e in extra]
    outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, (out, expected) in enumerate(zip(outs, greedy)):
        if i in ban:
            assert ban[i] not in out and out == hf_greedy_without(hf, prompts[i], 8, ban[i]) != expected
        else:
            assert out == expected
    steps = list(BanFromExtraArgs.prepared)
    assert steps and all(rows == flagged and rows for rows, flagged in steps)
    again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in again] == greedy and BanFromExtraArgs.prepared == steps
