"""Worker command-line flags generated from `EngineConfig`'s fields: names, types, defaults and help."""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import json
import types
import typing
from typing import Any

import typer

from sluice.engine.config import EngineConfig

SKIPPED = {"model", "extra"}  # --model is the worker's own option; `extra` is for Python callers only
SCALARS = (str, int, float, bool)


def field_help(name: str) -> str:
    """The help of one EngineConfig field (its metadata, else its attribute docstring)."""
    f = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
    return f.metadata.get("help") or field_docs(EngineConfig).get(name, "")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (a string literal right below a field), by field name (its
    module's source parsed once: inspect.getsource's search for the class costs a worker's start more than the
    parse)."""
    try:
        with open(inspect.getsourcefile(cls) or "", encoding="utf-8") as f:
            tree = ast.parse(f.read())
        body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    except (OSError, TypeError, SyntaxError, StopIteration):
        return {}
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _unwrap_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def is_json(hint: Any) -> bool:
    """Whether a field's values travel as JSON text on the command line (dicts, lists, nested configs)."""
    hint = _unwrap_optional(hint)
    return not (hint in SCALARS or typing.get_origin(hint) is typing.Literal or _is_enum(hint))


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def _option(f: dataclasses.Field, hint: Any, doc: str) -> tuple[Any, typer.models.OptionInfo]:
    """The annotation and typer option for one field; the default shown is the config's own."""
    hint = _unwrap_optional(hint)
    flag = "--" + f.name.replace("_", "-")
    help_text = f.metadata.get("help") or doc or None
    shown = f.default not in (dataclasses.MISSING, None) and str(f.default)
    if hint is bool:
        return bool | None, typer.Option(None, f"{flag}/--no-{flag[2:]}", help=help_text, show_default=shown)
    if typing.get_origin(hint) is typing.Literal:
        hint = enum.Enum(f.name, {str(c): c for c in typing.get_args(hint)})  # typer shows an Enum's choices
    if hint in SCALARS or _is_enum(hint):
        return hint | None, typer.Option(None, flag, help=help_text, show_default=shown)
    return str | None, typer.Option(None, flag, help=help_text or "JSON", show_default=shown)


def _settable() -> list[dataclasses.Field]:
    """EngineConfig's fields that are worker flags."""
    return [f for f in dataclasses.fields(EngineConfig) if f.init and f.name not in SKIPPED]


def parameters() -> list[inspect.Parameter]:
    """One keyword parameter (default None: the config decides) per settable EngineConfig field."""
    hints = typing.get_type_hints(EngineConfig)
    docs = field_docs(EngineConfig)
    out = []
    for f in _settable():
        annotation, option = _option(f, hints[f.name], docs.get(f.name, ""))
        out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                     annotation=annotation))
    return out


def engine_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """Pop the engine flags out of a command's options: those given, JSON ones parsed, for `LLM(model,
    **kw)`."""
    hints = typing.get_type_hints(EngineConfig)
    names = [f.name for f in _settable()]
    given = {name: options.pop(name, None) for name in names}
    out = {}
    for name, value in given.items():
        if value is None:
            continue
        if isinstance(value, enum.Enum):
            value = value.value
        elif is_json(hints[name]) and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise typer.BadParameter(
                    f"not valid JSON: {exc}", param_hint=f"--{name.replace('_', '-')}"
                ) from None
        out[name] = value
    return out
