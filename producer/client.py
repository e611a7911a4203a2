"""The Python client: submit batches or single requests, follow them, cancel them, read their results."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from sluice.contract.batch import BatchStore, TransitionError, new_batch_id
from sluice.contract.events import notify
from sluice.contract.jobs import QUEUES
from sluice.contract.queues import drop_unclaimed
from sluice.contract.quota import DEFAULT_PROJECT, TokenLimitExceeded, TokenQuota
from sluice.contract.redis_conn import connect
from sluice.contract.retention import schedule_output_expiry
from sluice.contract.schemas import (
    CHAT,
    COMPLETIONS,
    Batch,
    BatchStatus,
    LineError,
    OutputRecord,
    RequestCounts,
)
from sluice.contract.settings import Settings, get_settings
from sluice.contract.shards import input_key
from sluice.contract.signing import WebhookSettings, check_url
from sluice.contract.storage import check_output_url, iter_lines, open_output, read_url
from sluice.producer import sharding
from sluice.producer.validation import Input, input_lines, validate_lines

WINDOW = re.compile(r"^(\d+)([smhd])$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_METADATA_KEYS = 16
MEMORY = "<memory>"


class BatchNotFound(KeyError):
    """No batch with that id."""


def window_seconds(window: str) -> int:
    """Seconds in a completion window such as '24h', '90m', '7d'."""
    match = WINDOW.match(window.strip())
    if not match or int(match.group(1)) <= 0:
        raise ValueError(f"completion_window must look like '24h', '90m' or '7d', got {window!r}")
    return int(match.group(1)) * UNITS[match.group(2)]


MIN_OUTPUT_EXPIRY, MAX_OUTPUT_EXPIRY = 3600, 30 * 86400  # OpenAI's bounds on output_expires_after.seconds


def output_expiry_seconds(spec: dict[str, Any] | None) -> int | None:
    """Seconds from OpenAI's `output_expires_after` ({"anchor": "created_at", "seconds": N}, N from an hour to
    30 days), None when not given."""
    if spec is None:
        return None
    seconds = spec.get("seconds")
    if set(spec) != {"anchor", "seconds"} or spec["anchor"] != "created_at" or not isinstance(seconds, int):
        raise ValueError('output_expires_after must be {"anchor": "created_at", "seconds": N}')
    if not MIN_OUTPUT_EXPIRY <= seconds <= MAX_OUTPUT_EXPIRY:
        raise ValueError(f"output_expires_after.seconds must be between {MIN_OUTPUT_EXPIRY} and "
                         f"{MAX_OUTPUT_EXPIRY}")
    return seconds


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    """Metadata as OpenAI allows it: at most 16 string keys (64 chars) and string values (512 chars)."""
    metadata = dict(metadata or {})
    if len(metadata) > MAX_METADATA_KEYS:
        raise ValueError(f"metadata: at most {MAX_METADATA_KEYS} keys, got {len(metadata)}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise ValueError(
                f"metadata[{k!r}]: keys must be strings of <= 64 chars, values strings of <= 512"
            )
    return metadata


def check_options(priority: str, output_expires_after: int | None) -> None:
    """ValueError naming the option when the priority or the output expiry is not one a batch can have."""
    if priority not in QUEUES:
        raise ValueError(f"priority must be one of {', '.join(QUEUES)}, got {priority!r}")
    if output_expires_after is not None and output_expires_after < 1:
        raise ValueError(f"output_expires_after must be >= 1 second, got {output_expires_after}")


def check_webhook(url: str | None, allow: str) -> str | None:
    """The webhook URL after the safety check (http(s), public or allow-listed addresses)."""
    return check_url(url, allow) if url else None


def single_line(prompt_or_messages: str | list, sampling: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI batch line for one prompt (completions) or one conversation (chat)."""
    if (
        isinstance(prompt_or_messages, list)
        and prompt_or_messages
        and isinstance(prompt_or_messages[0], dict)
    ):
        return {
            "custom_id": "request",
            "method": "POST",
            "url": CHAT,
            "body": {"messages": prompt_or_messages, **sampling},
        }
    return {
        "custom_id": "request",
        "method": "POST",
        "url": COMPLETIONS,
        "body": {"prompt": prompt_or_messages, **sampling},
    }


