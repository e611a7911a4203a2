"""Engine outputs as OpenAI batch output records: completion / chat.completion bodies with usage, or errors."""

from __future__ import annotations

import time
import uuid
from typing import Any

from sluice.contract.schemas import CHAT, ErrorInfo, OutputRecord, Request, Response

ABORT_CODES = {
    "batch_cancelled": "the batch was cancelled",
    "batch_expired": "the batch's completion window ended",
}


def record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def error_record(custom_id: str, code: str, message: str) -> OutputRecord:
    """An error line for a request that produced no response."""
    return OutputRecord(id=record_id(), custom_id=custom_id, error=ErrorInfo(code=code, message=message))


def usage(out: Any) -> dict[str, int]:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def logprobs_list(out: Any) -> list[dict[str, float]] | None:
    if out.logprobs is None:
        return None
    return [{str(tok): lp for tok, lp in step.items()} for step in out.logprobs]


def response_body(request: Request, out: Any, model: str) -> dict[str, Any]:
    """The OpenAI completion or chat.completion object for one finished request."""
    created, model = int(time.time()), request.body.get("model") or model
    if request.url == CHAT:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "finish_reason": out.finish_reason,
        }
        choice["logprobs"] = logprobs_list(out)
        kind, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {
            "index": 0,
            "text": out.text,
            "logprobs": logprobs_list(out),
            "finish_reason": out.finish_reason,
        }
        kind, prefix = "text_completion", "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(out),
    }


def output_record(request: Request, out: Any, model: str, abort_code: str | None = None) -> OutputRecord:
    """The record for a finished engine request: a response, or an error if it failed or was aborted."""
    if out.finish_reason == "abort":
        code = abort_code or "request_aborted"
        return error_record(request.custom_id, code, ABORT_CODES.get(code, "the request was aborted"))
    if out.finish_reason == "error" or out.error:
        return error_record(request.custom_id, "engine_error", out.error or "the engine failed this request")
    body = response_body(request, out, model)
    response = Response(status_code=200, request_id=body["id"], body=body)
    return OutputRecord(id=record_id(), custom_id=request.custom_id, response=response)
