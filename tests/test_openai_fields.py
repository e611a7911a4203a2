"""OpenAI's request fields through the batch doors: Client + worker and the HTTP Batch API (official openai
package); every response body validated against the openai package's types; unsupported fields named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import redis
import torch

from sluice.contract.settings import Settings
from sluice.engine import LLM, SamplingParams
from sluice.producer import BatchStatus, Client
from sluice.producer.validation import validate_lines
from sluice.worker.worker import EngineWorker
from tests.openai_types import openai_body
from tests.server_stack import jsonl, wait_status

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "sluice-tiny"
SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["merry", "sad", "wrathful"]}},
          "required": ["mood"], "additionalProperties": False}
KING = 1000  # a token id forced by logit_bias
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Verona", "Padua"]}}, "required": ["city"],
    "additionalProperties": False}}}
MOOD = {"type": "function", "function": {"name": "set_mood", "parameters": {
    "type": "object", "properties": {"mood": {"enum": ["merry", "sad"]}}, "required": ["mood"],
    "additionalProperties": False}}}
HISTORY = [
    {"role": "user", "content": "Weather in Verona?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Verona"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Rain."},
]


def line(custom_id: str, url: str, **body) -> dict:
    if url == "chat":
        body = {"messages": [{"role": "user", "content": "Speak, friend."}], "temperature": 0, **body}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    body = {"prompt": "KING HENRY:\nWhat say you?\n", "temperature": 0, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def lines() -> list[dict]:
    schema_format = {"type": "json_schema", "json_schema": {"name": "mood", "schema": SCHEMA, "strict": True}}
    bad_format = {"type": "json_schema",
                  "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    return [
        line("chat-logprobs", "chat", logprobs=True, top_logprobs=2, max_tokens=6, ignore_eos=True),
        line("completion-logprobs", "completion", logprobs=3, max_tokens=6, ignore_eos=True),
        line("schema", "chat", response_format=schema_format, max_tokens=24),
        line("bias", "completion", logit_bias={str(KING): 100}, max_tokens=5),
        line("penalties", "completion", presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.2,
             ignore_eos=True, max_tokens=12),
        line("regex", "completion", structured_outputs={"regex": "(Aye|Nay), my lord!"}, max_tokens=12),
        line("bad-schema", "chat", response_format=bad_format),
        line("tool-named", "chat", tools=[WEATHER, MOOD], max_tokens=40,
             tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        line("tool-required", "chat", tools=[WEATHER, MOOD], tool_choice="required", max_tokens=96),
        line("tool-auto", "chat", tools=[WEATHER], max_tokens=6, messages=HISTORY),
        line("n3", "completion", n=3, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True),
        line("n2-chat", "chat", n=2, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True, logprobs=True),
    ]


def check_records(bodies: dict[str, dict], errors: dict[str, dict], llm_tokenizer) -> None:
    """What every door must give for lines(): OpenAI-typed bodies, the constraints honoured, errors named."""
    parsed = {cid: openai_body(body) for cid, body in bodies.items()}
    chat = parsed["chat-logprobs"].choices[0]
    assert "".join(e.token for e in chat.logprobs.content) == chat.message.content
    assert all(len(e.top_logprobs) == 2 and bytes(e.bytes).decode() == e.token for e in chat.logprobs.content)
    done = parsed["completion-logprobs"].choices[0]
    assert "".join(done.logprobs.tokens) == done.text and len(done.logprobs.token_logprobs) == 6
    assert (done.logprobs.text_offset == sorted(done.logprobs.text_offset)
            and len(done.logprobs.top_logprobs[0]) <= 3)
    schema = parsed["schema"].choices[0]
    assert schema.finish_reason == "stop"
    jsonschema.validate(json.loads(schema.message.content), SCHEMA)
    assert parsed["bias"].choices[0].text == llm_tokenizer.decode([KING]) * 5
    assert re.fullmatch("(Aye|Nay), my lord!", parsed["regex"].choices[0].text)
    for cid, n in (("n3", 3), ("n2-chat", 2)):
        body = parsed[cid]
        assert [c.index for c in body.choices] == list(range(n))
        assert body.usage.completion_tokens == sum(len(c.logprobs.content) if c.logprobs else 5
                                                   for c in body.choices)
        assert body.usage.prompt_tokens == parsed["bias" if cid == "n3" else "schema"].usage.prompt_tokens
    named, required = parsed["tool-named"].choices[0], parsed["tool-required"].choices[0]
    for choice in (named, required):
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        tool = next(t for t in (WEATHER, MOOD) if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert named.message.tool_calls[0].function.name == "get_weather"
    auto = parsed["tool-auto"].choices[0]
    assert auto.message.tool_calls is None and auto.message.content and auto.finish_reason == "length"
    assert list(errors) == ["bad-schema"] and errors["bad-schema"]["code"] == "invalid_value"
    assert "uniqueItems" in errors["bad-schema"]["message"]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(TINY), dtype="float32", device="cpu", max_num_seqs=16)


def test_fields_through_client_and_worker_match_the_offline_api(llm, redis_url, tmp_path):
    client = Client(redis_url)
    batches = [client.submit_batch([x for x in lines() if x["url"] == endpoint], output=tmp_path.as_uri(),
                                   shard_size=4) for endpoint in ("/v1/chat/completions", "/v1/completions")]
    EngineWorker(["high", "default", "low"], llm, redis.Redis.from_url(redis_url), heartbeat_ttl=5).work(
        burst=True, logging_level="WARNING")
    assert [client.get(b.id).status for b in batches] == [BatchStatus.completed] * 2
    bodies = {r.custom_id: r.response.body for b in batches for r in client.results(b.id)}
    errors = {r.custom_id: r.error.model_dump() for b in batches for r in client.results(b.id, errors=True)}
    check_records(bodies, errors, llm.tokenizer)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=1.0, repetition_penalty=1.2)
    offline = llm.generate("KING HENRY:\nWhat say you?\n", params, progress=False)[0]
    assert bodies["penalties"]["choices"][0]["text"] == offline.text


def test_fields_through_the_http_batch_api(stack, llm):
    client = stack.openai(stack.key("fields"))
    bodies: dict[str, dict] = {}
    errors: dict[str, dict] = {}
    for endpoint in ("/v1/chat/completions", "/v1/completions"):
        uploaded = client.files.create(file=jsonl([x for x in lines() if x["url"] == endpoint]),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
        done = wait_status(client, batch.id, {"completed", "failed", "cancelled", "expired"})
        assert done.status == "completed", done
        records = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        if done.error_file_id:
            records += [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
        bodies |= {r["custom_id"]: r["response"]["body"] for r in records if not r["error"]}
        errors |= {r["custom_id"]: r["error"] for r in records if r["error"]}
        assert all(r["response"]["status_code"] == 400 for r in records if r["error"])
    check_records(bodies, errors, llm.tokenizer)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools.0.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"n": 200}, "n"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"echo": True}, "echo"),
    ({"stream": True}, "stream"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"logit_bias": {"12": 101}}, "logit_bias.12"),
])  # fmt: skip
def test_unsupported_or_bad_fields_are_per_line_errors_naming_them(body, param):
    url = "completion" if "best_of" in body or "echo" in body else "chat"
    raw = [json.dumps(line("ok", url)).encode(), json.dumps(line("bad", url, **body)).encode()]
    checked = validate_lines(raw, Settings())
    assert [r.custom_id for r in checked.requests] == ["ok", "bad"] and checked.errors == []
    assert checked.requests[0].record is None
    response = checked.requests[1].answer().response
    error = response.body["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and "line 2" in error["message"], error
    named = param.split(".")[0]
    words = (named, "response_format", "min_tokens", "tool")
    assert any(word in error["message"] for word in words)


def test_tool_calls_are_parsed_in_hermes_and_llama_formats():
    from sluice.contract.tools import Tool, parse_tool_calls

    tools = [Tool.model_validate(WEATHER)]
    content, calls = parse_tool_calls(
        'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Verona"}}\n</tool_call>',
        tools, "auto")
    assert content == "Let me look." and calls[0]["function"] == {"name": "get_weather",
                                                                  "arguments": '{"city": "Verona"}'}
    content, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Padua"}}', tools,
                                      "auto")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Padua"}
    assert parse_tool_calls('{"name": "other", "parameters": {}}', tools, "auto") == (
        '{"name": "other", "parameters": {}}', [])
    assert parse_tool_calls("<tool_call>{}</tool_call>", tools, "none") == ("<tool_call>{}</tool_call>", [])


def test_tools_reach_the_chat_template(llm):
    """Offline door: LLM.chat(tools=...) renders the tools through the model's template (when it reads
    them)."""
    template = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = ("{% for t in tools or [] %}TOOL {{ t['function']['name'] }}\n{% endfor %}"
                                   "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    try:
        messages = [{"role": "user", "content": "Weather?"}]
        with_tools = llm.tokenizer.decode(llm.encode_chat(messages, [WEATHER]))
        assert "TOOL get_weather" in with_tools and "TOOL" not in llm.tokenizer.decode(
            llm.encode_chat(messages))
    finally:
        llm.tokenizer.chat_template = template


def _reference(llm, out, bias: dict[int, float], presence: float, temperature: float,
               mode: str) -> torch.Tensor:
    """Per output step, the values `mode` names, computed here from the model's logits (LLM.score)."""
    raw = llm.score([out.prompt_token_ids + out.token_ids[:-1]])[0].float()[len(out.prompt_token_ids) - 1:]
    if mode.startswith("raw"):
        return raw if mode == "raw_logits" else raw.log_softmax(-1)
    processed = raw.clone()
    for t, v in bias.items():
        processed[:, t] += v
    for i in range(len(out.token_ids)):
        processed[i, sorted(set(out.token_ids[:i]))] -= presence  # OpenAI: (count > 0) * presence
    processed /= temperature
    return processed if mode == "processed_logits" else processed.log_softmax(-1)


