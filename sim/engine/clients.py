"""A client mix's figures (`workload.clients`): each client's requests by how they ended, their
latencies and how many met the client's SLO class, folded as requests end (the summary's
`clients`)."""

from __future__ import annotations

from typing import Any

from sim.engine.observer import StepObserver
from sim.engine.request import Request, RequestState
from sim.engine.stepping import met_slo
from sim.stats.quantiles import Samples


class ClientFigures(StepObserver):
    """Per client, by name: the requests ended (`finished`, `cancelled`, `rejected`), the
    finished ones' TTFT and E2E, and how many of those met the client's SLO class."""

    def __init__(self, names: list[str]) -> None:
        self.counts = {n: {"finished": 0, "cancelled": 0, "rejected": 0, "slo_met": 0}
                       for n in names}
        self.ttft = {n: Samples() for n in names}
        self.e2e = {n: Samples() for n in names}

    def ended(self, engine: Any, req: Request) -> None:
        counts = self.counts.get(req.tag) if req.parent_id is None else None
        if counts is None:  # an injected request, or a further sample
            return
        counts[req.state.value] += 1
        if req.state is not RequestState.FINISHED:
            return
        ttft, e2e = req.client_ttft, req.client_e2e  # (the client's, behind a front end)
        assert ttft is not None and e2e is not None  # (a finished request has both)
        self.ttft[req.tag].add(ttft)
        self.e2e[req.tag].add(e2e)
        if met_slo(engine, req):  # (as the run's own count judges it)
            counts["slo_met"] += 1
