"""The API server in front of an engine, as a benchmark's client meets it.

A request the client sends at `sent_time` reaches the engine (its `arrival_time`) after
tokenisation per prompt token and a fixed time per request. The server tokenises one request at
a time, in the order they were sent (vLLM's API server and SGLang's tokenizer manager are each
one process whose event loop tokenises), so a request sent while another is tokenised waits for
it; the time per request (HTTP, checks, the hand-offs between processes) is latency, which
requests spend side by side, so it delays each request without holding the server. Each output
token reaches the client `stream_delay` after the engine samples it (detokenisation and
streaming), so the client's TTFT and E2E are the engine's plus the time in and the time out,
and its ITL and TPOT are the engine's. The server runs apart from the engine's own process in
the engines modelled (vLLM since 0.6, SGLang), so its CPU time does not lengthen engine steps.

Only the workload's requests pass through it: a request injected into the engine (the
dashboard, `servesim serve`, whose HTTP server is real) arrives at the engine as it is sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np


# Its terms, as `[engine]` names them.
TERMS = ("frontend_request_us", "frontend_prompt_token_us", "frontend_output_token_us")


class FrontEnd:
    """The API server of an engine profile (`engine.frontend_*`), and when it is next free."""

    __slots__ = ("request_s", "prompt_token_s", "stream_delay", "free")

    def __init__(self, request_us: float, prompt_token_us: float, output_token_us: float) -> None:
        self.request_s = request_us * 1e-6
        self.prompt_token_s = prompt_token_us * 1e-6
        self.stream_delay = output_token_us * 1e-6
        self.free = 0.0  # when the server has tokenised every request sent so far

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

    def mark(self, req: Any, sent: float) -> None:
        """`req`, sent at `sent`, came through this front end."""
        req.sent_time = sent
        req.stream_delay = self.stream_delay

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
