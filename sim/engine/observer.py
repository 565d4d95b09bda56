"""The seam through which other code watches what the engine schedules, without changing it."""

from __future__ import annotations

from typing import Any

from sim.engine.request import Request


class StepObserver:
    """Watches what the engine schedules, without changing it: pass instances as
    `Engine(..., observers=[...])` (or append to `engine.observers`). Each method is called
    once per event, in simulated order; the base methods do nothing."""

    def admitted(self, engine: Any, req: Request) -> None:
        """`req` joined the running batch (first admission or after a preemption), at
        `engine.now`, before the step that computes it (step `engine.step_count`)."""

    def stepped(self, engine: Any, sched: list[tuple[Request, int]]) -> None:
        """A single step has run: `sched` is its (request, tokens computed) in batch order;
        the clock, step count, tokens and finishes are updated."""

    def decoded(self, engine: Any, reqs: list[Request], steps: int) -> None:
        """`steps` identical decode-only steps of `reqs` have run at once (the engine's
        skip-ahead); the clock, step count, tokens and finishes are updated."""

    def ended(self, engine: Any, req: Request) -> None:
        """`req` has ended (finished, cancelled or rejected; `req.finish_time` says when)."""
