"""A request and its state machine.

A request moves through separate, timestamped states: it arrives (WAITING), is admitted into the
running batch (RUNNING: prefilling, then decoding), may be PREEMPTED back to the queue, and ends
FINISHED, CANCELLED or REJECTED (it could never fit in KV memory, or admission control refused
it). The allowed transitions are written once in `TRANSITIONS` and checked on every change.

Progress is one counter, as in vLLM V1: `num_computed_tokens` tokens have K/V in the cache, out of
`num_tokens = prompt_len + num_output_tokens`. A step schedules `num_tokens - num_computed_tokens`
(or a chunk of it); when the counter catches up, the step samples the next token. A fresh prompt,
a chunked prompt and a request re-prefilled after preemption by recompute are the same rule.
"""

from __future__ import annotations

import enum
from typing import Any

from sim.errors import InvalidTransition


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    TRANSFERRING = "transferring"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    REJECTED = "rejected"

    # (Enum's __hash__ is a Python method hashing the name, called on every transition; the
    # members are singletons that compare by identity, so identity's hash will do)
    __hash__ = object.__hash__

    @property
    def is_done(self) -> bool:
        return self in _DONE


_DONE = frozenset({RequestState.FINISHED, RequestState.CANCELLED, RequestState.REJECTED})

S = RequestState
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.RUNNING, S.CANCELLED, S.REJECTED}),
    # Preemption by recompute goes back to the queue (PREEMPTED); by swap, to host memory.
    S.RUNNING: frozenset({S.FINISHED, S.CANCELLED, S.PREEMPTED, S.SWAPPED, S.TRANSFERRING}),
    S.PREEMPTED: frozenset({S.RUNNING, S.CANCELLED}),
    S.SWAPPED: frozenset({S.RUNNING, S.CANCELLED}),
    # Prefill/decode handoff: the K/V travels to the decode instance, then decoding resumes.
    S.TRANSFERRING: frozenset({S.RUNNING, S.CANCELLED}),
    S.FINISHED: frozenset(),
    S.CANCELLED: frozenset(),
    S.REJECTED: frozenset(),
}


