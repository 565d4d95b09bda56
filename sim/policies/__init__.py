"""Scheduling policies, by name. Each is one module with one `Policy` subclass."""

from __future__ import annotations

from sim.native import compiled
from sim.policies.base import Policy, SchedulerOutput
from sim.policies.chunked import ChunkedPolicy
from sim.policies.contiguous import ContiguousPolicy
from sim.policies.fcfs import FCFSPolicy
from sim.policies.lpm import LPMPolicy
from sim.policies.priority import PriorityPolicy
from sim.policies.sjf import SJFPolicy
from sim.policies.static import StaticPolicy


def _by_name(cls: type[Policy]) -> type[Policy]:
    """The class the engine instantiates for `cls`: `cls` itself, or, where the install compiled
    it (sim/native/compiled.py), an interpreted subclass adding nothing. A compiled class's own
    instances call its methods through a table fixed when it was built; an interpreted
    subclass's instances look every call up by name, so a rule replaced on any policy class
    at run time (a patched `Policy.watermark_blocks`, a notebook's experiment) still reaches
    every policy built on it."""
    if compiled.COMPILED and cls.__module__ in compiled.MODULES:
        return type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__})
    return cls


POLICIES: dict[str, type[Policy]] = {
    cls.name: _by_name(cls) for cls in (StaticPolicy, FCFSPolicy, ChunkedPolicy, PriorityPolicy,
                                        SJFPolicy, LPMPolicy, ContiguousPolicy)
}

__all__ = ["POLICIES", "Policy", "SchedulerOutput"]
