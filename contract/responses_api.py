"""OpenAI's Responses API as a batch endpoint: a `/v1/responses` body mapped onto the chat machinery
(messages from `instructions` and `input`, function tools, `text.format` as response_format) and the Response
object built from the engine's output (`message` and `function_call` items, usage)."""

from __future__ import annotations

import reprlib
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sluice.contract.tools import parse_tool_calls

if TYPE_CHECKING:
    from sluice.contract.schemas import ChatBody

RESPONSES = "/v1/responses"
MAX_OUTPUT_TOKENS = 1_000_000
MAX_INPUT_ITEMS = 4096
Finite = Annotated[float, Field(allow_inf_nan=False)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]

# Responses fields Sluice does not serve: the values meaning "not used" (accepted), why others are refused.
UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((None,), "responses are not stored; send the whole conversation as input"),
    "conversation": ((None,), "conversations are not stored; send the whole conversation as input"),
    "store": (
        (None, False),
        "responses are not stored for later retrieval; the batch output file holds them",
    ),
    "background": (
        (None, False),
        "background responses are stored to be polled; a batch keeps its output file",
    ),
    "stream": ((None, False), "batch lines do not stream"),
    "stream_options": ((None,), "batch lines do not stream"),
    "reasoning": ((None,), "the engine has no reasoning controls"),
    "include": ((None, []), "no extra output (logprobs, encrypted reasoning, tool sources) is produced"),
    "prompt": ((None,), "prompt templates are not stored here; put the text in instructions and input"),
    "top_logprobs": ((None, 0), "output_text carries no logprobs"),
    "max_tool_calls": ((None,), "it limits built-in tool calls, and only function tools are offered"),
    "truncation": ((None, "disabled"), "the input is never truncated; an input over the context is an error"),
}


class InputText(BaseModel):
    """A text part of an input message."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text"]
    text: str


class OutputText(BaseModel):
    """A text part of an earlier assistant message given back as input."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class InputImage(BaseModel):
    """An image part of an input message: refused while the engine takes text only."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] = "auto"

    @model_validator(mode="after")
    def _not_served(self) -> InputImage:
        raise ValueError("input_image parts are not served: the engine takes text input only")


ContentPart = Annotated[InputText | OutputText | InputImage, Field(discriminator="type")]


class MessageItem(BaseModel):
    """A message of `input`: OpenAI's EasyInputMessage, or an output message given back."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        return [{"type": "input_text", "text": v}] if isinstance(v, str) else v

    def text(self) -> str:
        """The content as plain text."""
        return "".join(part.text for part in self.content if isinstance(part, InputText | OutputText))


class FunctionCallItem(BaseModel):
    """An earlier function call given back as input."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutput(BaseModel):
    """The result of an earlier function call."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: str
    id: str | None = None
    status: ItemStatus | None = None


def _item_type(v: Any) -> str | None:
    return v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    """A function the model may call, in the Responses shape (name and parameters at the top level)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _functions_only(cls, v: Any) -> Any:
        if v != "function":
            raise ValueError(f"tools of type {v!r} are not served: only function tools are")
        return v

    def chat_tool(self) -> dict[str, Any]:
        """The tool in chat completions' shape."""
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(BaseModel):
    """tool_choice naming one function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class TextFormat(BaseModel):
    """text.format: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_fields(self) -> TextFormat:
        given = [n for n in ("name", "schema_", "description", "strict") if getattr(self, n) is not None]
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("text.format of type json_schema needs name and schema")
        if self.type != "json_schema" and given:
            raise ValueError(f"text.format of type {self.type} takes no {given[0].rstrip('_')}")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """The format as chat completions' response_format (None for plain text)."""
        if self.type != "json_schema":
            return None if self.type == "text" else {"type": self.type}
        spec = {
            "name": self.name,
            "schema": self.schema_,
            "strict": self.strict,
            "description": self.description,
        }
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(BaseModel):
    """The `text` field: the output's format."""

    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None


