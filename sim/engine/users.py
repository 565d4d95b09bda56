"""Closed-loop arrivals: `workload.concurrency` users, each sending its next request when its last
one has ended (finished, cancelled or rejected) plus `workload.think_time_s` and the client's
`turnaround_s`, as `vllm bench serve --max-concurrency` keeps that many requests in flight; and
multi-turn conversations, where each turn's prompt is the conversation so far.

The requests' lengths, priorities and cancellation delays are the workload's rows, drawn before
the run (sim.inputs.workload: arrival times all 0, `cancel_at` the delay after the request's
own arrival); a row is given to each arrival in arrival order, so request ids are rows as in an
open-loop run. Arrival times depend only on when requests end, so a replay that regenerates the
same completions regenerates the same arrivals. Behind an API server (sim.engine.frontend) a user
sends once the end of its last response has reached it (and it has thought and turned round),
and a row goes to each request as it is sent, in that order.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Any

import numpy as np

from sim.engine.observer import StepObserver
from sim.engine.request import Request, RequestState
from sim.engine.tokens import SESSION_STREAM, prompt_token_ids


class _User:
    __slots__ = ("session", "turn", "history", "history_ids", "group", "row", "sent")

    def __init__(self) -> None:
        self.session = -1   # the conversation under way (-1: none)
        self.turn = 0       # turns of it sent
        self.history = 0    # its tokens so far: every earlier turn's prompt and output
        self.history_ids: np.ndarray | None = None  # those tokens, with real compute
        self.group = -1     # its system prompt (workload.shared_prefix_groups)
        # Behind a front end: the row and sent time of its request on its way to the engine
        # (-1: none; its next entry in the arrival list is when it sends).
        self.row = -1
        self.sent = 0.0


class ClosedLoop(StepObserver):
    """The closed-loop users of an engine: they own the engine's arrival list (its future
    arrival times, sorted), which they extend as requests end."""

    COMPACT = 1024  # arrivals already taken, past which the list drops them

    def __init__(self, engine: Any) -> None:
        w, cfg = engine.workload, engine.scenario.workload
        self.rows = len(w)
        self.users = [_User() for _ in range(min(cfg.concurrency, self.rows))]
        # a user's next request reaches the server this long after its last one ended for it
        self.resend = cfg.think_time_s + cfg.turnaround_s
        self.turns = cfg.turns
        self.stop = cfg.duration_s or np.inf  # no request is sent from this time on
        self.seed = engine.scenario.seed
        self.workload = w
        # The API server in front (sim.engine.frontend), or None. Without one the arrival list
        # holds when requests reach the engine, each taking its row then. With one it holds
        # when they are sent, then, once a send is due, when that request reaches the engine:
        # a request takes its row when it is sent, and passes the server in the order sent.
        self.frontend = engine.frontend
        self.next_row = 0
        # User u starts at u x ramp_up_s / concurrency, and start_gap_s after the user before
        # at least (sorted as the users are): a client sends one request at a time, so users
        # started together reach the idle engine one after another, and it starts a step on
        # the first; they are not one batch for the whole run. (Later requests due together
        # reach a busy engine within one step, and are batched together.)
        ramp, gap = cfg.ramp_up_s / cfg.concurrency, cfg.start_gap_s
        firsts = list(itertools.accumulate(
            (u * ramp for u in range(len(self.users))),
            lambda before, t: max(t, before + gap)))
        self.pending = [(t, u, u) for u, t in enumerate(firsts) if t < self.stop]
        self.arrivals = [t for t, _, _ in self.pending]
        self.sent = len(self.pending)   # arrivals scheduled so far (rows they will take)
        self.seq = len(self.pending)    # ties in time go in the order they were scheduled
        self.sessions = 0
        self.user_of: dict[int, int] = {}  # live requests -> the user that sent them

    def request(self, e: Any, t: float) -> Request | None:
        """The request arriving at `t`, the earliest pending arrival; None when that is a
        request sent to the front end, which now schedules its arrival at the engine."""
        _, _, u = heapq.heappop(self.pending)
        user = self.users[u]
        fe = self.frontend
        if fe is None:
            i, sent = self.next_row, t
            self.next_row += 1
        elif user.row < 0:  # sent now: through the front end to the engine
            user.row, user.sent = self.next_row, t
            self.next_row += 1
            prompt = user.history + self._new_tokens(
                user, int(self.workload.prompt[user.row]))
            self._schedule(e, fe.intake(t, prompt), u)
            return None
        else:
            i, sent = user.row, user.sent
            user.row = -1
        w = e.workload
        prompt, output, priority, cancel_at = e._w_cols
        c = cancel_at[i]
        group = -1 if w.prefix_group is None else w.prefix_group[i].item()
        new = self._new_tokens(user, prompt[i])
        if self.turns > 1 and user.turn == 0:
            user.session, user.group = self.sessions, group
            self.sessions += 1
        req = Request(i, t, user.history + new, output[i], priority=priority[i],
                      hash_ids=w.hash_ids[i] if w.hash_ids else None,
                      cancel_at=None if c != c else sent + c)
        if fe is not None:
            fe.mark(req, sent)
        if w.prefix_group is not None:
            req.shared_prefix = ((group if user.turn == 0 else user.group), w.prefix_tokens)
        if e._w_tags is not None:
            req.tag = e._w_tags[i]
        if self.turns > 1:
            req.session = user.session
            user.turn += 1
            if e.executor is not None:  # real compute: the conversation's own tokens
                vocab = e.scenario.compute.vocab_size
                if user.history_ids is None:
                    ids = prompt_token_ids(self.seed, req, vocab, w.hash_block_size)
                else:
                    rng = np.random.default_rng([self.seed, SESSION_STREAM, user.session,
                                                 user.turn])
                    ids = np.concatenate((user.history_ids,
                                          rng.integers(0, vocab, size=new, dtype=np.int32)))
                e._prompt_ids[i] = user.history_ids = ids
        self.user_of[i] = u
        return req

    def ended(self, engine: Any, req: Request) -> None:
        u = self.user_of.pop(req.req_id, None)
        if u is None:  # an injected request, or a further sample
            return
        user = self.users[u]
        engine._prompt_ids.pop(req.req_id, None)  # (a rejected request was never dropped)
        if self.turns > 1:
            if req.state is RequestState.FINISHED and user.turn < self.turns:
                user.history = req.prompt_len + req.num_output_tokens
                if user.history_ids is not None:
                    user.history_ids = np.concatenate(
                        (user.history_ids, np.asarray(req.output_token_ids, dtype=np.int32)))
            else:  # the conversation is over (or cut short): the next request starts another
                user.turn, user.history, user.history_ids = 0, 0, None
        # (the user sends again once the response has ended for it, it has thought and its
        # client has turned round)
        t = float(req.client_end_time) + self.resend
        if self.sent >= self.rows or not t < self.stop:
            return
        self.sent += 1
        self._schedule(engine, t, u)

    def _schedule(self, engine: Any, t: float, u: int) -> None:
        """User `u`'s next entry in the arrival list is at `t`."""
        heapq.heappush(self.pending, (t, self.seq, u))
        self.seq += 1
        arr, k = self.arrivals, engine._w_next
        if k > self.COMPACT:  # (in place: the engine's arrival loop holds this list)
            del arr[:k]
            engine._w_next = k = 0
        bisect.insort(arr, t, lo=k)

    def _new_tokens(self, user: _User, prompt: int) -> int:
        """The tokens a turn adds to the conversation, given its row's prompt length: all of
        them, less the system prompt after a conversation's first turn (it came with that)."""
        if self.turns > 1 and user.turn > 0 and self.workload.prefix_group is not None:
            return prompt - self.workload.prefix_tokens
        return prompt
