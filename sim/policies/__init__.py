"""Scheduling policies, by name. Each is one module with one `Policy` subclass."""

from __future__ import annotations

from sim.policies.base import Policy, SchedulerOutput
from sim.policies.chunked import ChunkedPolicy
from sim.policies.contiguous import ContiguousPolicy
from sim.policies.fcfs import FCFSPolicy
from sim.policies.lpm import LPMPolicy
from sim.policies.priority import PriorityPolicy
from sim.policies.sjf import SJFPolicy
from sim.policies.static import StaticPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (StaticPolicy, FCFSPolicy, ChunkedPolicy, PriorityPolicy, SJFPolicy,
                              LPMPolicy, ContiguousPolicy)
}

__all__ = ["POLICIES", "Policy", "SchedulerOutput"]
