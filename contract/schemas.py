"""The job contract: OpenAI Batch input lines, request bodies, output records and the Batch object."""

from __future__ import annotations

import json
import uuid
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from sluice.contract.moderations import MODERATIONS, ModerationBody
from sluice.contract.rerank import RERANK, SCORE, RerankBody, ScoreBody
from sluice.contract.responses_api import RESPONSES, ResponsesFields
from sluice.contract.tools import NamedToolChoice, Tool, ToolChoice, named_tool, tool_constraint

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
Priority = Literal["high", "default", "low"]


MAX_TOP_K = 1_000_000
MAX_STOP_CHARS = 1024
MAX_TOKENS = 1_000_000
MAX_N = 128
Finite = Annotated[float, Field(allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
MAX_IMAGE_URL_CHARS = 30_000_000


class BodyError(ValueError):
    """A body problem that no single field's validator sees, naming the parameter it concerns."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(BaseModel):
    """The json_schema member of response_format."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: the output is constrained to JSON (any object, or the schema given)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> dict[str, Any] | None:
        """The engine's structured_outputs for this format (None for plain text)."""
        if self.type == "json_object":
            return {"json": True}
        if self.type == "json_schema":
            if self.json_schema is None:
                raise BodyError("response_format.json_schema",
                                "response_format of type json_schema needs json_schema")
            return {"json": self.json_schema.schema_ or {}}
        return None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs extra body field: exactly one of json, regex, choice, grammar."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | bool | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=10_000)
    choice: list[str] | None = Field(None, min_length=1, max_length=1000)
    grammar: str | None = Field(None, max_length=100_000)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [n for n in ("json_", "regex", "choice", "grammar") if getattr(self, n) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar")
        return self

    def structured(self) -> dict[str, Any]:
        """The engine's structured_outputs keyword arguments."""
        return {"json" if k == "json_" else k: v for k, v in self.model_dump().items()
                if v not in (None, False)}


class SamplingBody(BaseModel):
    """Fields shared by completion and chat bodies; unknown fields are refused by name."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256)
    temperature: Finite = Field(1.0, ge=0, le=2)
    top_p: Finite = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)
    min_p: Finite = Field(0.0, ge=0, le=1)
    seed: Seed | None = None
    stop: StopText | list[StopText] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stream: Literal[False] = False
    user: str | None = Field(None, max_length=256)
    presence_penalty: Finite = Field(0.0, ge=-2, le=2)
    frequency_penalty: Finite = Field(0.0, ge=-2, le=2)
    repetition_penalty: Finite = Field(1.0, gt=0, le=10)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    logit_bias: dict[str, Annotated[Finite, Field(ge=-100, le=100)]] | None = Field(None, max_length=300)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    service_tier: str | None = Field(None, max_length=64)
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    stream_options: None = None

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v and not all(k.isascii() and k.isdigit() and len(k) <= 10 for k in v):
            raise ValueError("logit_bias keys must be token ids (decimal digits)")
        return v

    @model_validator(mode="after")
    def _one_structure(self) -> SamplingBody:
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise BodyError("structured_outputs", "give response_format or structured_outputs, not both")
        if self.response_format is not None:
            self.response_format.structured()
        best_of = getattr(self, "best_of", None)
        if best_of is not None and best_of < self.n:
            raise BodyError("best_of", f"best_of ({best_of}) must be >= n ({self.n})")
        limit = self.max_new_tokens()
        if limit is not None and self.min_tokens > limit:
            raise BodyError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({limit})")
        return self

    def structured(self) -> dict[str, Any] | None:
        """The engine's structured_outputs (from response_format or the structured_outputs extra field)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.structured()
        return self.response_format.structured() if self.response_format is not None else None

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for engine.SamplingParams."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return dict(
            max_tokens=self.max_new_tokens(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            min_tokens=self.min_tokens,
            structured_outputs=self.structured(),
            n=self.n,
            best_of=getattr(self, "best_of", None),
        )

    def max_new_tokens(self) -> int | None:
        raise NotImplementedError

    def num_logprobs(self) -> int | None:
        raise NotImplementedError


class CompletionBody(SamplingBody):
    """Body of a POST /v1/completions request."""

    prompt: str | list[TokenId]
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS)
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    echo: Literal[False] = False
    suffix: None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise ValueError("prompt must be one string or one list of token ids (one prompt per line)")
        if not v:
            raise ValueError("prompt must not be empty")
        return v

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    """A text part of a chat message's content."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    """The image_url member of an image part: a data:, file://, s3:// or https:// URL and a detail hint."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=MAX_IMAGE_URL_CHARS)
    detail: Literal["low", "high", "auto"] = "auto"


class ImagePart(BaseModel):
    """An image part of a chat message's content (OpenAI's image_url content part)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    """The function of a tool call in an earlier assistant message."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """A tool call in an earlier assistant message."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        return self

    def text(self) -> str:
        """The message content as plain text."""
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (tool calls and tool results included)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.image_urls():
            out["content"] = [{"type": "image"} if isinstance(p, ImagePart) else p.model_dump()
                              for p in self.content or []]
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class ChatBody(SamplingBody):
    """Body of a POST /v1/chat/completions request."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tools(self) -> ChatBody:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise BodyError("tool_choice", "tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            try:
                named_tool(self.tools or [], self.tool_choice)
            except ValueError as exc:
                raise BodyError("tool_choice.function.name", str(exc)) from None
        if self.tool_constraint() is not None and (self.structured_outputs or self.response_format):
            message = "a forced tool_choice cannot be combined with response_format or structured_outputs"
            raise BodyError("tool_choice", message)
        return self

    def image_parts(self) -> list[tuple[str, str]]:
        """(name, url) of every image part in order, named messages[i].content[j] for per-part errors."""
        return [(f"messages[{i}].content[{j}]", part.image_url.url)
                for i, m in enumerate(self.messages) if isinstance(m.content, list)
                for j, part in enumerate(m.content) if isinstance(part, ImagePart)]

    def chosen_tools(self) -> ToolChoice:
        """tool_choice as OpenAI defaults it: auto when tools are given, none otherwise."""
        return self.tool_choice or ("auto" if self.tools else "none")

    def tool_constraint(self) -> dict[str, Any] | None:
        """structured_outputs a forced tool_choice implies."""
        return tool_constraint(self.tools, self.chosen_tools()) if self.tools else None

    def structured(self) -> dict[str, Any] | None:
        return self.tool_constraint() or super().structured()

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (none when tool_choice is none)."""
        if not self.tools or self.chosen_tools() == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def plain_messages(self) -> list[dict[str, Any]]:
        """Messages as dicts for a chat template ({role, content}, plus tool calls and results)."""
        return [m.for_template() for m in self.messages]


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request


class EmbeddingBody(BaseModel):
    """Body of a POST /v1/embeddings request: one embedding per input, in order."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = Field(None, max_length=256)
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = Field(None, max_length=256)

    @field_validator("input")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else v
        if not items or any(not item for item in items):
            raise ValueError("input must not be empty, nor contain an empty string or list")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        return v


class ResponsesBody(ResponsesFields):
    """Body of a POST /v1/responses request: valid when it maps onto a chat completions body."""

    _chat: ChatBody | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _maps_onto_chat(self) -> ResponsesBody:
        try:
            self.chat()
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            raise ValueError(f"{where + ': ' if where else ''}{message}") from None
        return self

    def chat(self) -> ChatBody:
        """The request as a chat completions body (built and validated once)."""
        if self._chat is None:
            self._chat = ChatBody.model_validate(self.chat_fields())
        return self._chat


BODIES: dict[str, type[BaseModel]] = {
    COMPLETIONS: CompletionBody, CHAT: ChatBody, EMBEDDINGS: EmbeddingBody, RESPONSES: ResponsesBody,
    RERANK: RerankBody, SCORE: ScoreBody, MODERATIONS: ModerationBody,
}


class InputLine(BaseModel):
    """One line of an OpenAI Batch input file."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: Literal["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/rerank",
                 "/v1/score", "/v1/moderations"]
    body: dict[str, Any]


class BatchRequest(BaseModel):
    """The one request type across layers: made once at the edge from a line the producer validated
    (`from_line`), carried as compact JSON in its shard job, rebuilt by the worker with `trusted` (not
    validated again); its typed body is built at most once per process (`parsed_body`)."""

    custom_id: str
    url: str
    body: dict[str, Any]
    record: dict[str, Any] | None = None
    _typed: SamplingBody | EmbeddingBody | None = PrivateAttr(None)

    @classmethod
    def from_line(cls, line: InputLine, body: SamplingBody) -> BatchRequest:
        """The request of a validated input line and its validated body (defaults left out of the JSON)."""
        request = cls.model_construct(custom_id=line.custom_id, url=line.url,
                                      body=body.model_dump(exclude_defaults=True, by_alias=True))  # fmt: skip
        request._typed = body
        return request

    @classmethod
    def answered(cls, url: str, record: OutputRecord) -> BatchRequest:
        """A line whose record is already known (a body the producer refused with a 400, or a line a resumed
        batch carries over finished): the worker writes the record as it is and runs nothing."""
        return cls.model_construct(custom_id=record.custom_id, url=url, body={},
                                   record=record.model_dump(mode="json"))  # fmt: skip

    @classmethod
    def trusted(cls, data: dict[str, Any]) -> BatchRequest:
        """A request from a shard job's JSON, which the producer validated: constructed, not validated
        again."""
        return cls.model_construct(custom_id=data["custom_id"], url=data["url"], body=data["body"],
                                   record=data.get("record"))  # fmt: skip

    def __eq__(self, other: object) -> bool:
        """Equal when the fields are (whether the typed body was built yet does not count)."""
        if not isinstance(other, BatchRequest):
            return NotImplemented
        fields = ("custom_id", "url", "body", "record")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def answer(self) -> OutputRecord | None:
        """The record this request already has (see `answered`), None when it is to run."""
        return None if self.record is None else OutputRecord.model_validate(self.record)

    def parsed_body(self) -> SamplingBody | EmbeddingBody:
        """The body as its typed model (nested models need a validation to build), built once and kept."""
        if self._typed is None:
            self._typed = BODIES[self.url].model_validate(self.body)
        return self._typed


class ErrorInfo(BaseModel):
    """Why a request produced no response."""

    code: str
    message: str


class Response(BaseModel):
    """An HTTP-style response to one request."""

    status_code: int
    request_id: str
    body: dict[str, Any]


class OutputRecord(BaseModel):
    """One line of output.jsonl or errors.jsonl."""

    id: str
    custom_id: str
    response: Response | None = None
    error: ErrorInfo | None = None

    @classmethod
    def rejected(cls, custom_id: str, code: str, message: str, param: str | None = None,
                 status_code: int = 400) -> OutputRecord:
        """A request answered with an HTTP error, as OpenAI writes it: `response` holds the status and
        OpenAI's error body; `error` repeats its code and message (so a reader of either finds them)."""
        kind = "invalid_request_error" if status_code < 500 else "server_error"
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
        response = Response(status_code=status_code, request_id=f"req_{uuid.uuid4().hex}", body=body)
        return cls(id=record_id(), custom_id=custom_id, response=response,
                   error=ErrorInfo(code=code, message=message))  # fmt: skip


def record_id() -> str:
    """A fresh output record id in OpenAI's style."""
    return f"batch_req_{uuid.uuid4().hex}"


class LineError(BaseModel):
    """A validation problem with one input line (line numbers start at 1)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class RequestCounts(BaseModel):
    """How many requests a batch has, and how many finished each way."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchStatus(StrEnum):
    """OpenAI Batch statuses."""

    validating = "validating"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    failed = "failed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


TERMINAL = frozenset({BatchStatus.completed, BatchStatus.failed, BatchStatus.expired, BatchStatus.cancelled})


class Batch(BaseModel):
    """A submitted batch: status, counts, timestamps (unix seconds) and where its files live."""

    id: str
    object: Literal["batch"] = "batch"
    status: BatchStatus = BatchStatus.validating
    input_file: str = ""
    output_url: str = ""
    output_file: str | None = None
    error_file: str | None = None
    priority: Priority = "default"
    completion_window: str = "24h"
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] = Field(default_factory=dict)
    errors: list[LineError] = Field(default_factory=list)
    webhook: str | None = None
    idempotency_key: str | None = None
    resumed_from: str | None = None
    output_expires_at: float | None = None
    num_shards: int = 0
    created_at: float = 0.0
    expires_at: float | None = None
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None

    @property
    def done(self) -> bool:
        """True once the batch reached a terminal status."""
        return self.status in TERMINAL
