"""The Batches API over the producer Client: create from an uploaded file, retrieve, list, cancel; per
project."""

from __future__ import annotations

import json
from typing import Any, Literal

import redis
from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from sluice.contract.batch import TransitionError
from sluice.contract.schemas import Batch
from sluice.contract.storage import OutputNotAllowed, split_url
from sluice.producer.client import BatchNotFound, check_metadata, output_expiry_seconds, window_seconds
from sluice.producer.server.context import ApiKey, Context, api_key, context
from sluice.producer.server.errors import APIError, not_found
from sluice.producer.server.files import FILE, FileRecord, FileStore, iter_object
from sluice.producer.server.pagination import list_body, page_ids

OWNER = "sluice:api:batch:"  # + batch id -> {project, endpoint, input_file_id}
INDEX = "sluice:api:batches:"  # + project: sorted set of batch ids by creation time
USAGE = "sluice:api:usage:"  # + batch id -> aggregated usage of a finished batch
router = APIRouter()
STAMPS = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


class CreateBatch(BaseModel):
    """The body of POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=128)
    endpoint: Literal["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
                      "/v1/rerank", "/v1/score", "/v1/moderations"]
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None
    priority: Literal["high", "default", "low"] = "default"


class Owner(BaseModel):
    """Which project a batch belongs to and what it was created from."""

    project: str
    endpoint: str
    input_file_id: str


def usage_of(url: str | None, s3_style: str) -> dict[str, int]:
    """Prompt/completion tokens summed over an output file's responses."""
    prompt = completion = 0
    tail = b""
    for chunk in iter_object(url, s3_style) if url else ():
        *lines, tail = (tail + chunk).split(b"\n")
        for line in lines:
            usage = (json.loads(line).get("response") or {}).get("body", {}).get("usage") or {}
            prompt, completion = (
                prompt + usage.get("prompt_tokens", usage.get("input_tokens", 0)),
                completion + usage.get("completion_tokens", usage.get("output_tokens", 0)),
            )
    return {"input_tokens": prompt, "output_tokens": completion}


