"""GET /v1/models: the models the worker fleet has announced (and SLUICE_MODEL, when set)."""

from __future__ import annotations

from pathlib import Path

import redis
from fastapi import APIRouter, Depends, Request

from sluice.contract.jobs import MODELS
from sluice.producer.server.context import ApiKey, api_key, context

router = APIRouter()


def announced(connection: redis.Redis) -> dict[str, int]:
    """Model name → when a worker last became ready with it."""
    return {k.decode(): int(float(v)) for k, v in connection.hgetall(MODELS).items()}


@router.get("/v1/models")
def list_models(request: Request, key: ApiKey = Depends(api_key)) -> dict:
    ctx = context(request)
    models = announced(ctx.connection)
    if ctx.settings.model:
        models.setdefault(Path(ctx.settings.model).name, 0)
    data = [
        {"id": name, "object": "model", "created": t, "owned_by": "sluice"}
        for name, t in sorted(models.items())
    ]
    return {"object": "list", "data": data}
