"""Engine inputs and response bodies of the lines an encoder serves besides embeddings: /v1/rerank, /v1/score
and /v1/moderations."""

from __future__ import annotations

from typing import Any

from sluice.contract.moderations import ModerationBody, moderation_response
from sluice.contract.rerank import RerankBody, ScoreBody, rerank_response, score_response
from sluice.contract.schemas import BatchRequest


def encoder_body(request: BatchRequest, out: Any, model: str) -> dict[str, Any] | None:
    """The rerank, score or moderation response for a finished request; None for any other endpoint."""
    body = request.parsed_body()
    if isinstance(body, RerankBody):
        return rerank_response(body, out, model)
    if isinstance(body, ScoreBody):
        return score_response(body, out, model)
    if isinstance(body, ModerationBody):
        return moderation_response(body, out, model)
    return None


def encoder_params(body: Any) -> tuple[Any, str] | None:
    """The engine input and PoolingParams task of a rerank, score or moderation body; None for others."""
    if isinstance(body, RerankBody | ScoreBody):
        return body.pairs(), "score"
    if isinstance(body, ModerationBody):
        return body.inputs(), "classify"
    return None
