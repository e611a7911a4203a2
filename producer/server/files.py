"""The Files API: uploads streamed to storage, listing, retrieval, streamed content, deletion; owned by a
project."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Literal

import redis
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from sluice.contract.storage import open_storage, split_url
from sluice.producer.server.context import ApiKey, Context, api_key, context
from sluice.producer.server.errors import APIError, not_found
from sluice.producer.server.pagination import list_body, page_ids
from sluice.producer.server.upload import JsonlSink, receive

FILE = "sluice:file:"
INDEX = "sluice:files:"  # + project: sorted set of file ids by creation time
CHUNK = 1024 * 1024
router = APIRouter()


class FileRecord(BaseModel):
    """An OpenAI File object plus where its bytes live and who owns it."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    project: str
    url: str
    endpoints: list[str] = []

    def public(self) -> dict:
        return self.model_dump(exclude={"project", "url", "endpoints"})


class FileStore:
    """File records in Redis, indexed per project."""

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection

    def add(self, record: FileRecord) -> bool:
        """Store a record unless one with its id exists; True when it was new."""
        if not self.connection.set(FILE + record.id, record.model_dump_json(), nx=True):
            return False
        self.connection.zadd(INDEX + record.project, {record.id: record.created_at})
        return True

    def get(self, project: str, file_id: str) -> FileRecord:
        """The project's file (404 when unknown or another project's)."""
        raw = self.connection.get(FILE + file_id)
        record = FileRecord.model_validate_json(raw) if raw is not None else None
        if record is None or record.project != project:
            raise not_found("file", file_id)
        return record

    def with_purpose(self, ids: list[str], purpose: str) -> list[str]:
        """Those of ids whose file has this purpose, in the same order."""
        raws = self.connection.mget([FILE + i for i in ids]) if ids else []
        return [i for i, raw in zip(ids, raws, strict=True) if raw and json.loads(raw)["purpose"] == purpose]

    def delete(self, record: FileRecord) -> None:
        with self.connection.pipeline() as pipe:
            pipe.delete(FILE + record.id)
            pipe.zrem(INDEX + record.project, record.id)
            pipe.execute()


def iter_object(url: str, s3_style: str) -> Iterator[bytes]:
    """The bytes of a stored object in chunks, never all in memory."""
    storage, key = split_url(url, s3_style=s3_style)
    yield from storage.chunks(key, CHUNK)


@router.post("/v1/files")
async def create_file(request: Request, key: ApiKey = Depends(api_key)) -> dict:
    """Upload a JSONL batch input (multipart: `file`, `purpose=batch`)."""
    ctx: Context = context(request)
    limits = ctx.limits
    declared = int(request.headers.get("content-length") or 0)
    if declared > limits.max_file_bytes + 64 * 1024:
        raise APIError(
            400,
            f"file is larger than the limit of {limits.max_file_bytes} bytes",
            param="file",
            code="file_too_large",
        )
    sink = JsonlSink(limits.max_file_bytes, limits.max_file_requests, ctx.settings.max_line_bytes)
    try:
        upload = await receive(request.headers.get("content-type"), request.stream(), sink)
        purpose = upload.fields.get("purpose")
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
        file_id = f"file-{uuid.uuid4().hex}"
        storage = open_storage(ctx.settings.output_url, s3_style=ctx.settings.s3_addressing_style)
        url = await run_in_threadpool(storage.put_file, f"files/{file_id}.jsonl", sink.path)
    finally:
        sink.discard()
    record = FileRecord(
        id=file_id,
        bytes=sink.size,
        created_at=int(time.time()),
        filename=upload.filename,
        purpose="batch",
        project=key.project,
        url=url,
        endpoints=sorted(sink.endpoints),
    )
    FileStore(ctx.connection).add(record)
    return record.public()


@router.get("/v1/files")
def list_files(
    request: Request,
    key: ApiKey = Depends(api_key),
    after: str | None = None,
    limit: int = Query(20),
    order: str = Query("desc"),
    purpose: str | None = None,
) -> dict:
    """The project's files (newest first, or oldest with order=asc), filtered by purpose, then paged."""
    store = FileStore(context(request).connection)
    keep = None if purpose is None else lambda ids: store.with_purpose(ids, purpose)
    ids, has_more = page_ids(store.connection, INDEX + key.project, after, limit, order, keep)
    return list_body([store.get(key.project, i).public() for i in ids], has_more)


@router.get("/v1/files/{file_id}")
def retrieve_file(file_id: str, request: Request, key: ApiKey = Depends(api_key)) -> dict:
    return FileStore(context(request).connection).get(key.project, file_id).public()


@router.get("/v1/files/{file_id}/content")
def file_content(file_id: str, request: Request, key: ApiKey = Depends(api_key)) -> StreamingResponse:
    """The file's bytes, streamed from storage."""
    ctx = context(request)
    record = FileStore(ctx.connection).get(key.project, file_id)
    headers = {"content-disposition": f'attachment; filename="{record.filename}"'}
    return StreamingResponse(iter_object(record.url, ctx.settings.s3_addressing_style),
                             media_type="application/jsonl", headers=headers)


@router.delete("/v1/files/{file_id}")
def delete_file(file_id: str, request: Request, key: ApiKey = Depends(api_key)) -> dict:
    """Forget the file and delete an uploaded file's bytes (batch outputs stay with their batch)."""
    ctx = context(request)
    store = FileStore(ctx.connection)
    record = store.get(key.project, file_id)
    store.delete(record)
    if record.purpose == "batch":
        storage, path = split_url(record.url, s3_style=ctx.settings.s3_addressing_style)
        storage.delete(path)
    return {"id": file_id, "object": "file", "deleted": True}
