"""What a scenario deploys: one `Engine`, or a deployment of several (`Cluster`: replicas, a
disaggregated pair; `sim.deploy.parallel`: data-parallel ranks, pipeline virtual engines)."""

from __future__ import annotations

from sim.deploy.cluster import Cluster
from sim.deploy.parallel import DataParallel, PipelineParallel
from sim.engine.engine import Engine
from sim.errors import ScenarioError
from sim.inputs.workload import Workload


def is_deployment(scenario, policy: str | None = None) -> bool:
    """Whether the scenario (under `policy`, default its own) deploys several instances."""
    name = policy or scenario.scheduler.policy
    m = scenario.model
    return (name == "disaggregated" or scenario.cluster.replicas > 1 or m.data_parallel > 1
            or m.pipeline_parallel > 1)


def deployment(scenario, **kw) -> "Cluster":
    """The deployment of several instances the scenario makes (`Cluster`'s arguments): data-
    parallel ranks, pipeline virtual engines (sim.deploy.parallel), or else replicas or a
    disaggregated pair. Raises ScenarioError for a disaggregated pair of ranks or stages."""
    m = scenario.model
    if (kw.get("policy") or scenario.scheduler.policy) == "disaggregated" and (
            m.data_parallel > 1 or m.pipeline_parallel > 1):
        raise ScenarioError(f"{scenario.source}: model.data_parallel = {m.data_parallel}, "
                            f"pipeline_parallel = {m.pipeline_parallel}: a disaggregated pair "
                            "of ranks or stages is not modeled")
    if scenario.model.data_parallel > 1:
        return DataParallel(scenario, **kw)
    if scenario.model.pipeline_parallel > 1:
        return PipelineParallel(scenario, **kw)
    return Cluster(scenario, **kw)


def build(scenario, *, policy: str | None = None, make_executor=None,
          workload: Workload | None = None, record_events: bool = True,
          skip_ahead: bool = True, clock: str | None = None, keep_history: bool = True):
    """What the scenario deploys: a plain `Engine` for one instance, else a `Cluster`.

    `make_executor(scenario)`, when given, builds the real-compute executor of each instance.
    Raises ScenarioError on a deployment that is not modeled.
    """
    if is_deployment(scenario, policy):
        return deployment(scenario, policy=policy, make_executor=make_executor,
                          workload=workload, record_events=record_events,
                          skip_ahead=skip_ahead, clock=clock, keep_history=keep_history)
    return Engine(scenario, policy=policy, workload=workload,
                  executor=make_executor(scenario) if make_executor else None,
                  record_events=record_events, skip_ahead=skip_ahead, clock=clock,
                  keep_history=keep_history)
