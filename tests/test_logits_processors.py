"""The logits processor interface (nanovllm/sampling/processors): the processors apply in vLLM's
order."""
import torch

from nanovllm import SamplingParams
from nanovllm.sampling.inputs import sampling_tensors
from nanovllm.sampling.processors import PROCESSORS
from nanovllm.sequence import Sequence


def test_logit_bias_applies_before_the_penalties():
    """vLLM's order: a row's logit_bias is added before its repetition and presence penalties."""
    seq = Sequence([5, 6], SamplingParams(temperature=0, logit_bias={6: 4.0}, repetition_penalty=2.0,
                                          presence_penalty=0.5))
    seq.token_ids.append(6)  # the completion so far: token 6, also in the prompt
    cpu = torch.device("cpu")
    st = sampling_tensors([seq], cpu, [cls(10, frozenset(), cpu) for cls in PROCESSORS], {}, None)
    logits = torch.full((1, 10), -1.0)
    for processor, state in st.processors:
        processor.apply(logits, state)
    assert logits[0, 6].item() == 1.0  # (-1 + 4) / 2 - 0.5; penalties first would give -1 * 2 - 0.5 + 4 = 1.5
    assert logits[0, 5].item() == -2.0 and logits[0, 7].item() == -1.0  # a prompt token; an unseen one