class BatchApi:
    """Batches as OpenAI objects: ownership, output files registered as files, usage (from the finished shards
    while the batch runs, from its output file once done)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.connection: redis.Redis = ctx.connection
        self.files = FileStore(self.connection)

    def owner(self, batch_id: str) -> Owner | None:
        raw = self.connection.get(OWNER + batch_id)
        return Owner.model_validate_json(raw) if raw is not None else None

    def own(self, batch: Batch, owner: Owner) -> None:
        with self.connection.pipeline() as pipe:
            pipe.set(OWNER + batch.id, owner.model_dump_json())
            pipe.zadd(INDEX + owner.project, {batch.id: batch.created_at})
            pipe.execute()

    def get(self, project: str, batch_id: str) -> tuple[Batch, Owner]:
        """The project's batch (404 when unknown or another project's)."""
        owner = self.owner(batch_id)
        batch = self.ctx.client.batches.get(batch_id) if owner is not None else None
        if batch is None or owner.project != project:
            raise not_found("batch", batch_id)
        return batch, owner

    def output_file_id(self, batch: Batch, url: str | None, kind: str, project: str) -> str | None:
        """The file id of a finished batch's output (or error) file, registering it on first sight."""
        if url is None:
            return None
        file_id = f"file-{batch.id.removeprefix('batch_')}-{kind}"
        if self.connection.exists(FILE + file_id):
            return file_id
        storage, key = split_url(url, s3_style=self.ctx.settings.s3_addressing_style)
        record = FileRecord(
            id=file_id,
            bytes=storage.size(key) or 0,
            created_at=int(batch.completed_at or batch.cancelled_at or batch.expired_at or batch.created_at),
            filename=f"{batch.id}_{kind}.jsonl",
            purpose="batch_output",
            project=project,
            url=url,
        )
        self.files.add(record)
        return file_id

    def usage(self, batch: Batch) -> dict[str, Any]:
        """OpenAI's usage object: summed over the output file once done (cached), over finished shards
        before."""
        cached = self.connection.get(USAGE + batch.id) if batch.done else None
        if cached is not None:
            tokens = json.loads(cached)
        elif batch.done:
            tokens = usage_of(batch.output_file, self.ctx.settings.s3_addressing_style)
            self.connection.set(USAGE + batch.id, json.dumps(tokens), ex=self.ctx.settings.result_ttl)
        else:
            input_tokens, output_tokens = self.ctx.client.batches.shard_usage(batch.id)
            tokens = {"input_tokens": input_tokens, "output_tokens": output_tokens}
        return {
            **tokens,
            "total_tokens": tokens["input_tokens"] + tokens["output_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }

    def public(self, batch: Batch, owner: Owner) -> dict[str, Any]:
        """The OpenAI Batch object."""
        errors = [
            {"code": e.code, "message": e.message, "param": e.param, "line": e.line} for e in batch.errors
        ]
        stamps = {name: int(v) if (v := getattr(batch, name)) is not None else None for name in STAMPS}
        return {
            "id": batch.id,
            "object": "batch",
            "endpoint": owner.endpoint,
            "model": None,
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": owner.input_file_id,
            "completion_window": batch.completion_window,
            "status": batch.status.value,
            "output_file_id": self.output_file_id(batch, batch.output_file, "output", owner.project),
            "error_file_id": self.output_file_id(batch, batch.error_file, "errors", owner.project),
            **stamps,
            "request_counts": batch.request_counts.model_dump(),
            "metadata": batch.metadata or None,
            "usage": self.usage(batch),
        }

    def input_file(self, key: ApiKey, body: CreateBatch):
        """The batch's input file: the project's, of purpose batch, every line for the batch's endpoint."""
        source = self.files.get(key.project, body.input_file_id)
        if source.purpose != "batch":
            raise APIError(
                400, f"file {source.id} has purpose {source.purpose!r}, not 'batch'", "input_file_id"
            )
        other = [e for e in source.endpoints if e != body.endpoint]
        if other:
            raise APIError(
                400,
                f"the input file has requests for {other[0]}, but the batch endpoint is "
                f"{body.endpoint}; every line's url must match",
                param="endpoint",
                code="invalid_url",
            )
        return source

    def create(self, key: ApiKey, body: CreateBatch) -> dict[str, Any]:
        """Validate the input file's lines and enqueue its shards on the ordinary queues."""
        source = self.input_file(key, body)
        try:
            window_seconds(body.completion_window)
            metadata = check_metadata(body.metadata)
            output_expires_after = output_expiry_seconds(body.output_expires_after)
        except ValueError as exc:
            named = [p for p in ("metadata", "output_expires_after") if p in str(exc)]
            param = named[0] if named else "completion_window"
            raise APIError(400, str(exc), param=param) from None
        webhook = self.ctx.keys.settings(key.project).webhook_url
        try:
            batch = self.ctx.client.submit_batch(
                source.url,
                priority=body.priority,
                metadata=metadata,
                completion_window=body.completion_window,
                webhook=webhook,
                shard_size=self.ctx.settings.shard_size,
                project=key.project,
                output_expires_after=output_expires_after,
            )
        except OutputNotAllowed as exc:  # the server's own SLUICE_OUTPUT_URL is outside SLUICE_OUTPUT_ROOTS
            raise APIError(500, f"the server is misconfigured: {exc}", code="output_not_allowed") from None
        owner = Owner(project=key.project, endpoint=body.endpoint, input_file_id=source.id)
        self.own(batch, owner)
        return self.public(batch, owner)


def api(request: Request) -> BatchApi:
    return BatchApi(context(request))


@router.post("/v1/batches")
async def create_batch(
    body: CreateBatch, key: ApiKey = Depends(api_key), batches: BatchApi = Depends(api)
) -> dict:
    """Create a batch from an uploaded file (validated now; failures answer a `failed` batch with errors)."""
    return await run_in_threadpool(batches.create, key, body)


@router.get("/v1/batches")
def list_batches(
    key: ApiKey = Depends(api_key),
    batches: BatchApi = Depends(api),
    after: str | None = None,
    limit: int = Query(20),
) -> dict:
    """The project's batches, newest first, with cursor pagination."""
    ids, has_more = page_ids(batches.connection, INDEX + key.project, after, limit)
    return list_body([batches.public(*batches.get(key.project, i)) for i in ids], has_more)


@router.get("/v1/batches/{batch_id}")
def retrieve_batch(batch_id: str, key: ApiKey = Depends(api_key), batches: BatchApi = Depends(api)) -> dict:
    return batches.public(*batches.get(key.project, batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
def cancel_batch(batch_id: str, key: ApiKey = Depends(api_key), batches: BatchApi = Depends(api)) -> dict:
    """Cancel: queued shards dropped, running requests aborted; the batch goes `cancelling` → `cancelled`."""
    _, owner = batches.get(key.project, batch_id)
    try:
        batch = batches.ctx.client.cancel(batch_id)
    except TransitionError as exc:
        raise APIError(400, str(exc), code="batch_not_cancellable") from None
    except BatchNotFound:
        raise not_found("batch", batch_id) from None
    return batches.public(batch, owner)
