"""One shard's run through an engine: add its requests, collect one record per custom_id, write shards/{n}.jsonl."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from pydantic import ValidationError
from rq import get_current_job

from sluice.contract.batch import BatchStore
from sluice.contract.images import ImageSettings
from sluice.contract.schemas import ChatBody, EmbeddingBody, OutputRecord, Request
from sluice.contract.settings import Settings, get_settings, stay_off_the_hub
from sluice.contract.storage import open_output
from sluice.worker.faults import faults
from sluice.worker.images import ImageRefused, with_images
from sluice.worker.responses import ABORT_CODES, error_record, output_record
from sluice.worker.terminal import OUTPUT_NOT_ALLOWED, fail_batch, output_problem

if TYPE_CHECKING:
    from sluice.engine import LLM


def shard_key(batch_id: str, shard: int) -> str:
    return f"{batch_id}/shards/{shard}.jsonl"


def stop_reason(store: BatchStore, batch_id: str) -> str | None:
    """'batch_cancelled' or 'batch_expired' when the batch's requests must not (or no longer) run."""
    if store.cancel_requested([batch_id]):
        return "batch_cancelled"
    batch = store.get(batch_id)
    if batch is None:
        return "batch_cancelled"
    if batch.expires_at is not None and time.time() > batch.expires_at:
        return "batch_expired"
    return None


def output_refusal(store: BatchStore, batch_id: str, settings: Settings) -> str | None:
    """Why this worker may not write the batch's output under roots (checked before any of its requests runs),
    or None."""
    batch = store.get(batch_id)
    return None if batch is None else output_problem(batch.output_url, settings.output_root_urls(),
                                                     settings.s3_addressing_style)


class ModelNotServed(ValueError):
    """A request naming a model this worker does not serve."""


class ChatTemplateError(ValueError):
    """A conversation the model's chat template refused or failed to render."""


def served_models(llm: LLM, settings: Settings) -> set[str]:
    """Names requests may give as `model`: the checkpoint folder's name plus SLUICE_SERVED_MODELS."""
    return {model_name(llm), *settings.served_model_names()}


def prepare(llm: LLM, request: Request, served: set[str]) -> tuple[Any, Any]:
    """The prompt (a chat rendered through the model's template) and sampling parameters of a request (an
    embeddings request: its inputs and pooling parameters)."""
    from sluice.engine import PoolingParams, SamplingParams

    body = request.parsed_body()
    if body.model is not None and body.model not in served:
        raise ModelNotServed(f"model {body.model!r} is not served here (served: {', '.join(sorted(served))})")
    if isinstance(body, EmbeddingBody):
        return body.input, PoolingParams(dimensions=body.dimensions)
    if not isinstance(body, ChatBody):
        return body.prompt, SamplingParams(**body.sampling_kwargs())
    try:
        prompt = llm.encode_chat(body.plain_messages(), body.template_tools())
    except Exception as exc:
        raise ChatTemplateError(
            f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}"
        ) from exc
    if body.image_parts():  # fetched and decoded here, each problem naming its part (worker.images)
        prompt = with_images(llm, body, prompt, ImageSettings.of(get_settings()))
    return prompt, SamplingParams(**body.sampling_kwargs())


