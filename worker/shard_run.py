"""One shard's run through an engine: add its requests, collect one record per custom_id, write the attempt's
shards/{n}.{token}.jsonl and commit it under its lease (worker/lease.py)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from pydantic import ValidationError
from rq import get_current_job

from sluice.contract.batch import BatchStore
from sluice.contract.images import ImageSettings
from sluice.contract.redis_conn import connect
from sluice.contract.schemas import BatchRequest, ChatBody, EmbeddingBody, OutputRecord, ResponsesBody
from sluice.contract.settings import Settings, get_settings, stay_off_the_hub
from sluice.contract.shards import shard_requests
from sluice.contract.storage import open_output
from sluice.worker.adapters import Adapters, ServedModels
from sluice.worker.encoder_responses import encoder_params
from sluice.worker.faults import faults
from sluice.worker.lease import Commit, attempt_key, begin_attempt, commit, lease_holds
from sluice.worker.line_images import ImageRefused, prompt_with_images
from sluice.worker.responses import ABORT_CODES, error_record, output_record
from sluice.worker.terminal import OUTPUT_NOT_ALLOWED, fail_batch, output_problem

if TYPE_CHECKING:
    from sluice.engine import LLM

log = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    """Another attempt took (or committed) this shard: this attempt's output was discarded."""


def shard_key(batch_id: str, shard: int) -> str:
    """Where shards were written before attempts had tokens (finalize still reads a shard's output there)."""
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


def served_models(llm: LLM, settings: Settings, adapters: Adapters | None = None) -> set[str] | ServedModels:
    """Names requests may give as `model`: the checkpoint folder's name plus SLUICE_SERVED_MODELS, and the
    worker's LoRA adapters."""
    names = {model_name(llm), *settings.served_model_names()}
    return ServedModels(names, adapters) if adapters else names


def prepare(llm: LLM, request: BatchRequest, served: set[str],
            images: ImageSettings | None = None) -> tuple[Any, Any]:
    """The prompt (a chat rendered through the model's template) and sampling parameters of a request (an
    embeddings request: its inputs and pooling parameters); image parts read as `images` allows (the worker's
    SLUICE_IMAGE_* settings; their defaults where none are given)."""
    from sluice.engine import PoolingParams, SamplingParams

    body = request.parsed_body()
    if isinstance(body, ResponsesBody):
        body = body.chat()
    if body.model is not None and body.model not in served:
        raise ModelNotServed(f"model {body.model!r} is not served here (served: {', '.join(sorted(served))})")
    if isinstance(body, EmbeddingBody):
        return body.input, PoolingParams(dimensions=body.dimensions)
    if (pooled := encoder_params(body)) is not None:  # rerank, score, moderations
        return pooled[0], PoolingParams(task=pooled[1])
    if not isinstance(body, ChatBody):
        return body.prompt, SamplingParams(**body.sampling_kwargs())
    try:
        prompt = llm.encode_chat(body.plain_messages(), body.template_tools())
    except Exception as exc:
        raise ChatTemplateError(
            f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}"
        ) from exc
    if body.image_parts():  # fetched and decoded here, each problem naming its part (worker.images)
        prompt = prompt_with_images(llm, body, prompt, images or ImageSettings())
    return prompt, SamplingParams(**body.sampling_kwargs())


