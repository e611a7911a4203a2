"""Up-front validation of batch input, as OpenAI's: the file is refused as a whole only when it is unusable
(not JSONL, a line missing `custom_id`/`method`/`url`/`body`, duplicate custom_ids, lines whose urls differ,
size and line limits; the server also refuses a file whose url is not the batch's endpoint); a body's bad
parameter is that line's own 400 record, carried with the line, and the other lines run."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, overload

from pydantic import ValidationError

from sluice.contract.schemas import (
    BODIES,
    BatchRequest,
    BodyError,
    EmbeddingBody,
    InputLine,
    LineError,
    OutputRecord,
    SamplingBody,
)
from sluice.contract.settings import Settings
from sluice.contract.storage import url_lines
from sluice.engine.json_schema import GrammarError, check_schema

MAX_ERRORS = 1000
MAX_DEPTH = 32
Input = str | Path | bytes | Iterable[dict[str, Any] | str | bytes]


class Requests(Sequence[BatchRequest]):
    """Validated requests kept as their compact JSON (a 50 MiB input stays about 50 MiB), decoded on
    access."""

    def __init__(self, items: list[bytes] | None = None) -> None:
        self.items = [] if items is None else items

    def append(self, request: BatchRequest) -> None:
        self.items.append(request.model_dump_json(exclude_defaults=True).encode())

    def __len__(self) -> int:
        return len(self.items)

    @overload
    def __getitem__(self, i: int) -> BatchRequest: ...

    @overload
    def __getitem__(self, i: slice) -> Requests: ...

    def __getitem__(self, i: int | slice) -> BatchRequest | Requests:
        if isinstance(i, slice):
            return Requests(self.items[i])
        return BatchRequest.trusted(json.loads(self.items[i]))

    @property
    def nbytes(self) -> int:
        """Bytes of JSON held."""
        return sum(len(item) for item in self.items)


class RequestSink(Protocol):
    """Where validated requests go: kept (Requests) or streamed to storage (sharding.InputSpool)."""

    def append(self, request: BatchRequest) -> None: ...

    def __len__(self) -> int: ...


@dataclass
class Validated:
    """The outcome of checking every line: the requests (those with a refused body carry their 400 record) and
    the file-level, line-numbered errors that refuse the whole file."""

    requests: RequestSink = field(default_factory=Requests)
    sizes: list[int] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)
    num_errors: int = 0
    num_line_errors: int = 0

    @property
    def num_lines(self) -> int:
        """Lines checked: each became a request or a line-numbered error (file-level errors aside)."""
        return len(self.requests) + self.num_line_errors

    def add_error(self, error: LineError) -> None:
        self.num_errors += 1
        self.num_line_errors += error.line is not None
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(error)


def input_lines(source: Input, settings: Settings) -> Iterator[bytes]:
    """Raw lines of a JSONL path or URL (file://, s3://) streamed in chunks, of bytes, or of an in-memory
    list."""
    if isinstance(source, bytes):
        yield from source.splitlines()
    elif isinstance(source, str | Path):
        yield from url_lines(str(source), settings.max_input_bytes, settings.max_line_bytes,
                             s3_style=settings.s3_addressing_style)
    else:
        for item in source:
            yield (
                item
                if isinstance(item, bytes)
                else (item if isinstance(item, str) else json.dumps(item)).encode()
            )


def validate_lines(
    lines: Iterable[bytes], settings: Settings, into: RequestSink | None = None,
    answered: Mapping[str, OutputRecord] | None = None,
) -> Validated:
    """Check every line once, as it streams by: requests go `into` a sink (default: kept), errors listed
    (nothing is silently dropped). A line whose custom_id has a record in `answered` (a resumed batch's
    finished line) carries that record instead of running again."""
    out, seen, first_url = Validated(requests=Requests() if into is None else into), {}, _FirstUrl()
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
        if (request is None or not _first_use(request.custom_id, number, seen, out)
                or not first_url.matches(request.url, number, out)):
            continue
        if answered and request.custom_id in answered:
            request = BatchRequest.answered(request.url, answered[request.custom_id])
        out.requests.append(request)
        out.sizes.append(len(raw))
    if not out.requests and not out.num_errors:
        out.add_error(LineError(code="empty_file", message="the input holds no requests"))
    if out.num_errors > len(out.errors):
        out.errors.append(
            LineError(code="too_many_errors", message=f"{out.num_errors} errors; first {MAX_ERRORS} shown")
        )
    return out


def _first_use(custom_id: str, number: int, seen: dict[str, int], out: Validated) -> bool:
    """Note custom_id's line; False, with a duplicate_custom_id error, when an earlier line used it."""
    if custom_id not in seen:
        seen[custom_id] = number
        return True
    message = f"line {number}: custom_id {custom_id!r} already used on line {seen[custom_id]}"
    out.add_error(LineError(code="duplicate_custom_id", line=number, param="custom_id", message=message))
    return False


@dataclass
class _FirstUrl:
    """The url of the file's first request line, which every later line must name too."""

    url: str | None = None
    line: int = 0

    def matches(self, url: str, number: int, out: Validated) -> bool:
        """True for the first url and lines repeating it; else False, with an invalid_url error."""
        if self.url is None:
            self.url, self.line = url, number
        if url == self.url:
            return True
        message = (
            f"line {number}: url {url!r} differs from {self.url!r} of line {self.line}; a batch's lines all "
            "target one endpoint: split the file by url, one batch per url"
        )
        out.add_error(LineError(code="invalid_url", line=number, param="url", message=message))
        return False


def _limit_error(code: str, line: int, what: str) -> LineError:
    return LineError(
        code=code, line=line, message=f"{what} (line {line}); split the input or raise the limit"
    )


def _check_line(raw: bytes, number: int, settings: Settings, out: Validated) -> BatchRequest | None:
    if len(raw) > settings.max_line_bytes:
        message = (
            f"line {number} is over the limit of {settings.max_line_bytes} bytes (SLUICE_MAX_LINE_BYTES)"
        )
        out.add_error(LineError(code="line_too_large", line=number, message=message))
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        reason = f"nested deeper than {MAX_DEPTH} levels" if isinstance(exc, RecursionError) else exc
        out.add_error(
            LineError(code="invalid_json", line=number, message=f"line {number} is not valid JSON: {reason}")
        )
        return None
    if _depth(data) > MAX_DEPTH:
        message = f"line {number}: JSON nested deeper than {MAX_DEPTH} levels"
        out.add_error(LineError(code="too_deep", line=number, message=message))
        return None
    try:
        line = InputLine.model_validate(data)
    except ValidationError as exc:
        out.add_error(_schema_error(exc, number))
        return None
    return _check_body(line, number, settings)


def _check_body(line: InputLine, number: int, settings: Settings) -> BatchRequest:
    """The line's request; one whose body is refused carries its 400 record instead of running."""
    try:
        body = BODIES[line.url].model_validate(line.body)
    except ValidationError as exc:
        return BatchRequest.answered(line.url, _body_error(exc, line.custom_id, number))
    refused = _unenforceable_schema(body)
    if refused is not None:
        param, reason = refused
        message = f"line {number}: {param}: {reason}"
        record = OutputRecord.rejected(line.custom_id, "invalid_value", message, param)
        return BatchRequest.answered(line.url, record)
    served = settings.served_model_names()
    if served and body.model is not None and body.model not in served:
        message = f"line {number}: model: model {body.model!r} is not served (served: {', '.join(served)})"
        record = OutputRecord.rejected(line.custom_id, "model_not_found", message, "model")
        return BatchRequest.answered(line.url, record)
    return BatchRequest.from_line(line, body)


def _unenforceable_schema(body: SamplingBody | EmbeddingBody) -> tuple[str, str] | None:
    """(param, reason) when the body's JSON schema uses a keyword the grammar engine would not enforce (the
    worker would refuse it when it compiles the grammar), else None."""
    structured = body.structured() if isinstance(body, SamplingBody) else None
    schema = (structured or {}).get("json")
    if not isinstance(schema, dict):
        return None
    try:
        check_schema(schema)
    except GrammarError as exc:
        if body.structured_outputs is not None:
            return "structured_outputs.json", str(exc)
        return ("response_format.json_schema.schema" if body.response_format else "tools"), str(exc)
    return None


def _depth(data: Any) -> int:
    """How deeply lists and objects nest in parsed JSON (a scalar is 0), without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _schema_error(exc: ValidationError, number: int) -> LineError:
    """A file-level error for a line that is not an OpenAI batch line."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    message = f"line {number}: {param or 'line'}: {first['msg']}{more}"
    return LineError(code="invalid_request", line=number, param=param, message=message)


CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}


def _body_error(exc: ValidationError, custom_id: str, number: int) -> OutputRecord:
    """The 400 record of a refused body: OpenAI's error body, `param` the path of the first bad field in
    it."""
    first = exc.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    param = cause.param if isinstance(cause, BodyError) else ".".join(str(p) for p in first["loc"]) or None
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    reason = str(cause) if isinstance(cause, ValueError) else first["msg"]
    message = f"line {number}: {param or 'body'}: {reason}{more}"
    return OutputRecord.rejected(custom_id, CODES.get(first["type"], "invalid_value"), message, param)
