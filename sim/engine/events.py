"""The engine's stream of typed events, in simulated-time order.

Every state transition of a request is one event; the tokens of engine steps are grouped into one
`Steps` event per run of identical steps (a decode-only stretch can be thousands of steps long),
and user actions (inject, cancel, policy switch) are events too, with the engine step at which
they took effect, so that a session can be replayed exactly. Times are simulated seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np


@dataclass(slots=True)
class Event:
    t: float

    kind = "event"

    def to_dict(self) -> dict:
        out = {"kind": self.kind}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray):
                v = v.tolist()
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out


@dataclass(slots=True)
class Arrival(Event):
    req_id: int
    prompt_len: int
    max_output_tokens: int
    priority: int = 0
    injected: bool = False
    kind = "arrival"


@dataclass(slots=True)
class Reject(Event):
    req_id: int
    reason: str
    kind = "reject"


@dataclass(slots=True)
class Admit(Event):
    """The request was scheduled: for the first time, or again after a preemption."""

    req_id: int
    resumed: bool = False
    kind = "admit"


@dataclass(slots=True)
class Steps(Event):
    """`len(ends)` consecutive engine steps starting at time `t`, index `step`.

    `prefill` holds (req_id, start_pos, num_tokens) chunks (only in single-step runs); `decode`
    the requests that got one token in every step of the run. `tokens`, with real compute, maps
    req_id to the token ids it sampled in these steps, in order. `kv_used` is the number of
    blocks in use after the last step.
    """

    step: int
    ends: np.ndarray
    prefill: tuple = ()
    decode: tuple = ()
    tokens: dict | None = None
    kv_used: int = 0
    durs: np.ndarray | None = None  # measured step durations (clock = "measured" only)
    kind = "steps"


@dataclass(slots=True)
class FirstToken(Event):
    req_id: int
    kind = "first_token"


@dataclass(slots=True)
class Recomputed(Event):
    """A request preempted by recompute has re-prefilled its tokens and sampled again."""

    req_id: int
    kind = "recomputed"


@dataclass(slots=True)
class Fork(Event):
    """Parallel sampling: `child`, a further sample of `parent`, starts after the shared
    prefill, sharing its full prompt blocks (its partial last block is copied)."""

    parent: int
    child: int
    kind = "fork"


@dataclass(slots=True)
class Preempt(Event):
    req_id: int
    mode: str = "recompute"
    kind = "preempt"


@dataclass(slots=True)
class Finish(Event):
    req_id: int
    kind = "finish"


@dataclass(slots=True)
class Cancel(Event):
    req_id: int
    state: str  # the state the request was cancelled in
    by: str = "client"
    kind = "cancel"


@dataclass(slots=True)
class UserAction(Event):
    """An action taken through the live API, applied before engine step `step`."""

    step: int
    action: str
    args: dict = field(default_factory=dict)
    kind = "action"


@dataclass(slots=True)
class Route(Event):
    """A deployment of several instances sent request `req_id` to instance `instance`; `why`
    says by which rule (the router's, see sim.deploy.cluster)."""

    req_id: int
    instance: int
    why: str = ""
    kind = "route"


@dataclass(slots=True)
class Handoff(Event):
    """Prefill/decode disaggregation: one step of request `req_id`'s hand-off.

    `phase` "ready" (prefill instance): its first token is out, it left the prefill batch and
    waits for room on the decode instance, its `blocks` blocks still held; "start" (decode
    instance): `blocks` blocks are allocated for it there and its K/V is on the link until
    `end`; "sent" (prefill instance): the transfer is over, its prefill blocks are freed;
    "joined" (decode instance): it joined the decode batch.
    """

    req_id: int
    phase: str
    blocks: int = 0
    end: float = 0.0
    kind = "handoff"


@dataclass(slots=True)
class Stream(Event):
    """In the session log of a deployment of several instances, the events that follow are
    those of instance `instance` (-1: the deployment's own: routing, user actions, requests
    cancelled between instances)."""

    instance: int
    kind = "stream"


EVENT_TYPES = {cls.kind: cls for cls in
               (Arrival, Reject, Admit, Steps, FirstToken, Preempt, Finish, Cancel, UserAction,
                Recomputed, Fork, Route, Handoff, Stream)}
