"""OpenAI's tools and tool_choice: the request models, the output constraint each choice implies, and tool
calls parsed out of generated text (Hermes/Qwen `<tool_call>` JSON, Llama 3.x bare JSON)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class FunctionDef(BaseModel):
    """A function the model may call."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of `tools`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    """The function a named tool_choice forces."""

    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming one function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def tool_constraint(tools: list[Tool], choice: ToolChoice) -> dict[str, Any] | None:
    """structured_outputs for a forced choice: the named function's arguments, or for `required` one
    {"name", "arguments"} object of any tool; None for `auto` and `none`."""
    if isinstance(choice, NamedToolChoice):
        return {"json": _arguments_schema(named_tool(tools, choice))}
    if choice != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"const": t.function.name}, "arguments": _arguments_schema(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {"json": {"anyOf": calls}}


def named_tool(tools: list[Tool], choice: NamedToolChoice) -> Tool:
    """The tool a named choice refers to (ValueError when it is not among `tools`)."""
    for tool in tools:
        if tool.function.name == choice.function.name:
            return tool
    raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of message.tool_calls, as OpenAI shapes it."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, tools: list[Tool],
                     choice: ToolChoice) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a generated reply under `choice`."""
    if choice == "none":
        return text, []
    if isinstance(choice, NamedToolChoice):
        return None, [tool_call(choice.function.name, text)]
    names = {t.function.name for t in tools}
    if choice == "required":
        call = _call(text, names)
        return (None, [call]) if call else (text, [])
    calls = [c for c in (_call(m, names) for m in TOOL_CALL.findall(text)) if c]
    if calls:
        return TOOL_CALL.sub("", text).strip() or None, calls
    call = _call(text.strip(), names)
    return (None, [call]) if call else (text, [])


def _call(raw: str, names: set[str]) -> dict[str, Any] | None:
    """A tool call from one JSON object {"name", "arguments" | "parameters"} naming a known tool."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    return tool_call(data["name"], args if isinstance(args, str) else json.dumps(args))
