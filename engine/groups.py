"""n > 1 and best_of: one request fanned out into sequences that share the prompt's KV blocks.

The first sequence (its leader) computes the prompt; the others wait until it has, then start from the prefix
cache, so the prompt's full blocks are shared (ref-counted) and each follower recomputes only the tokens of
the last, partial prompt block into a block of its own (the copy of copy-on-write, made by recomputing under a
block's worth of tokens). Their outputs come back as one RequestOutput whose `samples` are the n sequences."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from sluice.engine.outputs import RequestOutput
from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sluice.engine.pooling import EmbeddingGroup


@dataclass(slots=True)
class SequenceGroup:
    """The sequences of one request with n > 1 or best_of > 1, and the outputs of those finished."""

    request_id: str
    params: SamplingParams
    sequences: list[Request]
    followers: list[Request]
    done: dict[str, RequestOutput] = field(default_factory=dict)

    @classmethod
    def fan_out(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> SequenceGroup:
        """best_of (or n) sequences; seeded requests give sequence k the seed + k."""
        count = max(params.n, params.best_of or 0)
        seqs = []
        for k in range(count):
            child = replace(params, n=1, best_of=None, seed=None if params.seed is None else params.seed + k,
                            logprobs=params.logprobs if params.logprobs is not None or count == params.n
                            else 0)
            seqs.append(Request(f"{request_id}#{k}", prompt_token_ids, child))
        return cls(request_id, params, seqs, seqs[1:])

    def leader_ready(self) -> bool:
        """True once its leader has computed its prompt (or finished), so followers find it in the cache."""
        lead = self.sequences[0]
        return lead.is_finished or lead.num_computed_tokens >= len(lead.prompt_token_ids)

    def finish(self, out: RequestOutput) -> RequestOutput | None:
        """Keep one sequence's output; the merged output once all are done."""
        self.done[out.request_id] = out
        if len(self.done) < len(self.sequences):
            return None
        outs = [self.done[s.request_id] for s in self.sequences]
        if len(outs) > self.params.n:
            outs = sorted(outs, key=cumulative_logprob, reverse=True)[: self.params.n]
        if self.params.logprobs is None:
            outs = [replace(o, logprobs=None, token_bytes=None) for o in outs]
        return replace(outs[0], request_id=self.request_id, samples=outs)


def cumulative_logprob(out: RequestOutput) -> float:
    """Sum of the chosen tokens' logprobs (best_of ranks sequences by it)."""
    return sum(step[tok] for tok, step in zip(out.token_ids, out.logprobs or [], strict=False))


class Groups:
    """The grouped requests in flight (n > 1 and best_of, several embedding inputs), by id and by sequence."""

    def __init__(self) -> None:
        self.by_id: dict[str, SequenceGroup | EmbeddingGroup] = {}
        self._of: dict[str, SequenceGroup | EmbeddingGroup] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def get(self, request_id: str) -> SequenceGroup | EmbeddingGroup | None:
        """The group a request id names, if it names one."""
        return self.by_id.get(request_id)

    def add(self, group: SequenceGroup | EmbeddingGroup) -> None:
        """Track a group and its sequences."""
        self.by_id[group.request_id] = group
        self._of.update((seq.request_id, group) for seq in group.sequences)

    def counts_prompt(self, req: Request) -> bool:
        """Whether a finished sequence's prompt tokens count (a group's once, with its first sequence)."""
        group = self._of.get(req.request_id)
        return group is None or req is group.sequences[0]

    def start_followers(self, waiting: deque[Request]) -> None:
        """Queue (first in line) the other sequences of groups whose leader has computed the prompt."""
        for group in self.by_id.values():
            if group.followers and group.leader_ready():  # type: ignore[union-attr]
                for seq in reversed(group.followers):
                    waiting.appendleft(seq)
                group.followers = []

    def merge(self, outs: list) -> list:
        """Outputs of single requests as they are; a group's sequences as one output once all are done."""
        merged = []
        for out in outs:
            group = self._of.pop(out.request_id, None)
            if group is None:
                merged.append(out)
            elif (whole := group.finish(out)) is not None:
                self.by_id.pop(group.request_id, None)
                merged.append(whole)
        return merged