@dataclass
class ShardRun:
    """The requests of one shard job in flight in an engine, and the records of those already done."""

    job_id: str
    batch_id: str
    shard: int
    requests: list[BatchRequest]
    records: dict[str, OutputRecord] = field(default_factory=dict)
    pending: dict[str, BatchRequest] = field(default_factory=dict)
    abort_code: str | None = None
    unreported: list[str] = field(default_factory=list)
    token: int | None = None
    payload: dict[str, Any] | list[dict[str, Any]] | None = None
    loaded: bool = True  # False until load() reads the requests of a slice

    def __post_init__(self) -> None:
        self._carry_answers()

    def _carry_answers(self) -> None:
        """The records of requests answered already: a refused body, a resumed batch's finished line."""
        for request in self.requests:
            answer = request.answer()
            if answer is not None and request.custom_id not in self.records:
                self.records[request.custom_id] = answer
                self.unreported.append(request.custom_id)

    @classmethod
    def from_args(cls, job_id: str, args: tuple | list) -> ShardRun:
        """A run for the args of a `run_shard(batch_id, shard, slice)` job; its requests come with load(),
        from the slice of the batch's stored input (or, in a job that carries them, from the job itself)."""
        batch_id, shard, payload = args
        if isinstance(payload, dict):
            return cls(job_id, batch_id, int(shard), [], payload=payload, loaded=False)
        return cls(job_id, batch_id, int(shard), [BatchRequest.trusted(r) for r in payload])

    def load(self, store: BatchStore, settings: Settings) -> None:
        """Read the shard's requests from its slice of the batch's input, in the batch's output storage (no
        requests when the batch is gone)."""
        if not isinstance(self.payload, dict) or self.requests:
            return
        faults(settings).before_load()
        batch = store.get(self.batch_id)
        if batch is not None:
            roots, style = settings.output_root_urls(), settings.s3_addressing_style
            storage = open_output(batch.output_url, roots, s3_style=style)
            self.requests = list(shard_requests(storage, self.payload))
            self._carry_answers()
        self.loaded = True

    @property
    def done(self) -> bool:
        return not self.pending

    def lease(self, connection: redis.Redis) -> bool:
        """Take this attempt's lease token; False when an attempt committed the shard already (nothing to
        run)."""
        self.token = begin_attempt(connection, self.batch_id, self.shard)
        return self.token is not None

    def start(self, llm: LLM, served: set[str], key: str | None = None,
              images: ImageSettings | None = None) -> None:
        """Add every request to the engine as `{key}/{i}` (key: the rq execution; default the job id); served:
        the model names it answers to (served_models); images: what image parts may be read (prepare)."""
        for i, request in enumerate(self.requests):
            if request.custom_id not in self.records:
                self.add(llm, f"{key or self.job_id}/{i}", request, served, images)

    def add(self, llm: LLM, rid: str, request: BatchRequest, served: set[str],
            images: ImageSettings | None = None) -> None:
        """Add one request to the engine as rid; one it cannot run (or even render) becomes an error
        record."""
        from sluice.engine import RequestRejected  # torch: see shared_llm

        try:
            prompt, params = prepare(llm, request, served, images)
            served_models = isinstance(served, ServedModels)
            adapter = served.adapter(request.parsed_body().model) if served_models else None
            llm.add_request(rid, prompt, params, lora_request=adapter)
        except RequestRejected as exc:
            self.fail(request, "request_rejected", str(exc), 400)
        except ModelNotServed as exc:
            self.fail(request, "model_not_found", str(exc), 400)
        except ChatTemplateError as exc:
            self.fail(request, "chat_template_error", str(exc), 400)
        except ImageRefused as exc:
            self.fail(request, "invalid_image", str(exc), 400)
        except (ValidationError, ValueError, TypeError) as exc:
            self.fail(request, "invalid_request", str(exc), 400)
        else:
            self.pending[rid] = request

    def fail(self, request: BatchRequest, code: str, message: str, status_code: int | None = None) -> None:
        self.records[request.custom_id] = error_record(request.custom_id, code, message, status_code)

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
        prompt = sum(u.get("prompt_tokens", u.get("input_tokens", 0)) for u in usages)
        return prompt, sum(u.get("completion_tokens", u.get("output_tokens", 0)) for u in usages)

    def save(self, connection: redis.Redis, settings: Settings) -> dict[str, int]:
        """Write this attempt's shards/{n}.{token}.jsonl (refused outside roots) and commit it with the
        shard's counts; LeaseLost (the output discarded) when another attempt took the shard or the batch is
        closed."""
        assert self.loaded, "a shard read from a slice is saved only after load() (else its lines vanish)"
        assert self.done and len(self.records) == len(self.requests), "a shard is saved only when complete"
        if self.token is None and not self.lease(connection):
            raise LeaseLost(f"shard {self.shard} of {self.batch_id} was committed by another attempt")
        assert self.token is not None
        batch = BatchStore(connection).get(self.batch_id)
        faults(settings).before_save()
        completed, failed = self.counts()
        storage, key = None, attempt_key(self.batch_id, self.shard, self.token)
        if batch is not None:
            storage = open_output(batch.output_url, settings.output_root_urls(),
                                  s3_style=settings.s3_addressing_style)
            if not lease_holds(connection, self.batch_id, self.shard, self.token):
                raise LeaseLost(self._discarded(Commit.lease_lost))
            ordered = [self.records[r.custom_id] for r in self.requests]
            storage.put(key, records_jsonl(ordered))
        entry = json.dumps([completed, failed, *self.usage()])
        result = commit(connection, self.batch_id, self.shard, self.token, entry)
        if result is not Commit.ok:
            if storage is not None:
                storage.delete(key)
            raise LeaseLost(self._discarded(result))
        return {"completed": completed, "failed": failed}

    def _discarded(self, why: Commit) -> str:
        return f"shard {self.shard} of {self.batch_id}: attempt {self.token} discarded ({why.value})"


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
                  "cpu_isa": settings.cpu_isa, "device_path": settings.device_path,
                  "packed_weights": settings.packed_weights}
        stay_off_the_hub()
        chosen |= settings.json_bounds()
        _LLM = LLM(settings.model, **{k: v for k, v in chosen.items() if v is not None})
    return _LLM


def run_shard(batch_id: str, shard: int, requests: dict[str, Any] | list[dict[str, Any]]) -> dict[str, int]:
    """The rq job of one shard, runnable by a stock rq worker: read its slice of the input (`requests`: the
    slice, contract/shards.InputSlice), generate every request, save the shard (the job's entry point: it
    reads Settings once, for everything below)."""
    settings, job = get_settings(), get_current_job()
    connection = job.connection if job else connect(settings.redis_url)
    run = ShardRun.from_args(job.id if job else f"{batch_id}-shard-{shard}", (batch_id, shard, requests))
    if not run.lease(connection):
        return {"completed": 0, "failed": 0}  # committed by an earlier attempt
    reason = stop_reason(BatchStore(connection), batch_id)
    refusal = None if reason else output_refusal(BatchStore(connection), batch_id, settings)
    if refusal:  # permanent for the batch: end it now rather than run requests whose output cannot be kept
        fail_batch(connection, batch_id, OUTPUT_NOT_ALLOWED, refusal, settings)
        return {"completed": 0, "failed": 0}
    run.load(BatchStore(connection), settings)
    if reason:
        run.fail_all(reason, ABORT_CODES[reason])
    else:
        llm = shared_llm(settings)
        run.start(llm, served_models(llm, settings), images=ImageSettings.of(settings))
        while not run.done:
            for out in llm.step():
                run.finish(out, model_name(llm))
    try:
        return run.save(connection, settings)
    except LeaseLost as exc:
        log.warning("%s", exc)
        return {"completed": 0, "failed": 0}
