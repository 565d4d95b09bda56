"""The API server in front of an engine, as a benchmark's client meets it.

A request the client sends at `sent_time` reaches the engine (its `arrival_time`) after
tokenisation per prompt token and a fixed time per request. The server tokenises one request at
a time, in the order they were sent (vLLM's API server and SGLang's tokenizer manager are each
one process whose event loop tokenises), so a request sent while another is tokenised waits for
it; the time per request (HTTP, checks, the hand-offs between processes) is latency, which
requests spend side by side, so it delays each request without holding the server.

The tokens a step samples come back the same way: the server takes each step's outputs in the
order the steps end and spends `frontend_output_token_us` on each token (detokenising it,
building its streamed chunk and writing it), one step's outputs after the other's, and the
step's tokens reach their clients when it is done with them (`deliver`). At light load that is
the time per token after the step; at hundreds of streams a step's tokens can take longer than
the step, and the server's backlog grows: the clients then receive tokens at the server's rate,
not the engine's, and a closed-loop user, who sends again when the end of its response has
reached it, waits for the backlog too. So the client's TTFT, TPOT and E2E are from the times
the server hands tokens out, the engine's from the times it sampled them. The server runs apart
from the engine's own process in the engines modelled (vLLM since 0.6, SGLang), so neither its
intake nor its output work lengthens engine steps, and each is modelled as a queue of its own
(one process's event loop does both in vLLM: under a backlog of outputs its intake would wait
too, which this leaves out).

Only the workload's requests pass its intake: a request injected into the engine (the
dashboard, `servesim serve`, whose HTTP server is real) arrives at the engine as it is sent.
Every step's tokens pass its output side, an injected request's with the rest (the server's
time on them is spent whoever sent them).
"""

from __future__ import annotations

from typing import Any

import numpy as np


# Its terms, as `[engine]` names them.
TERMS = ("frontend_request_us", "frontend_prompt_token_us", "frontend_output_token_us")


class FrontEnd:
    """The API server of an engine profile (`engine.frontend_*`), and when it is next free."""

    request_s: float
    prompt_token_s: float
    token_s: float
    free: float
    out_free: float

    def __init__(self, request_us: float, prompt_token_us: float, output_token_us: float) -> None:
        self.request_s = request_us * 1e-6
        self.prompt_token_s = prompt_token_us * 1e-6
        self.token_s = output_token_us * 1e-6
        self.free = 0.0  # when the server has tokenised every request sent so far
        self.out_free = 0.0  # when it has handed out every token sampled so far

    @classmethod
    def of(cls, engine_cfg: Any) -> FrontEnd | None:
        """The front end an `[engine]` section describes; None when all its terms are zero
        (the engine's times are the client's)."""
        terms = [getattr(engine_cfg, k) for k in TERMS]
        return cls(*terms) if any(terms) else None

    def intake(self, sent: float, prompt_len: int) -> float:
        """When a request of `prompt_len` tokens sent at `sent` reaches the engine. Calls must
        come in the order the requests were sent (the arrivals are then in that order too)."""
        start = sent if sent > self.free else self.free
        self.free = start + prompt_len * self.prompt_token_s
        return self.free + self.request_s

    def deliver(self, end: float, sampled: int) -> float:
        """A step ending at `end` (after every step delivered before) has sampled `sampled`
        tokens: when the server has handed them to their clients. They wait for the server to
        be done with the steps before, then take `sampled` times its time per token."""
        d: float = self.out_free
        d = (end if end > d else d) + sampled * self.token_s
        self.out_free = d
        return d

    def deliver_run(self, ends: list[float], sampled: int) -> list[float]:
        """`deliver` of steps ending at `ends`, in order, each with `sampled` tokens: when each
        one's are handed out."""
        return [self.deliver(end, sampled) for end in ends]

    def mark(self, req: Any, sent: float) -> None:
        """`req`, sent at `sent`, came through this front end."""
        req.sent_time = sent

    def arrivals(self, sent: np.ndarray, prompt: np.ndarray) -> np.ndarray:
        """`intake` of every request of an open-loop workload (sent times in order): their
        arrival times at the engine, in the same order."""
        return np.array([self.intake(t, n) for t, n in zip(sent.tolist(), prompt.tolist())],
                        dtype=np.float64)


def open_loop(front: FrontEnd | None, sent: np.ndarray,
              prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """An open-loop workload (its arrival column `sent`: when its clients send) behind `front`
    (None: none): when each request reaches the engine, and when it was sent (None without a
    front end: the engine's times are the client's)."""
    if front is None:
        return sent, None
    return front.arrivals(sent, prompt), sent
