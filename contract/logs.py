"""Process logging: plain or one JSON object per line, with batch/shard/job ids pulled out, secrets masked."""

from __future__ import annotations

import json
import logging
import re
import sys
import time

IDS = re.compile(r"\b(batch_[0-9a-f]{32})(?:-shard-(\d+)|-finalize| shard (\d+))?\b")
SECRETS = [
    (re.compile(r"(://[^:/@\s]*:)[^@\s]+@"), r"\1***@"),  # passwords in URLs
    (re.compile(r"\b(sk-sluice-)[A-Za-z0-9_-]+"), r"\1***"),  # API keys
    (re.compile(r"\b(whsec_)[A-Za-z0-9+/=_-]+"), r"\1***"),  # webhook secrets
    (re.compile(r"(?i)(bearer\s+)\S+"), r"\1***"),
]
FIELDS = ("batch_id", "shard", "job_id", "project", "status", "worker")


def escape_control(text: str) -> str:
    """text safe for one log line: control characters (NUL, newlines, ESC...) written as escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def redact(text: str) -> str:
    """text with URL passwords, API keys, webhook secrets and bearer tokens masked."""
    for pattern, replacement in SECRETS:
        text = pattern.sub(replacement, text)
    return text


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message and the ids it mentions."""

    def format(self, record: logging.LogRecord) -> str:
        message = redact(record.getMessage())
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        match = IDS.search(message)
        if match:
            batch_id, shard = match.group(1), match.group(2) or match.group(3)
            out["batch_id"] = batch_id
            out["job_id"] = f"{batch_id}-shard-{shard}" if shard is not None else match.group(0)
            if shard is not None:
                out["shard"] = int(shard)
        out.update({k: getattr(record, k) for k in FIELDS if getattr(record, k, None) is not None})
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(out)


class PlainFormatter(logging.Formatter):
    """Human lines, secrets masked."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        """The message with control characters escaped: one record, one line, nothing raw (a NUL, ESC)."""
        record.message = escape_control(record.message)
        return super().formatMessage(record)


def configure(log_format: str = "text", level: str = "INFO") -> None:
    """Route every logger (rq, uvicorn, ours) to stderr in the chosen format."""
    if log_format not in ("text", "json"):
        raise ValueError(f"--log-format must be 'text' or 'json', got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("rq.worker", "uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
