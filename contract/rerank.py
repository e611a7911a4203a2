"""/v1/rerank and /v1/score lines, served by a cross-encoder (a ...ForSequenceClassification with one label).

Rerank bodies and responses take the shape vLLM and Cohere use: `{"model", "query", "documents": [str, ...],
"top_n"?, "return_documents"?}` answers `{"id", "model", "usage": {"total_tokens"}, "results": [{"index",
"relevance_score", "document": {"text"}}]}`, results sorted by score, best first. Score is vLLM's
`{"model", "text_1", "text_2"}` (a text or a list on each side: one against many, or n against n) answering
`{"id", "object": "list", "created", "model", "data": [{"index", "object": "score", "score"}], "usage"}`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

RERANK = "/v1/rerank"
SCORE = "/v1/score"
MAX_DOCUMENTS = 1000  # Cohere's limit on the documents of one rerank request
Text = Annotated[str, Field(min_length=1)]


class RerankBody(BaseModel):
    """Body of a /v1/rerank line: the documents' relevance to the query."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256)
    query: Text
    documents: list[Text] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    user: str | None = Field(None, max_length=256)

    def pairs(self) -> list[tuple[str, str]]:
        """(query, document) for each document, in order."""
        return [(self.query, doc) for doc in self.documents]


class ScoreBody(BaseModel):
    """Body of a /v1/score line: the relevance of each (text_1, text_2) pair."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256)
    text_1: Text | list[Text]
    text_2: Text | list[Text]
    user: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _paired(self) -> ScoreBody:
        one, two = self.sides()
        if not one or not two:
            raise ValueError("text_1 and text_2 must not be empty lists")
        if len(one) > 1 and len(two) > 1 and len(one) != len(two):
            raise ValueError(f"text_1 has {len(one)} texts and text_2 {len(two)}: give one, or as many on "
                             "each side")
        if max(len(one), len(two)) > MAX_DOCUMENTS:
            raise ValueError(f"at most {MAX_DOCUMENTS} pairs per request")
        return self

    def sides(self) -> tuple[list[str], list[str]]:
        one, two = ([t] if isinstance(t, str) else list(t) for t in (self.text_1, self.text_2))
        return one, two

    def pairs(self) -> list[tuple[str, str]]:
        """vLLM's pairing: one text against every text of the other side, or n against n."""
        one, two = self.sides()
        n = max(len(one), len(two))
        return list(zip(one * n if len(one) == 1 else one, two * n if len(two) == 1 else two, strict=True))


def scores_of(out: Any) -> list[float]:
    """The relevance score of each pair of a finished engine output, in order."""
    return [item.probs[0] for item in out.items or [out]]


def rerank_response(body: RerankBody, out: Any, model: str) -> dict[str, Any]:
    """The rerank response: results sorted by relevance, the first top_n."""
    ranked = sorted(enumerate(scores_of(out)), key=lambda x: -x[1])[: body.top_n or len(body.documents)]
    results = [{"index": i, "relevance_score": score} | ({"document": {"text": body.documents[i]}}
                                                          if body.return_documents else {})
               for i, score in ranked]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or model,
            "usage": {"total_tokens": out.num_prompt_tokens}, "results": results}


def score_response(body: ScoreBody, out: Any, model: str) -> dict[str, Any]:
    """vLLM's score response: one score per pair, in order."""
    tokens = out.num_prompt_tokens
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": body.model or model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores_of(out))],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