@dataclass
class ShardRun:
    """The requests of one shard job in flight in an engine, and the records of those already done."""

    job_id: str
    batch_id: str
    shard: int
    requests: list[Request]
    records: dict[str, OutputRecord] = field(default_factory=dict)
    pending: dict[str, Request] = field(default_factory=dict)
    abort_code: str | None = None
    unreported: list[str] = field(default_factory=list)

    @classmethod
    def from_args(cls, job_id: str, args: tuple | list) -> ShardRun:
        """A run for the args of a `run_shard(batch_id, shard, requests)` job."""
        batch_id, shard, requests = args
        return cls(job_id, batch_id, int(shard), [Request.trusted(r) for r in requests])

    @property
    def done(self) -> bool:
        return not self.pending

    def start(self, llm: LLM, served: set[str], key: str | None = None) -> None:
        """Add every request to the engine as `{key}/{i}` (key: the rq execution; default the job id); served:
        the model names it answers to (served_models)."""
        for i, request in enumerate(self.requests):
            self.add(llm, f"{key or self.job_id}/{i}", request, served)

    def add(self, llm: LLM, rid: str, request: Request, served: set[str]) -> None:
        """Add one request to the engine as rid; one it cannot run (or even render) becomes an error record."""
        from sluice.engine import RequestRejected  # torch: see shared_llm

        try:
            prompt, params = prepare(llm, request, served)
            llm.add_request(rid, prompt, params)
        except RequestRejected as exc:
            self.fail(request, "request_rejected", str(exc))
        except ModelNotServed as exc:
            self.fail(request, "model_not_found", str(exc))
        except ChatTemplateError as exc:
            self.fail(request, "chat_template_error", str(exc))
        except ImageRefused as exc:
            self.fail(request, "invalid_image", str(exc))
        except (ValidationError, ValueError, TypeError) as exc:
            self.fail(request, "invalid_request", str(exc))
        else:
            self.pending[rid] = request

    def fail(self, request: Request, code: str, message: str) -> None:
        self.records[request.custom_id] = error_record(request.custom_id, code, message)

    def fail_all(self, code: str, message: str) -> None:
        """Record every request not done yet as an error (the shard did not run them)."""
        for request in self.requests:
            if request.custom_id not in self.records:
                self.fail(request, code, message)
        self.pending.clear()

    def finish(self, out: Any, model: str) -> None:
        """Record a finished engine request."""
        request = self.pending.pop(out.request_id)
        self.records[request.custom_id] = output_record(request, out, model, self.abort_code)
        self.unreported.append(request.custom_id)

    def report_progress(self, store: BatchStore) -> None:
        """Count the requests finished since the last report in the batch's live progress."""
        ids, self.unreported = self.unreported, []
        completed = [i for i in ids if self.records[i].error is None]
        store.record_progress(self.batch_id, completed, [i for i in ids if self.records[i].error is not None])

    def abort(self, llm: LLM, code: str) -> None:
        """Abort the running requests; their records come with the next engine steps."""
        self.abort_code = code
        for rid in self.pending:
            llm.abort(rid)

    def counts(self) -> tuple[int, int]:
        failed = sum(1 for r in self.records.values() if r.error is not None)
        return len(self.records) - failed, failed

    def usage(self) -> tuple[int, int]:
        """Prompt and completion tokens over the shard's responses."""
        usages = [r.response.body.get("usage") or {} for r in self.records.values() if r.response is not None]
        return sum(u.get("prompt_tokens", 0) for u in usages), sum(u.get("completion_tokens", 0) for u in usages)

    def save(self, connection: redis.Redis, settings: Settings) -> dict[str, int]:
        """Write shards/{n}.jsonl (overwriting a previous run's; refused outside roots) and record the shard's
        counts."""
        assert self.done and len(self.records) == len(self.requests), "a shard is saved only when complete"
        store = BatchStore(connection)
        batch = store.get(self.batch_id)
        faults(settings).before_save()
        if batch is not None:
            storage = open_output(batch.output_url, settings.output_root_urls(), s3_style=settings.s3_addressing_style)
            ordered = [self.records[r.custom_id] for r in self.requests]
            storage.put(shard_key(self.batch_id, self.shard), records_jsonl(ordered))
        completed, failed = self.counts()
        store.record_shard(self.batch_id, self.shard, completed, failed, *self.usage())
        return {"completed": completed, "failed": failed}


def records_jsonl(records: Any) -> bytes:
    return b"".join(r.model_dump_json().encode() + b"\n" for r in records)


def model_name(llm: LLM) -> str:
    """The name reported in response bodies: the checkpoint folder's name."""
    return Path(str(llm.config.model)).name


_LLM: Any = None


def shared_llm(settings: Settings) -> Any:
    """The process's engine for stock rq workers, loaded once from SLUICE_MODEL (and SLUICE_DTYPE/DEVICE)."""
    global _LLM
    if _LLM is None:
        from sluice.engine import LLM  # torch: imported when a shard first runs, not by every CLI command

        if not settings.model:
            raise RuntimeError("set SLUICE_MODEL to run shards in a stock rq worker (or use `sluice worker`)")
        chosen = {"dtype": settings.dtype, "device": settings.device, "cpu_kernel": settings.cpu_kernel,
                  "cpu_isa": settings.cpu_isa, "device_path": settings.device_path}
        stay_off_the_hub()
        _LLM = LLM(settings.model, **{k: v for k, v in chosen.items() if v is not None})
    return _LLM


def run_shard(batch_id: str, shard: int, requests: list[dict[str, Any]]) -> dict[str, int]:
    """The rq job of one shard, runnable by a stock rq worker: generate every request, save the shard (the
    job's entry point: it reads Settings once, for everything below)."""
    settings, job = get_settings(), get_current_job()
    connection = job.connection if job else redis.Redis.from_url(settings.redis_url)
    run = ShardRun.from_args(job.id if job else f"{batch_id}-shard-{shard}", (batch_id, shard, requests))
    reason = stop_reason(BatchStore(connection), batch_id)
    refusal = None if reason else output_refusal(BatchStore(connection), batch_id, settings)
    if refusal:  # permanent for the batch: end it now rather than run requests whose output cannot be kept
        fail_batch(connection, batch_id, OUTPUT_NOT_ALLOWED, refusal, settings)
        return {"completed": 0, "failed": 0}
    if reason:
        run.fail_all(reason, ABORT_CODES[reason])
        return run.save(connection, settings)
    llm = shared_llm(settings)
    run.start(llm, served_models(llm, settings))
    while not run.done:
        for out in llm.step():
            run.finish(out, model_name(llm))
    return run.save(connection, settings)
