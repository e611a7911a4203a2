"""Numbers and free strings of a JSON schema have a length bound, so a random model under a schema stops
within it instead of running to max_tokens inside one value."""

from __future__ import annotations

import json
import re

import pytest

from sluice.engine import LLM, SamplingParams
from sluice.engine.json_schema import JsonBounds, bound_grammar

NUMBER = {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]}
STRING = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", device="cpu", json_max_number_digits=3,
               json_max_string_chars=5)


def sample(llm, schema: dict, n: int = 6) -> list:
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured_outputs={"json": schema})
              for seed in range(n)]  # fmt: skip
    return llm.generate([f"value {i}:" for i in range(n)], params, progress=False)


def test_a_random_model_under_a_number_schema_stops_within_the_digit_bound(llm):
    for out in sample(llm, NUMBER):
        assert out.finish_reason == "stop", out.text
        number = json.loads(out.text)["n"]
        assert isinstance(number, int | float)
        parts = re.fullmatch(r'\{"n": -?(\d+)(?:\.(\d+))?(?:[eE][+-]?(\d+))?\}', out.text)
        assert parts and all(len(p) <= 3 for p in parts.groups() if p), out.text


def test_a_free_string_stops_within_the_character_bound(llm):
    for out in sample(llm, STRING):
        assert out.finish_reason == "stop", out.text
        assert len(json.loads(out.text)["s"]) <= 5


def test_bounds_leave_a_schemas_own_limits_and_patterns_alone():
    ebnf = "\n".join([
        'root ::= (("\\"" root_characters{2, 40} "\\"") | root_1)',
        'root_characters ::= (([^\\"\\\\\\r\\n]))',
        'root_1 ::= Regex("^[0-9]*$", json_string=true)',
    ])
    assert bound_grammar(ebnf, JsonBounds(number_digits=3, string_chars=5)) == ebnf
