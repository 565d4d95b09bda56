"""Admission control in front of the queue (`[admission]`): a bound on the requests waiting and a
token-bucket rate limit. A request refused here ends `rejected`, with a reason that
`is_refusal` tells apart from a request that could never fit (`servesim serve`: 429 against
400)."""

from __future__ import annotations

# How every refusal's reason starts.
REFUSED = "refused by admission control: "


def is_refusal(reason: str) -> bool:
    """Whether a rejection's reason is admission control's (the server was busy), not the
    request's own (it could never fit)."""
    return reason.startswith(REFUSED)


class Admission:
    """The scenario's `[admission]` rules, with the token bucket's state."""

    __slots__ = ("max_waiting", "rate", "burst", "tokens", "last")

    def __init__(self, max_waiting: int, rate: float, burst: int) -> None:
        self.max_waiting = max_waiting
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)  # the bucket starts full
        self.last = 0.0

    @staticmethod
    def of(cfg) -> "Admission | None":
        """The rules of an `[admission]` section, or None when it sets none."""
        if not cfg.max_waiting and not cfg.rate:
            return None
        return Admission(cfg.max_waiting, cfg.rate, cfg.burst)

    def refuse(self, t: float, num_waiting: int) -> str | None:
        """Why a request arriving at `t` with `num_waiting` requests queued is refused, or None
        when it is admitted to the queue (it then takes a token from the bucket)."""
        if self.max_waiting and num_waiting >= self.max_waiting:
            return f"{REFUSED}{num_waiting} requests waiting (admission.max_waiting)"
        if self.rate:
            if t > self.last:  # (an arrival dated before the last one adds nothing)
                self.tokens = min(float(self.burst), self.tokens + (t - self.last) * self.rate)
                self.last = t
            if self.tokens < 1.0:
                return f"{REFUSED}over {self.rate:g} requests/s (admission.rate)"
            self.tokens -= 1.0
        return None
