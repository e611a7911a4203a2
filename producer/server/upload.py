"""A multipart upload streamed to a temp file: size and line limits enforced and each line parsed as it
arrives."""

from __future__ import annotations

import json
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from python_multipart.multipart import MultipartParser, parse_options_header

from sluice.producer.server.errors import APIError

MAX_FIELD_BYTES = 64 * 1024


def bad_file(message: str, code: str = "invalid_file") -> APIError:
    return APIError(400, message, param="file", code=code)


@dataclass
class JsonlSink:
    """Receives the file part: writes it to disk, counts bytes and lines, checks that every line is JSON."""

    max_bytes: int
    max_lines: int
    max_line_bytes: int
    size: int = 0
    lines: int = 0
    endpoints: set[str] = field(default_factory=set)
    tail: bytes = b""

    def __post_init__(self) -> None:
        self.file = tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False)
        self.path = Path(self.file.name)

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.max_bytes:
            raise bad_file(f"file is larger than the limit of {self.max_bytes} bytes", "file_too_large")
        self.file.write(data)
        *complete, self.tail = (self.tail + data).split(b"\n")
        for line in complete:
            self._check(line)
        if len(self.tail) > self.max_line_bytes:
            raise bad_file(f"line {self.lines + 1} is over the limit of {self.max_line_bytes} bytes")

    def close(self) -> None:
        """Check the last line and close the file."""
        if self.tail:
            self._check(self.tail)
        self.file.close()
        if not self.lines:
            raise bad_file("file holds no requests: upload JSONL, one request per line", "empty_file")

    def discard(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)

    def _check(self, line: bytes) -> None:
        if not line.strip():
            return
        self.lines += 1
        if self.lines > self.max_lines:
            raise bad_file(f"file has more than {self.max_lines} requests", "too_many_requests")
        try:
            data = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_file(f"line {self.lines} is not valid JSON ({exc}); upload JSONL") from None
        if not isinstance(data, dict):
            raise bad_file(f"line {self.lines} is not a JSON object")
        if isinstance(data.get("url"), str):
            self.endpoints.add(data["url"][:64])


@dataclass
class Upload:
    """The parsed form: its text fields, the file part's name and its sink."""

    fields: dict[str, str]
    filename: str | None
    sink: JsonlSink


async def receive(content_type: str | None, body: AsyncIterator[bytes], sink: JsonlSink) -> Upload:
    """Parse a multipart/form-data body chunk by chunk; the part named `file` goes to sink."""
    kind, params = parse_options_header(content_type or "")
    if kind != b"multipart/form-data" or b"boundary" not in params:
        raise APIError(
            400, "expected a multipart/form-data body with `file` and `purpose`", code="invalid_body"
        )
    state = _PartState(sink)
    parser = MultipartParser(params[b"boundary"], callbacks=state.callbacks())
    async for chunk in body:
        parser.write(chunk)
    parser.finalize()
    if state.filename is None:
        raise bad_file("missing multipart field `file`")
    sink.close()
    return Upload(state.fields, state.filename, sink)


class _PartState:
    """Routes multipart parser callbacks: headers name each part; file data streams, fields are buffered."""

    def __init__(self, sink: JsonlSink) -> None:
        self.sink, self.fields, self.filename = sink, {}, None
        self.header, self.value, self.headers, self.buffer = b"", b"", {}, b""
        self.name: str | None = None
        self.is_file = False

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self.begin,
            "on_header_field": lambda d, s, e: setattr(self, "header", self.header + d[s:e]),
            "on_header_value": lambda d, s, e: setattr(self, "value", self.value + d[s:e]),
            "on_header_end": self.header_end,
            "on_headers_finished": self.headers_finished,
            "on_part_data": self.data,
            "on_part_end": self.end,
        }

    def begin(self) -> None:
        self.headers, self.buffer, self.name, self.is_file = {}, b"", None, False

    def header_end(self) -> None:
        self.headers[self.header.decode("latin-1").lower()] = self.value
        self.header, self.value = b"", b""

    def headers_finished(self) -> None:
        _, params = parse_options_header(self.headers.get("content-disposition", b""))
        self.name = params.get(b"name", b"").decode()
        self.is_file = self.name == "file"
        if self.is_file:
            if self.filename is not None:
                raise bad_file("more than one `file` part")
            self.filename = params.get(b"filename", b"upload.jsonl").decode(errors="replace")[:256]

    def data(self, data: bytes, start: int, end: int) -> None:
        if self.is_file:
            self.sink.write(data[start:end])
            return
        self.buffer += data[start:end]
        if len(self.buffer) > MAX_FIELD_BYTES:
            raise APIError(400, f"form field {self.name!r} is too large", param=self.name)

    def end(self) -> None:
        if not self.is_file and self.name:
            self.fields[self.name] = self.buffer.decode(errors="replace")
