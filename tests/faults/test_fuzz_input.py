"""Property-based fuzzing of input validation: every generated line is a request or a line-numbered error."""

from __future__ import annotations

import json
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.contract.schemas import BatchRequest, EmbeddingBody
from sluice.contract.settings import Settings
from sluice.engine.pooling import PoolingParams, split_inputs
from sluice.engine.sampling_params import SamplingParams
from sluice.producer.validation import validate_lines

EXAMPLES = 500
LINES_PER_EXAMPLE = 40
NAMES = [
    "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "n", "logprobs", "top_logprobs", "model", "user", "presence_penalty",
    "frequency_penalty", "logit_bias", "response_format", "ignore_eos", "stream", "best_of", "echo",
    "input", "dimensions", "encoding_format",
]  # fmt: skip
EXTREME_NUMBERS = [0, 1, -1, 2, 20, 21, 2**31, 2**63, -(2**63), 2**64, 10**30, 0.5, -0.0, 1e308,
                   math.nan, math.inf, -math.inf, 1e-320]  # fmt: skip
SETTINGS = Settings(max_line_bytes=20_000)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EXTREME_NUMBERS),
    st.integers(),
    st.floats(),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", ""]),
         "content": st.text(max_size=30) | st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=2)}
    ),
    max_size=3,
)  # fmt: skip
field_values = st.one_of(scalars, json_values, messages, st.lists(st.text(max_size=12), max_size=6))
bodies = st.dictionaries(st.sampled_from(NAMES), field_values, max_size=8)
URLS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", ""]


def plausible(url: str) -> st.SearchStrategy[dict]:
    """Lines of a file for `url`, some naming another url (a mixed file)."""
    return st.fixed_dictionaries(
        {
            "custom_id": st.text(max_size=12) | st.integers() | st.none(),
            "method": st.sampled_from(["POST", "GET", "post"]),
            "url": st.just(url) | st.sampled_from(URLS),
            "body": bodies | json_values,
        },
        optional={"extra": scalars},
    )


text_prompts = st.fixed_dictionaries(
    {
        "custom_id": st.text(min_size=1, max_size=12),
        "method": st.just("POST"),
        "url": st.just("/v1/completions"),
        "body": st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=20)}, optional={
            "max_tokens": st.integers(), "temperature": st.floats(), "top_k": st.integers(),
            "top_p": st.floats(), "seed": st.integers(), "stop": st.lists(st.text(max_size=5), max_size=5)}),
    },
)  # fmt: skip
raw_bytes = st.binary(max_size=60)
deep = st.integers(1, 5000).map(lambda n: b'{"custom_id": "x", "body": ' + b"[" * n + b"]" * n + b"}")


def lines(url: str) -> st.SearchStrategy[bytes]:
    """Lines of a file for `url`: plausible ones, raw bytes, deep nesting, cut-off JSON, blanks."""
    prompts = text_prompts if url == "/v1/completions" else plausible(url)
    encoded = st.one_of(plausible(url), prompts, json_values).map(lambda v: json.dumps(v).encode())
    corrupted = encoded.flatmap(lambda b: st.integers(0, len(b)).map(lambda cut: b[:cut]))
    return st.one_of(encoded, encoded, encoded, raw_bytes, deep, corrupted, st.just(b"   "))


files = st.sampled_from(URLS).flatmap(
    lambda url: st.lists(lines(url), min_size=LINES_PER_EXAMPLE // 2, max_size=LINES_PER_EXAMPLE)
)


def engine_takes(params: SamplingParams) -> None:
    """What the engine does with a request's numbers: int64 tensors (top-k) and a seeded generator."""
    torch.tensor([params.top_k, params.max_tokens or 0], dtype=torch.int64)
    torch.tensor([params.temperature, params.top_p, params.min_p], dtype=torch.float32)
    if params.seed is not None:
        torch.Generator().manual_seed(params.seed)


def check_outcome(batch: list[bytes]) -> None:
    checked = validate_lines(batch, SETTINGS)
    nonblank = [n for n, raw in enumerate(batch, start=1) if raw.strip()]
    line_errors = [e for e in checked.errors if e.line is not None]
    assert len(checked.requests) + len(line_errors) == len(nonblank) == checked.num_lines
    assert {e.line for e in line_errors} <= set(nonblank)
    assert len({e.line for e in line_errors}) == len(line_errors), "one error per line"
    for error in line_errors:
        assert f"line {error.line}" in error.message and error.code
    urls = [r.url for r in checked.requests]
    assert len(set(urls)) <= 1, "a batch's requests all name one url"
    for error in (e for e in line_errors if e.code == "invalid_url"):  # a mixed file is refused as a whole
        assert error.param == "url" and f"differs from {urls[0]!r} of line " in error.message
    if not nonblank:
        assert [e.code for e in checked.errors] == ["empty_file"]
    for request in checked.requests:
        again = BatchRequest.model_validate_json(request.model_dump_json())
        if again.record is not None:  # a refused body: its line's 400, in OpenAI's error shape
            response = again.answer().response
            assert response.status_code == 400 and response.body["error"]["message"].startswith("line ")
            continue
        body = again.parsed_body()
        if isinstance(body, EmbeddingBody):
            assert split_inputs(body.input) and PoolingParams(dimensions=body.dimensions)
            continue
        engine_takes(SamplingParams(**body.sampling_kwargs()))
        assert all(math.isfinite(v) for v in body.model_dump().values() if isinstance(v, float))


def test_fuzzed_lines_become_requests_or_line_numbered_errors():
    seen: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(files)
    def check(batch: list[bytes]) -> None:
        seen.append(len(batch))
        check_outcome(batch)

    check()
    assert sum(seen) >= 10_000, f"only {sum(seen)} lines generated"


def test_known_hostile_lines_get_specific_errors():
    hostile = [
        b"[" * 10_000,
        b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": '
        + b"[" * 40
        + b"]" * 40
        + b"}",
        b'{"custom_id": "\\ud800", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}',
        json.dumps(
            {
                "custom_id": "k",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "x", "top_k": 2**63},
            }
        ).encode(),  # fmt: skip
        b'{"custom_id": "t", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", '
        b'"temperature": NaN}}',
    ]
    checked = validate_lines(hostile, SETTINGS)
    got = {e.line: e for e in checked.errors}
    assert got[1].code == "invalid_json" and "nested deeper" in got[1].message
    assert got[2].code == "too_deep"
    assert got[3].param == "custom_id" and "unicode" in got[3].message
    refused = {r.custom_id: r.answer().response.body["error"] for r in checked.requests}
    assert list(refused) == ["k", "t"] and refused["k"]["param"] == "top_k"
    assert refused["t"]["param"] == "temperature" and "finite" in refused["t"]["message"]


def test_empty_input_reports_zero_requests():
    checked = validate_lines([b"", b"  "], SETTINGS)
    assert checked.num_lines == 0 and [e.code for e in checked.errors] == ["empty_file"]
