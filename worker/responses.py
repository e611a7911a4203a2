"""Engine outputs as OpenAI batch output records: completion / chat.completion bodies with usage, or
errors."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any

from sluice.contract.responses_api import RESPONSES, response_object
from sluice.contract.schemas import (
    CHAT,
    EMBEDDINGS,
    BatchRequest,
    ErrorInfo,
    OutputRecord,
    Response,
    record_id,
)
from sluice.contract.tools import parse_tool_calls
from sluice.worker.encoder_responses import encoder_body

ABORT_CODES = {
    "batch_cancelled": "the batch was cancelled",
    "batch_expired": "the batch's completion window ended",
}



def error_record(
    custom_id: str, code: str, message: str, status_code: int | None = None, param: str | None = None
) -> OutputRecord:
    """An error line for a request that produced no response; given a status_code (400: a request refused for
    its body), the record holds OpenAI's HTTP error response for it."""
    if status_code is not None:
        return OutputRecord.rejected(custom_id, code, message, param, status_code)
    return OutputRecord(id=record_id(), custom_id=custom_id, error=ErrorInfo(code=code, message=message))


def usage(out: Any) -> dict[str, int]:
    """Token usage; with n > 1 the prompt counts once and the completion tokens of every choice add up."""
    prompt = len(out.prompt_token_ids)
    completion = sum(len(s.token_ids) for s in (out.samples or [out]))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


MIN_LOGPROB = -9999.0  # what OpenAI reports for a token of probability 0 (JSON has no -inf)


def token_text(raw: bytes) -> str:
    """A token as OpenAI writes it: its UTF-8 text, or `bytes:\\xNN...` when the bytes are not whole
    characters."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _top(step: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of one step (the engine adds the chosen token when it is not among them)."""
    return sorted(step.items(), key=lambda kv: -kv[1])[:n]


def _entry(token: int, logprob: float, raw: dict[int, bytes]) -> dict[str, Any]:
    return {"token": token_text(raw[token]), "logprob": max(logprob, MIN_LOGPROB), "bytes": list(raw[token])}


def chat_logprobs(out: Any, n: int) -> dict[str, Any] | None:
    """OpenAI's chat `logprobs`: {content: [{token, logprob, bytes, top_logprobs: [...]}], refusal}."""
    if out.logprobs is None:
        return None
    raw = out.token_bytes
    content = [
        _entry(tok, step[tok], raw) | {"top_logprobs": [_entry(t, lp, raw) for t, lp in _top(step, n)]}
        for tok, step in zip(out.token_ids, out.logprobs, strict=False)
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(out: Any, n: int) -> dict[str, Any] | None:
    """OpenAI's legacy completions `logprobs`: {tokens, token_logprobs, top_logprobs, text_offset}."""
    if out.logprobs is None:
        return None
    raw, steps = out.token_bytes, list(zip(out.token_ids, out.logprobs, strict=False))
    tokens = [token_text(raw[tok]) for tok, _ in steps]
    offsets = [0]
    for text in tokens[:-1]:
        offsets.append(offsets[-1] + len(text))
    return {
        "tokens": tokens,
        "token_logprobs": [max(step[tok], MIN_LOGPROB) for tok, step in steps],
        "top_logprobs": [{token_text(raw[t]): max(lp, MIN_LOGPROB) for t, lp in _top(step, n)}
                         for _, step in steps],
        "text_offset": offsets[: len(tokens)],
    }


def _message(request: BatchRequest, out: Any) -> tuple[dict[str, Any], str | None]:
    """The assistant message (tool calls parsed when the request offered tools) and its finish_reason."""
    if not request.body.get("tools"):
        return {"role": "assistant", "content": out.text}, out.finish_reason
    body = request.parsed_body()
    content, calls = parse_tool_calls(out.text, body.tools, body.chosen_tools())
    if not calls:
        return {"role": "assistant", "content": content}, out.finish_reason
    reason = "tool_calls" if out.finish_reason == "stop" else out.finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, reason


def _choice(request: BatchRequest, out: Any, index: int) -> dict[str, Any]:
    if request.url == CHAT:
        message, reason = _message(request, out)
        return {
            "index": index,
            "message": message,
            "finish_reason": reason,
            "logprobs": chat_logprobs(out, request.body.get("top_logprobs") or 0),
        }
    return {
        "index": index,
        "text": out.text,
        "logprobs": completion_logprobs(out, request.body.get("logprobs") or 0),
        "finish_reason": out.finish_reason,
    }


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def embedding_body(request: BatchRequest, out: Any, model: str) -> dict[str, Any]:
    """OpenAI's CreateEmbeddingResponse for one finished embeddings request (one entry per input)."""
    fmt = request.body.get("encoding_format") or "float"
    data = [{"object": "embedding", "index": i, "embedding": encode_embedding(item.embedding, fmt)}
            for i, item in enumerate(out.items or [out])]
    tokens = out.num_prompt_tokens
    return {"object": "list", "data": data, "model": request.body.get("model") or model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def response_body(request: BatchRequest, out: Any, model: str) -> dict[str, Any]:
    """The OpenAI completion or chat.completion object for one finished request (n choices when n > 1)."""
    if request.url == EMBEDDINGS:
        return embedding_body(request, out, model)
    if request.url == RESPONSES:
        return response_object(request.parsed_body(), out, model)
    if (body := encoder_body(request, out, model)) is not None:  # rerank, score, moderations
        return body
    kind, prefix = ("chat.completion", "chatcmpl") if request.url == CHAT else ("text_completion", "cmpl")
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": request.body.get("model") or model,
        "choices": [_choice(request, s, i) for i, s in enumerate(out.samples or [out])],
        "usage": usage(out),
    }


def output_record(request: BatchRequest, out: Any, model: str, abort_code: str | None = None) -> OutputRecord:
    """The record for a finished engine request: a response, or an error if it failed or was aborted."""
    if out.finish_reason == "abort":
        code = abort_code or "request_aborted"
        return error_record(request.custom_id, code, ABORT_CODES.get(code, "the request was aborted"))
    if out.finish_reason == "error" or out.error:
        return error_record(request.custom_id, "engine_error", out.error or "the engine failed this request")
    body = response_body(request, out, model)
    response = Response(status_code=200, request_id=body.get("id") or f"req_{uuid.uuid4().hex}", body=body)
    return OutputRecord(id=record_id(), custom_id=request.custom_id, response=response)
