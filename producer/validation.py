"""Up-front validation of batch input: JSON, schema, duplicate custom_id and size limits, per line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from contract.schemas import BODIES, InputLine, LineError, Request
from contract.settings import Settings
from contract.storage import read_url

MAX_ERRORS = 1000
Input = str | Path | bytes | Iterable[dict[str, Any] | str | bytes]


@dataclass
class Validated:
    """The outcome of checking every line: the good requests and the line-numbered errors."""

    requests: list[Request] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)
    num_errors: int = 0

    def add_error(self, error: LineError) -> None:
        self.num_errors += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(error)


def input_lines(source: Input, settings: Settings) -> Iterator[bytes]:
    """Raw lines of a JSONL path or URL (file://, s3://), of bytes, or of an in-memory list."""
    if isinstance(source, bytes):
        yield from source.splitlines()
    elif isinstance(source, str | Path):
        yield from read_source(str(source), settings.max_input_bytes).splitlines()
    else:
        for item in source:
            yield (
                item
                if isinstance(item, bytes)
                else (item if isinstance(item, str) else json.dumps(item)).encode()
            )


def read_source(source: str, max_bytes: int) -> bytes:
    """Bytes of a local path or storage URL, refusing anything over max_bytes."""
    data = read_url(source, max_bytes=max_bytes)
    if len(data) > max_bytes:
        raise ValueError(
            f"input {source} is larger than the limit of {max_bytes} bytes (SLUICE_MAX_INPUT_BYTES)"
        )
    return data


def validate_lines(lines: Iterable[bytes], settings: Settings) -> Validated:
    """Check every line; collect requests and errors (nothing is silently dropped)."""
    out, seen = Validated(), {}
    total_bytes = 0
    for number, raw in enumerate(lines, start=1):
        total_bytes += len(raw) + 1
        if total_bytes > settings.max_input_bytes:
            out.add_error(
                _limit_error("input_too_large", number, f"input exceeds {settings.max_input_bytes} bytes")
            )
            break
        if not raw.strip():
            continue
        if len(out.requests) + out.num_errors >= settings.max_lines:
            out.add_error(_limit_error("too_many_lines", number, f"more than {settings.max_lines} requests"))
            break
        request = _check_line(raw, number, settings, out)
        if request is None:
            continue
        if request.custom_id in seen:
            out.add_error(
                LineError(
                    code="duplicate_custom_id",
                    line=number,
                    param="custom_id",
                    message=f"custom_id {request.custom_id!r} already used on line {seen[request.custom_id]}",
                )
            )
            continue
        seen[request.custom_id] = number
        out.requests.append(request)
        out.sizes.append(len(raw))
    if not out.requests and not out.num_errors:
        out.add_error(LineError(code="empty_file", message="the input holds no requests"))
    if out.num_errors > len(out.errors):
        out.errors.append(
            LineError(code="too_many_errors", message=f"{out.num_errors} errors; first {MAX_ERRORS} shown")
        )
    return out


def _limit_error(code: str, line: int, what: str) -> LineError:
    return LineError(
        code=code, line=line, message=f"{what} (line {line}); split the input or raise the limit"
    )


def _check_line(raw: bytes, number: int, settings: Settings, out: Validated) -> Request | None:
    if len(raw) > settings.max_line_bytes:
        message = (
            f"line is {len(raw)} bytes, over the limit of {settings.max_line_bytes} (SLUICE_MAX_LINE_BYTES)"
        )
        out.add_error(LineError(code="line_too_large", line=number, message=message))
        return None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        out.add_error(
            LineError(code="invalid_json", line=number, message=f"line {number} is not valid JSON: {exc}")
        )
        return None
    try:
        line = InputLine.model_validate(data)
        body = BODIES[line.url].model_validate(line.body)
    except ValidationError as exc:
        prefix = "" if exc.title == InputLine.__name__ else "body."
        out.add_error(_schema_error(exc, number, prefix))
        return None
    return Request(custom_id=line.custom_id, url=line.url, body=body.model_dump(exclude_defaults=True))


def _schema_error(exc: ValidationError, number: int, prefix: str) -> LineError:
    first = exc.errors()[0]
    param = prefix + ".".join(str(p) for p in first["loc"]) if first["loc"] else prefix.rstrip(".") or None
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    message = f"line {number}: {param or 'line'}: {first['msg']}{more}"
    return LineError(code="invalid_request", line=number, param=param, message=message)
