"""/v1/moderations lines, served by a sequence-classification checkpoint: its id2label names the categories.

A line `{"model", "input": str | [str]}` answers OpenAI's ModerationCreateResponse, `{"id": "modr-...",
"model", "results": [{"flagged", "categories", "category_scores", "category_applied_input_types"}]}`, one
result per input. Each category's score is the classifier's probability of that label (softmax over the
labels; sigmoid for a multi-label or single-label classifier); a category is flagged at or above its threshold
(the engine's `moderation_thresholds`, worker flag `--moderation-thresholds`: a JSON object of label to
threshold, "default" for the others; 0.5 without one), which the classifier's output carries; `flagged` when
any is. OpenAI's own categories that the classifier does not have are reported false with
score 0.0 (the openai package requires them); the classifier's labels come as they are named.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

MODERATIONS = "/v1/moderations"
MAX_INPUTS = 2048
MAX_INPUT_CHARS = 1_000_000
DEFAULT_THRESHOLD = 0.5
OPENAI_CATEGORIES = (
    "harassment", "harassment/threatening", "hate", "hate/threatening", "illicit", "illicit/violent",
    "self-harm", "self-harm/instructions", "self-harm/intent", "sexual", "sexual/minors", "violence",
    "violence/graphic",
)


class ModerationBody(BaseModel):
    """Body of a /v1/moderations line: one result per input text."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str]
    model: str | None = Field(None, max_length=256)

    @field_validator("input")
    @classmethod
    def _inputs(cls, v: str | list[str]) -> str | list[str]:
        items = [v] if isinstance(v, str) else v
        if not items or any(not item for item in items):
            raise ValueError("input must not be empty, nor contain an empty string")
        if len(items) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request")
        if sum(map(len, items)) > MAX_INPUT_CHARS:
            raise ValueError(f"at most {MAX_INPUT_CHARS} characters of input per request")
        return v

    def inputs(self) -> list[str]:
        """The input texts, in order."""
        return [self.input] if isinstance(self.input, str) else list(self.input)


def threshold(thresholds: dict[str, float], label: str) -> float:
    """A category's threshold: its own, else the "default" entry, else DEFAULT_THRESHOLD."""
    return thresholds.get(label, thresholds.get("default", DEFAULT_THRESHOLD))


def moderation_result(probs: list[float], labels: list[str], thresholds: dict[str, float]) -> dict[str, Any]:
    """One input's result: the classifier's labels as categories, OpenAI's missing ones false."""
    scores = dict.fromkeys(OPENAI_CATEGORIES, 0.0) | dict(zip(labels, probs, strict=True))
    categories = {name: score >= threshold(thresholds, name) if name in labels else False
                  for name, score in scores.items()}
    applied = {name: ["text"] if name in labels else [] for name in scores}
    return {"flagged": any(categories.values()), "categories": categories, "category_scores": scores,
            "category_applied_input_types": applied}


def moderation_response(body: ModerationBody, out: Any, model: str) -> dict[str, Any]:
    """OpenAI's ModerationCreateResponse for a finished classify output (one item per input; its labels and
    thresholds)."""
    thresholds = out.thresholds or {}
    results = [moderation_result(item.probs, out.labels, thresholds) for item in out.items or [out]]
    return {"id": f"modr-{uuid.uuid4().hex}", "model": body.model or model, "results": results}
