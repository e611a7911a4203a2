"""What a shard job carries: a reference to its slice of the batch's stored input, never the requests.

The producer streams the validated requests, one compact JSON object a line, into `{batch_id}/input.jsonl`
in the batch's output storage and cuts it into slices as it writes; each shard job's third argument is its
slice as a small JSON object (`InputSlice.arg`), so a job's size in Redis does not grow with its line count.
The worker (and finalize, for a shard that wrote no output) reads the slice back with one ranged read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from sluice.contract.schemas import BatchRequest
from sluice.contract.storage import Storage

BYTES_PER_TOKEN = 4  # the cheap token estimate of a request: its JSON's bytes / 4


def input_key(batch_id: str) -> str:
    """The key of a batch's validated input in its output storage."""
    return f"{batch_id}/input.jsonl"


def estimate_tokens(nbytes: int) -> int:
    """Tokens a request of nbytes of JSON is counted as against a project's enqueued-token cap (bytes / 4)."""
    return -(-nbytes // BYTES_PER_TOKEN)


@dataclass(frozen=True)
class InputSlice:
    """Bytes [start, end) of the object `key`: `count` requests, estimated at `tokens` tokens."""

    key: str
    start: int
    end: int
    count: int
    tokens: int

    def arg(self) -> dict[str, Any]:
        """The slice as a shard job argument (plain JSON)."""
        return asdict(self)

    @classmethod
    def from_arg(cls, arg: dict[str, Any]) -> InputSlice:
        """The slice a shard job argument describes."""
        return cls(str(arg["key"]), int(arg["start"]), int(arg["end"]), int(arg["count"]), int(arg["tokens"]))


def read_slice(storage: Storage, piece: InputSlice) -> list[BatchRequest]:
    """The requests of a slice, read with one ranged read (ValueError when the stored input disagrees)."""
    data = storage.read_range(piece.key, piece.start, piece.end)
    requests = [BatchRequest.trusted(json.loads(line)) for line in data.splitlines() if line.strip()]
    if len(data) != piece.end - piece.start or len(requests) != piece.count:
        raise ValueError(
            f"{piece.key} bytes {piece.start}-{piece.end} hold {len(requests)} requests, "
            f"expected {piece.count}"
        )
    return requests


def shard_requests(storage: Storage,
                   payload: dict[str, Any] | list[dict[str, Any]]) -> Iterator[BatchRequest]:
    """The requests of a shard job's third argument: a slice of the stored input, or (jobs enqueued before
    shards carried slices) the requests themselves."""
    if isinstance(payload, dict):
        yield from read_slice(storage, InputSlice.from_arg(payload))
    else:
        yield from (BatchRequest.trusted(r) for r in payload)