class Request:
    """One request: its shape, its progress, its block table and its timestamps (seconds)."""

    __slots__ = (
        "req_id", "arrival_time", "prompt_len", "max_output_tokens", "priority", "hash_ids",
        "cancel_at", "prompt_text", "state", "num_computed_tokens", "num_output_tokens",
        "block_table", "admitted_time", "first_token_time", "last_token_time", "finish_time",
        "prefill_chunks", "num_preemptions", "output_token_ids", "closed_runs", "run_open",
        "run_start", "run_len",
        "reject_reason", "cancelled_in", "num_cached_tokens", "_timeline", "injected",
        "replica", "recomputing", "host_table", "shared_prefix",
        "cached_upto", "block_keys", "parent_id", "tag", "session", "sent_time",
        "client_first_time", "client_last_time", "group_tables",
    )

    def __init__(
        self,
        req_id: int,
        arrival_time: float,
        prompt_len: int,
        max_output_tokens: int,
        *,
        priority: int = 0,
        hash_ids: tuple[int, ...] | None = None,
        cancel_at: float | None = None,
        prompt_text: bytes | None = None,
        injected: bool = False,
    ) -> None:
        self.req_id = req_id
        self.arrival_time = arrival_time
        self.prompt_len = prompt_len
        self.max_output_tokens = max_output_tokens
        self.priority = priority
        self.hash_ids = hash_ids
        self.cancel_at = cancel_at
        self.prompt_text = prompt_text
        self.injected = injected
        self.replica = 0
        self.tag: str | None = None  # who sent it (servesim serve: the client's address)
        # The client's side of the API server (sim.engine.frontend): when it sent the request,
        # and when its first and last tokens reached it (None: no server in front, or not yet)
        self.sent_time = arrival_time
        self.client_first_time: float | None = None
        self.client_last_time: float | None = None

        self.state = RequestState.WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.host_table: list[int] = []  # host swap blocks while SWAPPED
        # With sliding-window layers, the other layer groups' tables (sim.engine.kv); None
        # while it holds no blocks
        self.group_tables: list[list[int]] | None = None
        self.shared_prefix: tuple[int, int] | None = None  # (group, tokens) of a system prompt
        self.cached_upto = 0  # full blocks of block_table registered in the prefix cache
        self.block_keys: list | None = None  # prefix-cache keys of the full prompt blocks
        self.parent_id: int | None = None  # parallel sampling: the request this sample forks
        # A turn of a multi-turn conversation: its id (-1: none). Every token of the session's
        # requests is at its place in one stream, the conversation so far.
        self.session = -1
        self.admitted_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        # (step end time, first position, number of tokens) of every prefill chunk.
        self.prefill_chunks: list[tuple[float, int, int]] = []
        self.num_preemptions = 0
        # Set by preemption by recompute until the re-prefill samples again.
        self.recomputing = False
        self.output_token_ids: list[int] = []
        # Output tokens as runs of consecutive engine steps: (first step index, count), read as
        # `token_segments`. Each token's time is the end time of its step on the engine's
        # timeline. The last run is held open in native fields, so that the engine extends it
        # every step without making an int object (a count past 256 is one, each time).
        self.closed_runs: list[list[int]] | None = None  # (None until a run closes: most never)
        self.run_open = False
        self.run_start = 0
        self.run_len = 0
        self.reject_reason: str | None = None
        self.cancelled_in: RequestState | None = None
        # The steps its token segments index: a Timeline, or an engine's view that also holds
        # the tokens sampled before a hand-off (sim.engine.engine._Continued).
        self._timeline: Any = None

    # --- state machine -------------------------------------------------------------------------
    def transition(self, new: RequestState) -> None:
        """Move to `new`. Raises InvalidTransition when the state machine forbids it."""
        if new not in TRANSITIONS[self.state]:
            raise InvalidTransition(
                f"request {self.req_id}: {self.state.value} -> {new.value} is not allowed"
            )
        self.state = new

    # --- token runs ----------------------------------------------------------------------------
    @property
    def token_segments(self) -> list[list[int]]:
        """Every run of output tokens sampled in consecutive engine steps, as [first step
        index, count] (a new list: change them through the setter or `open_run`)."""
        runs = [] if self.closed_runs is None else list(self.closed_runs)
        if self.run_open:
            runs.append([self.run_start, self.run_len])
        return runs

    @token_segments.setter
    def token_segments(self, runs: list[list[int]]) -> None:
        self.closed_runs = [[s, n] for s, n in runs[:-1]] or None
        self.run_open = bool(runs)
        if runs:
            self.run_start, self.run_len = runs[-1][0], runs[-1][1]

    def open_run(self, g: int, k: int) -> None:
        """`k` tokens sampled in steps g, g + 1, ... start a new run (the open one closes)."""
        if self.run_open:
            if self.closed_runs is None:
                self.closed_runs = []
            self.closed_runs.append([self.run_start, self.run_len])
        self.run_open = True
        self.run_start = g
        self.run_len = k

    # --- derived figures -----------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Prompt plus every output token sampled so far."""
        return self.prompt_len + self.num_output_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the newest token still needs its K/V computed."""
        return self.num_tokens - self.num_computed_tokens > 1 or self.num_output_tokens == 0

    @property
    def queue_wait(self) -> float | None:
        return None if self.admitted_time is None else self.admitted_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """At the engine: from its arrival to the sampling of its first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """At the engine: from its arrival to its end."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def client_ttft(self) -> float | None:
        """TTFT as the client measures it: from sending to receiving the first token (the
        engine's TTFT without an API server in front)."""
        first = self.client_first_time
        if first is None:
            first = self.first_token_time
        return None if first is None else first - self.sent_time

    @property
    def client_end_time(self) -> float | None:
        """When the response ended for its client: its end reached it (behind an API server,
        when its last token was handed out) or it was cancelled; None while it runs."""
        end, last = self.finish_time, self.client_last_time
        if end is None or last is None or last < end:
            return end
        return last

    @property
    def client_e2e(self) -> float | None:
        """E2E as the client measures it: from sending to receiving the end of the response."""
        end = self.client_end_time
        return None if end is None else end - self.sent_time

    @property
    def client_tpot(self) -> float | None:
        """TPOT as the client measures it, from the times its first and last tokens reached
        it; None with fewer than two tokens."""
        first, last = self.client_first_time, self.client_last_time
        if first is None or last is None:
            return self.tpot
        if self.num_output_tokens < 2:
            return None
        return (last - first) / (self.num_output_tokens - 1)

    @property
    def tpot(self) -> float | None:
        """(last token - first token) / (n - 1); None with fewer than two tokens."""
        first, last = self.first_token_time, self.last_token_time
        if self.num_output_tokens < 2 or first is None or last is None:
            return None
        return (last - first) / (self.num_output_tokens - 1)

    def token_times(self):
        """Every output token's time, in order (a float64 array)."""
        import numpy as np

        if not self.token_segments or self._timeline is None:
            return np.zeros(0)
        tl = self._timeline
        return np.concatenate([tl.ends(s, n) for s, n in self.token_segments])

    def itls(self):
        """The gaps between consecutive output tokens (seconds)."""
        import numpy as np

        return np.diff(self.token_times())

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id}, {self.state.value}, prompt={self.prompt_len}, "
            f"out={self.num_output_tokens}/{self.max_output_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
