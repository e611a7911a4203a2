"""Structured outputs on the bundled model (offline LLM door): every output that stops validates, with and
without speculation and preemption; regex, choice and grammar; unsupported keywords are named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from sluice.engine import LLM, RequestRejected, SamplingParams
from sluice.engine.sampling_params import StructuredOutputsParams

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "sluice-tiny"
DRAFT = ROOT / "models" / "sluice-tiny-draft"
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 18, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"mood": {"enum": ["merry", "sad", "wrathful"]}}, "required": ["mood"],
     "additionalProperties": False},
    {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                "maxItems": 2}}, "required": ["words"],
     "additionalProperties": False},
    {"type": "object", "properties": {"who": {
        "type": "object", "properties": {"king": {"type": "boolean"},
                                         "act": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["king", "act"], "additionalProperties": False}},
     "required": ["who"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": -3, "maximum": 3},
                                                           {"enum": ["aye", "nay"]}]}},
     "required": ["answer"], "additionalProperties": False},
]
PROMPT = "KING HENRY:\nWhat say you, my lord?\n"


def schema_params(n: int, greedy: bool) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=64, temperature=0 if greedy else 0.9, seed=i,
                           structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]))
            for i in range(n)]


def check_outputs(outs, params) -> int:
    """Every output that finished with stop parses and validates; returns how many did."""
    stopped = 0
    for out, p in zip(outs, params, strict=True):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), p.structured_outputs.json)
            stopped += 1
    return stopped


@pytest.fixture(scope="module")
def llm():
    return LLM(str(TINY), dtype="float32", device="cpu", max_num_seqs=32)


def test_every_stopped_output_validates_against_its_schema(llm):
    params = schema_params(30, greedy=False) + schema_params(5, greedy=True)
    outs = llm.generate([PROMPT] * len(params), params, progress=False)
    assert check_outputs(outs, params) >= len(params) * 0.6
    assert len(llm.engine.processors.structured.cache) == len(SCHEMAS)


def test_masks_are_filled_during_the_forward_with_the_same_outputs(llm):
    """The plain rows' masks come from the fill started before the forward (none filled after it), and the
    outputs are the ones a fill after the forward gives."""
    params = schema_params(12, greedy=False)
    structured = llm.engine.intake.structured()
    outs = {}
    for overlap in (False, True):
        structured.overlap = overlap
        before = dict(structured.rows_filled)
        outs[overlap] = [o.token_ids for o in llm.generate([PROMPT] * 12, params, progress=False)]
        filled = {k: structured.rows_filled[k] - before[k] for k in before}
        assert (filled["ahead"] > 0, filled["after"] > 0) == (overlap, not overlap), filled
    assert outs[True] == outs[False]


@pytest.mark.parametrize("greedy", [True, False])
def test_structured_with_the_draft_speculating_and_preemption(llm, greedy):
    params = schema_params(10, greedy)
    spec = LLM(str(TINY), dtype="float32", device="cpu",
               kv_cache_memory_gb=12 * llm.engine.kv_block_bytes / 1024**3,
               speculative={"method": "draft", "model": str(DRAFT), "num_speculative_tokens": 3,
                            "disable_by_batch_size": 64})
    outs = spec.generate([PROMPT] * len(params), params, progress=False)
    assert check_outputs(outs, params) >= len(params) * 0.6
    stats = spec.stats()
    assert stats["spec_accepted"] > 0 and stats["num_preemptions"] > 0
    if greedy:
        assert [o.token_ids for o in outs] == [o.token_ids
                                               for o in llm.generate([PROMPT] * 10, params, progress=False)]


def test_regex_choice_and_grammar(llm):
    cases = [
        (StructuredOutputsParams(regex=r"(Aye|Nay), my lord [0-9]{2}"), r"(Aye|Nay), my lord [0-9]{2}"),
        (StructuredOutputsParams(choice=["Romeo", "Juliet", "Mercutio"]), r"Romeo|Juliet|Mercutio"),
        (StructuredOutputsParams(grammar='root ::= "Act " [1-5] ", scene " [1-9]'),
         r"Act [1-5], scene [1-9]"),
    ]
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, structured_outputs=so)
              for i, (so, _) in enumerate(cases)]
    for out, (_, pattern) in zip(llm.generate([PROMPT] * len(cases), params, progress=False), cases,
                                 strict=True):
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text


def test_json_object_is_any_object_and_takes_logit_bias_too(llm):
    """json_object (any object): the tiny model writes long keys, so a bias on `"` and `}` helps it finish."""
    quote, close = llm.tokenizer.convert_tokens_to_ids(['"', "}"])
    params = [SamplingParams(max_tokens=120, temperature=0.9, seed=i, logit_bias={quote: 6, close: 4},
                             structured_outputs={"json": True}) for i in range(6)]
    outs = llm.generate([PROMPT] * 6, params, progress=False)
    stopped = [json.loads(o.text) for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 3 and all(isinstance(v, dict) and v for v in stopped)


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "strin"}, "strin"),
])
def test_a_schema_the_engine_cannot_enforce_is_rejected_by_name(llm, schema, named):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    with pytest.raises(RequestRejected, match=named):
        llm.engine.add_request("bad", PROMPT, params)
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2), progress=False)[0].token_ids