class Client:
    """Talks to Sluice through Redis: Client(redis_url).submit_batch(...), .wait(id), .results(id)."""

    def __init__(self, redis_url: str | None = None, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        self.connection = connect(redis_url or self.settings.redis_url)
        self.batches = BatchStore(self.connection)
        self.output_roots = self.settings.output_root_urls()

    def submit_batch(
        self,
        input: Input,
        output: str | None = None,
        priority: str = "default",
        metadata: dict[str, str] | None = None,
        idempotency_key: str | None = None,
        completion_window: str | None = None,
        shard_size: int | None = None,
        webhook: str | None = None,
        output_expires_after: int | None = None,
        project: str = DEFAULT_PROJECT,
    ) -> Batch:
        """Validate input (path, URL, bytes or list of lines) and enqueue it for project; returns the Batch.

        completion_window and shard_size default to SLUICE_COMPLETION_WINDOW and SLUICE_SHARD_SIZE;
        output_expires_after: seconds after creation when the output and error files are deleted.
        """
        shard_size = self._shard_size(shard_size)
        batch, created = self._create(
            input_file=str(input) if isinstance(input, str | Path) else MEMORY, output=output,
            priority=priority, metadata=metadata, idempotency_key=idempotency_key,
            completion_window=completion_window, webhook=webhook, output_expires_after=output_expires_after,
        )  # fmt: skip
        return self._validate_and_enqueue(batch, input, shard_size, project) if created else batch

    def resume(
        self,
        batch_id: str,
        output: str | None = None,
        priority: str | None = None,
        completion_window: str | None = None,
        shard_size: int | None = None,
        project: str = DEFAULT_PROJECT,
    ) -> Batch:
        """A new batch of the lines of a done batch that have no result (expired, cancelled, on a failed
        shard); the lines that have one (a response, a 400 included) are carried over as they are, so once the
        new batch completes its output and error files hold every custom_id of the original exactly once."""
        original = self.get(batch_id)
        if not original.done:
            raise ValueError(f"batch {batch_id} is {original.status.value}; only a done batch can be resumed")
        finished = {r.custom_id: r for r in self._records(original) if r.response is not None}
        source = self._input_of(original)
        batch, _ = self._create(
            input_file=original.input_file, output=output or original.output_url,
            priority=priority or original.priority, metadata=original.metadata,
            completion_window=completion_window or original.completion_window, webhook=original.webhook,
            resumed_from=original.id,
        )  # fmt: skip
        return self._validate_and_enqueue(batch, source, self._shard_size(shard_size), project, finished)

    def _shard_size(self, shard_size: int | None) -> int:
        shard_size = self.settings.shard_size if shard_size is None else shard_size
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        return shard_size

    def _create(
        self,
        input_file: str,
        output: str | None,
        priority: str,
        metadata: dict[str, str] | None,
        completion_window: str | None,
        webhook: str | None,
        idempotency_key: str | None = None,
        output_expires_after: int | None = None,
        resumed_from: str | None = None,
    ) -> tuple[Batch, bool]:
        """A new batch record, `validating` (or the batch the idempotency key already names: created
        False)."""
        completion_window = completion_window or self.settings.completion_window
        check_options(priority, output_expires_after)
        window = window_seconds(completion_window)
        batch = Batch(
            id=new_batch_id(),
            input_file=input_file,
            output_url=check_output_url((output or self.settings.output_url).rstrip("/"), self.output_roots),
            priority=priority,
            completion_window=completion_window,
            metadata=check_metadata(metadata),
            webhook=check_webhook(webhook or self.settings.webhook_url, self.settings.webhook_allow),
            idempotency_key=idempotency_key,
            resumed_from=resumed_from,
            created_at=time.time(),
        )
        batch.expires_at = batch.created_at + window
        if output_expires_after is not None:
            batch.output_expires_at = batch.created_at + output_expires_after
        if idempotency_key:
            existing = self.batches.claim_idempotency_key(idempotency_key, batch.id, ttl=max(window, 86400))
            if existing is not None:
                return self.get(existing), False
        self.batches.create(batch)
        if batch.output_expires_at is not None:
            schedule_output_expiry(self.connection, batch.id, batch.output_expires_at)
        return batch, True

    def _records(self, batch: Batch) -> Iterator[OutputRecord]:
        """Every record of a done batch, its output file's then its error file's."""
        for url in (batch.output_file, batch.error_file):
            if url is not None:
                for line in read_url(url, s3_style=self.settings.s3_addressing_style).splitlines():
                    yield OutputRecord.model_validate_json(line)

    def _input_of(self, batch: Batch) -> Iterable[bytes]:
        """A batch's input lines: its input file, or (submitted from memory) the validated requests it stored
        in its output location."""
        if batch.input_file != MEMORY:
            return input_lines(batch.input_file, self.settings)
        storage = open_output(batch.output_url, self.output_roots, s3_style=self.settings.s3_addressing_style)
        if not storage.exists(input_key(batch.id)):
            raise ValueError(f"batch {batch.id} was submitted from memory and its stored input "
                             f"{input_key(batch.id)} is gone (deleted with its outputs): it cannot be "
                             "resumed")
        return (json.dumps({"method": "POST", **stored_line(line)}).encode()
                for line in iter_lines(storage.open(input_key(batch.id))) if line.strip())

    def _validate_and_enqueue(
        self, batch: Batch, input: Input, shard_size: int, project: str,
        answered: dict[str, OutputRecord] | None = None,
    ) -> Batch:
        """Every failure from here on ends the batch `failed` with an error, never stuck in `validating`.

        The input is read once, line by line: each validated request goes straight into the batch's stored
        input (sharding.InputSpool), published only once every line passed and the tokens are reserved."""
        settings = self.settings
        try:
            storage = open_output(batch.output_url, self.output_roots, s3_style=settings.s3_addressing_style)
            spool = sharding.InputSpool(storage, batch.id, shard_size, settings.max_shard_bytes)
        except Exception as exc:
            message = f"cannot write the batch's input to {batch.output_url}: {type(exc).__name__}: {exc}"
            return self._fail(batch.id, [LineError(code="enqueue_failed", message=message)], 0)
        with spool:
            try:
                checked = validate_lines(input_lines(input, settings), settings, into=spool,
                                         answered=answered)
            except Exception as exc:
                message = f"cannot read input {batch.input_file}: {type(exc).__name__}: {exc}"
                return self._fail(batch.id, [LineError(code="input_unreadable", message=message)], 0)
            if checked.errors:
                return self._fail(batch.id, checked.errors, checked.num_lines)
            return self._reserve_and_enqueue(batch, spool, checked.num_lines, project)

    def _reserve_and_enqueue(
        self, batch: Batch, spool: sharding.InputSpool, total: int, project: str
    ) -> Batch:
        """Hold the batch's tokens against its project's cap, publish its input, enqueue its shards."""
        slices = spool.cut()
        try:
            tokens = [s.tokens for s in slices]
            TokenQuota(self.connection).reserve(project, batch.id, tokens, self.settings.max_enqueued_tokens)
        except TokenLimitExceeded as exc:
            return self._fail(batch.id, [LineError(code=exc.code, message=str(exc))], total)

        def start(b: Batch) -> None:
            b.request_counts = RequestCounts(total=len(spool))
            b.num_shards = len(slices)

        try:
            spool.commit()
            self.batches.transition(batch.id, BatchStatus.in_progress, start)
            sharding.enqueue(self.connection, batch, slices, self.settings)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            return self._fail(batch.id, [LineError(code="enqueue_failed", message=message)], total)
        return self.get(batch.id)

    def _fail(self, batch_id: str, errors: list[LineError], total: int) -> Batch:
        def record(b: Batch) -> None:
            b.errors = errors
            b.request_counts = RequestCounts(total=total, failed=total)

        batch = self.batches.transition(batch_id, BatchStatus.failed, record)
        if batch.webhook:
            notify(self.connection, batch, settings=WebhookSettings.of(self.settings))
        return batch

    def submit(
        self,
        prompt_or_messages: str | list,
        output: str | None = None,
        priority: str = "default",
        metadata: dict[str, str] | None = None,
        webhook: str | None = None,
        **sampling: Any,
    ) -> Batch:
        """Submit one prompt or conversation as a batch of one (custom_id 'request')."""
        line = single_line(prompt_or_messages, sampling)
        return self.submit_batch(
            [line], output=output, priority=priority, metadata=metadata, webhook=webhook, shard_size=1
        )

    def get(self, batch_id: str) -> Batch:
        """The batch's current state (BatchNotFound if unknown)."""
        batch = self.batches.get(batch_id)
        if batch is None:
            raise BatchNotFound(batch_id)
        return batch

    def wait(
        self, batch_id: str, timeout: float | None = None, progress: bool = True, poll: float = 0.25
    ) -> Batch:
        """Block until the batch is done (TimeoutError after timeout seconds), with a progress bar."""
        deadline = None if timeout is None else time.monotonic() + timeout
        batch = self.get(batch_id)
        with tqdm(total=batch.request_counts.total, disable=not progress, desc=batch_id, unit="req") as bar:
            while not batch.done:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"batch {batch_id} still {batch.status.value} after {timeout} s")
                time.sleep(poll)
                batch = self.get(batch_id)
                bar.total = batch.request_counts.total
                bar.update(batch.request_counts.completed + batch.request_counts.failed - bar.n)
        return batch

    def cancel(self, batch_id: str) -> Batch:
        """Cancel: drop queued shards, abort running requests; the batch ends `cancelled`, partial results
        kept."""
        batch = self.get(batch_id)
        if batch.status == BatchStatus.cancelling:
            return batch
        if batch.done:
            raise TransitionError(f"batch {batch_id} is already {batch.status.value}")
        self.batches.transition(batch_id, BatchStatus.cancelling)
        self.batches.request_cancel(batch_id)
        if batch.num_shards:
            drop_unclaimed(self.connection, batch_id, batch.num_shards)
        return self.get(batch_id)

    def results(self, batch_id: str, errors: bool = False) -> Iterator[OutputRecord]:
        """The batch's output records (or its error records) once it is done."""
        batch = self.get(batch_id)
        if not batch.done:
            raise ValueError(f"batch {batch_id} is {batch.status.value}; results come once it is done")
        url = batch.error_file if errors else batch.output_file
        if url is None:
            return
        for line in read_url(url, s3_style=self.settings.s3_addressing_style).splitlines():
            yield OutputRecord.model_validate(json.loads(line))

    def list(self, limit: int = 20) -> list[Batch]:
        """The most recent batches, newest first."""
        return self.batches.list(limit)


def stored_line(line: bytes) -> dict[str, Any]:
    """A stored request as its input line's fields (a carried record is not part of the line)."""
    data = json.loads(line)
    return {k: data[k] for k in ("custom_id", "url", "body")}
