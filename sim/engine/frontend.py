"""The API server in front of an engine, as a benchmark's client meets it.

A request the client sends at `sent_time` reaches the engine (its `arrival_time`) after
tokenisation per prompt token and a fixed time per request. The server tokenises one request at
a time, in the order they were sent (vLLM's API server and SGLang's tokenizer manager are each
one process whose event loop tokenises), so a request sent while another is tokenised waits for
it; the time per request (HTTP, checks, the hand-offs between processes) is latency, which
requests spend side by side, so it delays each request without holding the server. A
chat-completions request (`workload.endpoint = "chat"`) first takes the server's own time on
it (`frontend_chat_request_us`: rendering the model's chat template and the chat request's
handling), one request after another as the tokenising: a burst of chat requests queues for
it, and at light load it is latency like the rest.

The tokens a step samples come back the same way: the server takes each step's outputs in the
order the steps end and spends `frontend_output_token_us` on each token (detokenising it,
building its streamed chunk and writing it), one step's outputs after the other's, and the
step's tokens reach their clients when it is done with them (`deliver`). At light load that is
the time per token after the step; at hundreds of streams a step's tokens can take longer than
the step, and the server's backlog grows: the clients then receive tokens at the server's rate,
not the engine's, and a closed-loop user, who sends again after the end of its response has
reached it, waits for the backlog too. So the client's TTFT, TPOT and E2E are from the times
the server hands tokens out, the engine's from the times it sampled them. The server runs apart
from the engine's own process in the engines modelled (vLLM since 0.6, SGLang), so neither its
intake nor its output work lengthens engine steps, and each is modelled as a queue of its own.
Where one event loop does both (`frontend_one_loop`: vLLM's API server), tokens sampled while
the server is taking in requests wait until it is done with those already sent: a burst of
requests holds back every stream's tokens, first tokens included, until the last of the burst
is taken in. (The other way round, intake waiting behind a backlog of outputs, is left out;
so is the coupling in a deployment, whose instances hand out their tokens on servers of their
own, apart from the deployment's intake.)

Only the workload's requests pass its intake: a request injected into the engine (the
dashboard, `servesim serve`, whose HTTP server is real) arrives at the engine as it is sent.
Every step's tokens pass its output side, an injected request's with the rest (the server's
time on them is spent whoever sent them).
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import numpy as np


# Its terms, as `[engine]` names them.
TERMS = ("frontend_request_us", "frontend_prompt_token_us", "frontend_output_token_us")
# The server's own time on a chat-completions request: spent only where the workload's requests
# are chat requests (`workload.endpoint = "chat"`) of a model with a chat template.
CHAT_TERM = "frontend_chat_request_us"


class FrontEnd:
    """The API server of an engine profile (`engine.frontend_*`), and when it is next free."""

    request_s: float
    prompt_token_s: float
    token_s: float
    chat_s: float
    one_loop: bool
    free: float
    out_free: float
    spells: Any  # array('d'): unboxed, 16 bytes a spell
    spell_at: int
    spell_start: float
    spell_end: float
    keep_spells: bool

    def __init__(self, request_us: float, prompt_token_us: float, output_token_us: float,
                 chat_request_us: float = 0.0, one_loop: bool = False) -> None:
        self.request_s = request_us * 1e-6
        self.prompt_token_s = prompt_token_us * 1e-6
        self.token_s = output_token_us * 1e-6
        self.chat_s = chat_request_us * 1e-6  # its own time on each request, before tokenising
        self.one_loop = one_loop
        self.free = 0.0  # when the server has tokenised every request sent so far
        self.out_free = 0.0  # when it has handed out every token sampled so far
        # With one loop: its intake's busy spells, start and end after each other in time
        # order, and the first that a delivery may still meet.
        self.spells = array("d")
        self.spell_at = 0
        # the spell at spell_at (infinite where none is left: nothing to wait out)
        self.spell_start = self.spell_end = math.inf
        self.keep_spells = False  # (true: every spell kept, for sim.model.fit's replay)

    @classmethod
    def of(cls, engine_cfg: Any, chat: bool = False) -> FrontEnd | None:
        """The front end an `[engine]` section describes, its requests chat-completions ones
        where `chat` (a chat workload of a model with a chat template); None when all its
        terms are zero (the engine's times are the client's)."""
        request, prompt_token, output_token = (float(getattr(engine_cfg, k)) for k in TERMS)
        chat_request = float(getattr(engine_cfg, CHAT_TERM)) if chat else 0.0
        if not (request or prompt_token or output_token or chat_request):
            return None
        return cls(request, prompt_token, output_token, chat_request,
                   bool(engine_cfg.frontend_one_loop))

    def intake(self, sent: float, prompt_len: int) -> float:
        """When a request of `prompt_len` tokens sent at `sent` reaches the engine. Calls must
        come in the order the requests were sent (the arrivals are then in that order too)."""
        start = sent if sent > self.free else self.free
        self.free = start + self.chat_s + prompt_len * self.prompt_token_s
        if self.one_loop:
            # (tokens it had handed out by then, up to `out_free`, went before this request: a
            # closed loop's users send while deliveries are under way)
            busy = start if start > self.out_free else self.out_free
            spells = self.spells
            if self.free > busy:
                if len(spells) and spells[-1] >= busy:  # (busy since the spell before)
                    spells[-1] = self.free
                else:
                    spells.append(busy)
                    spells.append(self.free)
                if self.spell_at + 2 >= len(spells):  # (the spell ahead is this one)
                    self.seek_spell()
        return self.free + self.request_s

    def deliver(self, end: float, sampled: int) -> float:
        """A step ending at `end` (after every step delivered before) has sampled `sampled`
        tokens: when the server has handed them to their clients. They wait for the server to
        be done with the steps before (with one loop, and with the requests it was taking in
        at the time), then take `sampled` times its time per token."""
        d: float = self.out_free
        d = end if end > d else d
        if d >= self.spell_end:  # past the spell ahead: the first not over by `d`
            spells, i = self.spells, self.spell_at
            while i < len(spells) and spells[i + 1] <= d:
                i += 2
            self.spell_at = i
            self.seek_spell()
        if self.spell_start < d:  # (a spell from `d` on starts after them)
            d = self.spell_end
        d = d + sampled * self.token_s
        self.out_free = d
        return d

    def seek_spell(self) -> None:
        """Take the spell at `spell_at` as the one ahead (after `spell_at` moved, or the spells
        changed), and drop, once there are many, those every later delivery is past
        (deliveries come in time order): a long run holds only the spells still ahead."""
        spells, i = self.spells, self.spell_at
        if i >= 2048 and 2 * i >= len(spells) and not self.keep_spells:
            del spells[:i]  # (at most half of them left to move)
            i = self.spell_at = 0
        if i < len(spells):
            self.spell_start, self.spell_end = spells[i], spells[i + 1]
        else:
            self.spell_start = self.spell_end = math.inf

    def wait_out(self, spells: Any) -> None:
        """Deliver as if these intake spells (an array('d') as `spells` holds) had been taken
        in (sim.model.fit's replay of a recorded run). They are not this server's to drop."""
        self.spells, self.spell_at, self.keep_spells = spells, 0, True
        self.seek_spell()

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


def chat_requests(scenario: Any) -> bool:
    """Whether `scenario`'s requests take the API server's time on a chat request: chat
    completions (`workload.endpoint`) of a model whose chat template it renders."""
    return scenario.workload.endpoint == "chat" and bool(scenario.model.chat_template)


def open_loop(front: FrontEnd | None, sent: np.ndarray,
              prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """An open-loop workload (its arrival column `sent`: when its clients send) behind `front`
    (None: none): when each request reaches the engine, and when it was sent (None without a
    front end: the engine's times are the client's)."""
    if front is None:
        return sent, None
    return front.arrivals(sent, prompt), sent