@pytest.mark.parametrize("speculative",
                         [None, {"method": "draft", "model": str(ROOT / "models" / "sluice-tiny-draft"),
                                "num_speculative_tokens": 3}])
def test_logprobs_mode_reports_raw_or_processed_values(speculative):
    """vLLM's logprobs_mode: raw_* are the model's (logit_bias does not move them), processed_* carry
    logit_bias, presence_penalty and temperature; *_logits are the values before log_softmax. On plain and
    speculative steps."""
    llm = LLM(str(TINY), dtype="float32", device="cpu", max_num_seqs=4, logprobs_mode="processed_logprobs",
              speculative=speculative)
    engine = llm.engine
    bias = {KING: 4.0, KING + 1: -3.0}
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True, logit_bias=bias,
                            presence_penalty=0.5, logprobs=3)
    seen: dict[str, list] = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
        engine.outputs.logprobs_mode = mode  # what the output processor reports (engine.output_processor)
        out = llm.generate("KING HENRY:\nWhat say you?\n", params, progress=False)[0]
        ref = _reference(llm, out, bias, 0.5, 0.7, mode)
        for i, step in enumerate(out.logprobs):
            assert len(step) >= 3
            for t, value in step.items():
                assert value == pytest.approx(ref[i, t].item(), abs=2e-4), (mode, i, t)
        seen[mode] = out
    # the mode changes what is reported, not sampled
    assert len({tuple(o.token_ids) for o in seen.values()}) == 1
    raw, processed = seen["raw_logprobs"].logprobs, seen["processed_logprobs"].logprobs
    tok = seen["raw_logprobs"].token_ids[0]
    assert abs(raw[0][tok] - processed[0][tok]) > 0.05  # logit_bias and temperature moved processed, not raw
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(str(TINY), logprobs_mode="final_logits")
