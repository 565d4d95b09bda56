"""servesim's simulation core: requests, workloads, KV blocks, policies, the service-time model,
the engine, deployments of several engines, metrics and session logs. Nothing here imports
Textual or CuPy."""

from sim.native import compiled

compiled.activate()  # (before anything imports a module the install may have compiled)

from sim.deploy.build import build
from sim.deploy.cluster import Cluster, ClusterSnapshot
from sim.engine.engine import Engine, EngineSnapshot, RequestView
from sim.errors import (EngineError, LogError, ScenarioError, ServesimError, TraceError,
                        UnknownRequestError)
from sim.stats.metrics import rolling, summarize
from sim.policies import POLICIES
from sim.engine.request import Request, RequestState
from sim.inputs.scenario import Scenario, bundled_scenarios, load_scenario

__version__ = "0.1.0"

__all__ = [
    "Engine", "EngineSnapshot", "RequestView", "Cluster", "ClusterSnapshot", "build", "EngineError", "LogError", "ScenarioError",
    "ServesimError", "TraceError", "UnknownRequestError", "rolling", "summarize", "POLICIES",
    "Request", "RequestState", "Scenario", "bundled_scenarios", "load_scenario", "__version__",
]
