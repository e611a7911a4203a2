"""Per-request sampling parameters (vLLM-compatible names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output: exactly one of a JSON schema (or True: any JSON object), a regex, a choice of
    strings, or an EBNF grammar (vLLM's names)."""

    json: dict[str, Any] | str | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of json, regex, choice, grammar; got {given}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice or grammar."""
        return next(n for n in ("json", "regex", "choice", "grammar")
                    if getattr(self, n) not in (None, False))


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request; temperature=0 is greedy."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        for name, ok, why in self._checks():
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")
        if self.top_k == -1:
            self.top_k = 0

    def _checks(self) -> list[tuple[str, bool, str]]:
        bias = self.logit_bias or {}
        return [
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0 or self.top_k == -1, "must be >= 0 (0 or -1 disables)"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 10, "must be in (0, 10]"),
            ("logit_bias", all(t >= 0 and math.isfinite(v) and -100 <= v <= 100 for t, v in bias.items()),
             "must map token ids (>= 0) to values in [-100, 100]"),
            ("n", 1 <= self.n <= 128, "must be in [1, 128]"),
            ("best_of", self.best_of is None or self.n <= self.best_of <= 128, "must be in [n, 128]"),
            ("min_tokens",
             self.min_tokens >= 0 and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
             "must be in [0, max_tokens]"),
        ]

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """True when presence, frequency or repetition penalties apply."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusted(self) -> bool:
        """True when min_tokens, logit_bias or penalties change the logits (structured outputs aside)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def processed(self) -> bool:
        """True when the logits need any processing before sampling (penalties, bias, min_tokens,
        structure)."""
        return self.adjusted or self.structured_outputs is not None
