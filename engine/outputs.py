"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """Timings (seconds, time.monotonic) and cache use of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        """Arrival to finish."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculative verify step (accepted drafts + the target's own token)."""
        return (self.spec_accepted + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0


@dataclass(slots=True)
class RequestOutput:
    """The result of one request: token ids, text and why it finished."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    token_bytes: dict[int, bytes] | None = field(default=None, repr=False)
    finished: bool = True
    prompt_logits: object | None = field(default=None, repr=False)
    samples: list[RequestOutput] | None = None  # n > 1: the n sequences (the fields above are samples[0]'s)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class EmbeddingOutput:
    """The result of one embedding request: the pooled vector (None if it failed or was aborted)."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float] | None
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None
    finished: bool = True
    # several inputs: one output each, in order (the fields above: items[0])
    items: list[EmbeddingOutput] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Input tokens over every input of the request."""
        return sum(len(o.prompt_token_ids) for o in self.items or [self])


@dataclass(slots=True)
class ClassificationOutput:
    """The result of one classify or score request: class probabilities (a single-label head: its sigmoid),
    None if it failed or was aborted."""

    request_id: str
    prompt_token_ids: list[int]
    probs: list[float] | None
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None
    finished: bool = True
    items: list[ClassificationOutput] | None = None  # several inputs: one output each, in order
    labels: list[str] | None = None  # the classifier's id2label, in class order
    thresholds: dict[str, float] | None = None  # EngineConfig.moderation_thresholds

    @property
    def score(self) -> float | None:
        """A cross-encoder's relevance score (vLLM's ScoringOutput.score): its single label's probability."""
        return None if self.probs is None else self.probs[0]

    @property
    def num_prompt_tokens(self) -> int:
        """Input tokens over every input of the request."""
        return sum(len(o.prompt_token_ids) for o in self.items or [self])
