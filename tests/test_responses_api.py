"""The Responses API as a batch endpoint: bodies mapped onto the chat machinery and back, fields Sluice does
not serve named per line, and batches through a real worker and the HTTP Batch API (official openai package),
every output body validated by openai's Response type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import redis
from typer.testing import CliRunner

from sluice.cli.main import app
from sluice.contract.responses_api import RESPONSES, output_text, response_object
from sluice.contract.schemas import ResponsesBody
from sluice.contract.settings import Settings
from sluice.engine import LLM, SamplingParams
from sluice.engine.outputs import RequestMetrics, RequestOutput
from sluice.producer import BatchStatus, Client
from sluice.producer.validation import validate_lines
from sluice.worker.worker import EngineWorker
from tests.openai_types import _no_extra
from tests.server_stack import jsonl, wait_status

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "sluice-tiny"
SCHEMA = {
    "type": "object",
    "properties": {"mood": {"enum": ["merry", "sad", "wrathful"]}},
    "required": ["mood"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Verona", "Padua"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
INSTRUCTIONS = "Answer as a herald."
ITEMS = [
    {
        "role": "user",
        "content": [{"type": "input_text", "text": "Speak, "}, {"type": "input_text", "text": "friend."}],
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Verona?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Verona"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Rain."},
]


def line(custom_id: str, **body: Any) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": RESPONSES, "body": {"temperature": 0, **body}}


def lines() -> list[dict]:
    schema_format = {"type": "json_schema", "name": "mood", "schema": SCHEMA, "strict": True}
    return [
        line("string", input="Speak, friend.", max_output_tokens=6, metadata={"team": "heralds"}),
        line("items", instructions=INSTRUCTIONS, input=ITEMS, max_output_tokens=6),
        line(
            "tool",
            input="Weather in Verona?",
            tools=[WEATHER],
            max_output_tokens=40,
            tool_choice={"type": "function", "name": "get_weather"},
        ),
        line("schema", input="How do you feel?", text={"format": schema_format}, max_output_tokens=32),
        line("history", input=HISTORY, tools=[WEATHER], max_output_tokens=4),
        line("not-served-model", input="Hello", model="gpt-4o", max_output_tokens=4),
    ]


def openai_response(body: dict[str, Any]):
    """The body parsed as openai's Response in strict mode, with no field it does not know and nothing lost or
    changed in a round trip."""
    from openai.types.responses import Response

    parsed = Response.model_validate(body, strict=True)
    _no_extra(parsed, "Response")
    assert parsed.model_dump(mode="json", exclude_unset=True, by_alias=True) == body
    return parsed


def check_records(bodies: dict[str, dict], errors: dict[str, dict], llm: LLM) -> None:
    """What every door must give for lines(): Response bodies, the constraints honoured, errors named."""
    parsed = {cid: openai_response(body) for cid, body in bodies.items()}
    string = parsed["string"]
    assert string.id.startswith("resp_") and string.object == "response" and string.model == "sluice-tiny"
    assert string.status == "incomplete" and string.incomplete_details.reason == "max_output_tokens"
    assert string.metadata == {"team": "heralds"} and string.usage.output_tokens == 6
    assert string.usage.input_tokens == len(llm.encode_chat([{"role": "user", "content": "Speak, friend."}]))
    assert string.usage.total_tokens == string.usage.input_tokens + 6
    (message,) = string.output
    assert (
        message.type == "message"
        and message.status == "incomplete"
        and message.content[0].type == "output_text"
    )

    items = parsed["items"]
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Speak, friend."}]
    prompt = llm.encode_chat(messages)
    assert items.instructions == INSTRUCTIONS and items.usage.input_tokens == len(prompt)
    offline = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0), progress=False)[0]
    assert items.output_text == offline.text and items.usage.output_tokens == len(offline.token_ids)

    tool = parsed["tool"]
    (call,) = tool.output
    assert tool.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert tool.tools[0].name == "get_weather" and tool.tool_choice.name == "get_weather"

    schema = parsed["schema"]
    assert schema.status == "completed" and schema.incomplete_details is None
    jsonschema.validate(json.loads(schema.output_text), SCHEMA)
    assert schema.text.format.type == "json_schema" and schema.text.format.schema_ == SCHEMA

    history = parsed["history"]
    assert history.output[0].type == "message" and history.usage.output_tokens == 4
    assert list(errors) == ["not-served-model"] and errors["not-served-model"]["code"] == "model_not_found"


@pytest.fixture(scope="module")
def llm():
    return LLM(str(TINY), dtype="float32", device="cpu", max_num_seqs=8)


def test_a_responses_body_maps_onto_a_chat_body():
    body = ResponsesBody.model_validate(
        {
            "model": "sluice-tiny",
            "instructions": INSTRUCTIONS,
            "input": [*ITEMS, *HISTORY[1:]],
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
        }
    )
    chat = body.chat()
    assert chat.plain_messages() == [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "Speak, friend."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Verona"}},
                }
            ],
        },
        {"role": "tool", "content": "Rain.", "tool_call_id": "call_1"},
    ]
    assert chat.template_tools() == [
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    ]
    kwargs = chat.sampling_kwargs()
    assert (kwargs["max_tokens"], kwargs["temperature"], kwargs["top_p"]) == (7, 0.5, 0.9)
    assert kwargs["structured_outputs"]["json"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}


def test_a_named_tool_and_text_formats_become_chat_constraints():
    named = ResponsesBody.model_validate(
        {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    )
    assert named.chat().sampling_kwargs()["structured_outputs"] == {"json": WEATHER["parameters"]}
    fmt = ResponsesBody.model_validate(
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "m", "schema": SCHEMA}}}
    )
    assert fmt.chat().sampling_kwargs()["structured_outputs"] == {"json": SCHEMA}
    plain = ResponsesBody.model_validate({"input": "hi", "text": {"format": {"type": "json_object"}}})
    assert plain.chat().plain_messages() == [{"role": "user", "content": "hi"}]
    assert plain.chat().sampling_kwargs()["structured_outputs"] == {"json": True}


def test_a_responses_body_survives_the_shard_job_round_trip():
    raw = [json.dumps(x).encode() for x in lines()]
    checked = validate_lines(raw, Settings())
    assert not checked.errors and len(checked.requests) == len(lines())
    for request, original in zip(checked.requests, lines(), strict=True):
        again = ResponsesBody.model_validate(request.body)
        assert again.chat() == ResponsesBody.model_validate(original["body"]).chat()


def _output(text: str, finish_reason: str, prompt: int = 5) -> RequestOutput:
    return RequestOutput(
        "r", list(range(prompt)), list(range(3)), text, finish_reason, RequestMetrics(0.0, None, None, 2)
    )


def test_response_objects_from_engine_outputs():
    body = ResponsesBody.model_validate(
        {
            "input": "hi",
            "tools": [WEATHER],
            "metadata": {"a": "b"},
            "max_output_tokens": 3,
            "top_p": 0.5,
            "user": "u1",
        }
    )
    said = openai_response(response_object(body, _output("Aye, my lord.", "stop"), "tiny"))
    assert said.status == "completed" and said.output_text == "Aye, my lord." and said.model == "tiny"
    assert (said.temperature, said.top_p, said.tool_choice, said.max_output_tokens) == (1.0, 0.5, "auto", 3)
    assert said.usage.input_tokens == 5 and said.usage.output_tokens == 3 and said.usage.total_tokens == 8
    assert (
        said.usage.input_tokens_details.cached_tokens == 2
        and said.metadata == {"a": "b"}
        and said.user == "u1"
    )
    assert output_text(said.model_dump(mode="json")) == said.output_text
    text = 'Looking. <tool_call>{"name": "get_weather", "arguments": {"city": "Padua"}}</tool_call>'
    called = openai_response(response_object(body, _output(text, "stop"), "tiny"))
    message, call = called.output
    assert message.content[0].text == "Looking." and message.status == "completed"
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        {"city": "Padua"},
    )
    only_call = response_object(body, _output(text.removeprefix("Looking. "), "stop"), "tiny")
    assert output_text(only_call) == 'get_weather({"city": "Padua"})'
    cut = openai_response(response_object(body, _output("Aye, my", "length"), "tiny"))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.completed_at is None and cut.output[0].status == "incomplete"


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "previous_response_id"),
        ({"background": True}, "background", "background"),
        ({"store": True}, "store", "store"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include", "include"),
        ({"stream": True}, "stream", "stream"),
        ({"truncation": "auto"}, "truncation", "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "web_search"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
        ({"tool_choice": "required"}, None, "tool_choice"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
        ({"text": {"format": {"type": "json_schema", "name": "m"}}}, "text.format", "schema"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/a.png"}]}
                ]
            },
            "input.0.message.content.0.input_image",
            "input_image",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
            "input.0.message.content.0",
            "input_file",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "item_reference"),
        ({"conversation": "conv_1"}, "conversation", "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
        ({"input": ""}, "input", "input"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"frequency_penalty": 1}, "frequency_penalty", "frequency_penalty"),
    ],
)
def test_fields_not_served_are_per_line_errors_naming_them(body, param, named):
    raw = [
        json.dumps(line("ok", input="hi")).encode(),
        json.dumps(line("bad", **{"input": "hi", **body})).encode(),
    ]
    checked = validate_lines(raw, Settings())
    assert not checked.errors, checked.errors
    ok, bad = checked.requests
    assert ok.custom_id == "ok" and ok.answer() is None and ok.body["input"]
    record = bad.answer()
    assert bad.custom_id == record.custom_id == "bad" and record.response.status_code == 400
    error = record.response.body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] in ("invalid_value", "unknown_parameter"), error
    assert named in error["message"] and "line 2" in error["message"]
    assert (record.error.code, record.error.message) == (error["code"], error["message"])


def test_unused_values_of_fields_not_served_are_accepted():
    body = ResponsesBody.model_validate(
        {
            "input": "hi",
            "store": False,
            "background": False,
            "stream": False,
            "include": [],
            "truncation": "disabled",
            "reasoning": None,
        }
    )
    assert body.chat().plain_messages() == [{"role": "user", "content": "hi"}]


def test_responses_through_client_and_worker(llm, redis_url, tmp_path):
    client = Client(redis_url)
    batch = client.submit_batch(lines(), output=tmp_path.as_uri(), shard_size=3)
    EngineWorker(["high", "default", "low"], llm, redis.Redis.from_url(redis_url), heartbeat_ttl=5).work(
        burst=True, logging_level="WARNING"
    )
    done = client.get(batch.id)
    assert done.status == BatchStatus.completed and done.request_counts.completed == 5
    bodies = {r.custom_id: r.response.body for r in client.results(batch.id)}
    errors = {r.custom_id: r.error.model_dump() for r in client.results(batch.id, errors=True)}
    check_records(bodies, errors, llm)
    tokens = client.batches.shard_usage(batch.id)
    assert tokens == (
        sum(b["usage"]["input_tokens"] for b in bodies.values()),
        sum(b["usage"]["output_tokens"] for b in bodies.values()),
    )
    shown = CliRunner().invoke(app, ["results", batch.id])
    assert shown.exit_code == 0, shown.output
    assert repr(output_text(bodies["schema"])) in shown.output and 'get_weather({"city": ' in shown.output


def test_responses_through_the_http_batch_api(stack, llm):
    client = stack.openai(stack.key("responses"))
    uploaded = client.files.create(file=jsonl(lines()), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h"
    )
    assert batch.endpoint == "/v1/responses"
    done = wait_status(client, batch.id, {"completed", "failed", "cancelled", "expired"})
    assert done.status == "completed", done
    records = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    records += [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    bodies = {r["custom_id"]: r["response"]["body"] for r in records if r["response"]["status_code"] == 200}
    refused = {r["custom_id"]: r["response"]["status_code"] for r in records if r["error"]}
    assert refused == {"not-served-model": 400}
    check_records(bodies, {r["custom_id"]: r["error"] for r in records if r["error"]}, llm)
    assert done.usage.input_tokens == sum(b["usage"]["input_tokens"] for b in bodies.values())
    assert done.usage.output_tokens == sum(b["usage"]["output_tokens"] for b in bodies.values())
    chat_file = client.files.create(file=jsonl(lines()[:1]), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="requests for /v1/responses"):
        client.batches.create(
            input_file_id=chat_file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