class ResponsesBody(BaseModel):
    """Body of a POST /v1/responses request; a field Sluice does not serve is refused by name."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256)
    input: list[InputItem] = Field(min_length=1, max_length=MAX_INPUT_ITEMS)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    temperature: Finite | None = Field(None, ge=0, le=2)
    top_p: Finite | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = (
        Field(None, max_length=16)
    )
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    previous_response_id: Any = None
    conversation: Any = None
    store: Any = None
    background: Any = None
    stream: Any = None
    stream_options: Any = None
    reasoning: Any = None
    include: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    truncation: Any = None
    _chat: ChatBody | None = PrivateAttr(None)

    @field_validator("input", mode="before")
    @classmethod
    def _one_user_message(cls, v: Any) -> Any:
        if isinstance(v, str) and not v:
            raise ValueError("input must not be empty")
        return [{"role": "user", "content": v}] if isinstance(v, str) else v

    @field_validator(*UNSERVED, mode="before")
    @classmethod
    def _unserved(cls, v: Any, info: ValidationInfo) -> Any:
        accepted, why = UNSERVED[info.field_name]
        if any(type(v) is type(a) and v == a for a in accepted):
            return v
        raise ValueError(f"{info.field_name}={reprlib.repr(v)} is not served: {why}")

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(
                f"tool_choice of type {v.get('type')!r} is not served: give none, auto, required "
                'or {"type": "function", "name": ...}'
            )
        return v

    @model_validator(mode="after")
    def _maps_onto_chat(self) -> ResponsesBody:
        try:
            self.chat()
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(
                f"{where + ': ' if where else ''}{first['msg'].removeprefix('Value error, ')}"
            ) from None
        return self

    def chat(self) -> ChatBody:
        """The request as a chat completions body (built and validated once)."""
        if self._chat is None:
            from sluice.contract.schemas import ChatBody  # schemas imports this module to register its body

            self._chat = ChatBody.model_validate(self.chat_fields())
        return self._chat

    def chat_fields(self) -> dict[str, Any]:
        """The chat completions fields this body means."""
        fmt = self.text.format if self.text is not None else None
        fields = {
            "model": self.model,
            "messages": self.messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": [t.chat_tool() for t in self.tools] if self.tools else None,
            "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": fmt.response_format() if fmt is not None else None,
            "user": self.user,
        }
        return {k: v for k, v in fields.items() if v is not None}

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """tool_choice in chat completions' shape."""
        if isinstance(self.tool_choice, FunctionChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def text_config(self) -> dict[str, Any]:
        """`text` as the Response echoes it (plain text when not given)."""
        fmt = self.text.format if self.text is not None else None
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}

    def messages(self) -> list[dict[str, Any]]:
        """Chat messages: instructions as the system message, then the input items in order (a function call
        joins the assistant message before it, as chat's tool_calls)."""
        out: list[dict[str, Any]] = (
            [{"role": "system", "content": self.instructions}] if self.instructions else []
        )
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallOutput):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if not (out and out[-1]["role"] == "assistant"):
                    out.append({"role": "assistant", "content": None})
                out[-1].setdefault("tool_calls", []).append(call)
        return out


def response_object(body: ResponsesBody, out: Any, model: str) -> dict[str, Any]:
    """OpenAI's Response object for one finished /v1/responses request: `incomplete` when it ran out of
    max_output_tokens, `completed` otherwise."""
    incomplete = out.finish_reason == "length"
    chat = body.chat()
    now = int(time.time())
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": now,
        "status": "incomplete" if incomplete else "completed",
        "completed_at": None if incomplete else now,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model or model,
        "output": output_items(body, out, "incomplete" if incomplete else "completed"),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "temperature": chat.temperature,
        "top_p": chat.top_p,
        "text": body.text_config(),
        "tool_choice": body.tool_choice.model_dump()
        if isinstance(body.tool_choice, FunctionChoice)
        else body.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "truncation": "disabled",
        "usage": response_usage(out),
        "metadata": body.metadata or {},
        **({"user": body.user} if body.user is not None else {}),
        **({"safety_identifier": body.safety_identifier} if body.safety_identifier is not None else {}),
    }


def output_items(body: ResponsesBody, out: Any, status: ItemStatus) -> list[dict[str, Any]]:
    """The reply as output items: a `message` with its text (when there is text, or no call), then one
    `function_call` per tool call parsed out of it."""
    chat = body.chat()
    content, calls = parse_tool_calls(out.text, chat.tools or [], chat.chosen_tools())
    items = []
    if content is not None or not calls:
        items.append(
            {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": content or "", "annotations": []}],
            }
        )
    for call in calls:
        items.append(
            {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": status,
            }
        )
    return items


def response_usage(out: Any) -> dict[str, Any]:
    """The Response's usage: prompt tokens as input_tokens (those the prefix cache held as cached_tokens)."""
    prompt, generated = len(out.prompt_token_ids), len(out.token_ids)
    metrics = getattr(out, "metrics", None)
    cached = getattr(metrics, "num_cached_tokens", 0) or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


def output_text(body: dict[str, Any]) -> str:
    """A Response body's reply as text: its output_text parts, else its function calls as name(arguments)."""
    items = body.get("output") or []
    text = "".join(
        part["text"]
        for item in items
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    calls = [f"{item['name']}({item['arguments']})" for item in items if item["type"] == "function_call"]
    return text or " ".join(calls)
