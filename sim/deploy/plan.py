"""Deployment planning (`servesim plan`): the cheapest deployment of a scenario's model that
serves its workload within latency bounds.

A **candidate** is one deployment: GPU type, tensor-parallel degree, data-parallel ranks,
pipeline stages, expert parallelism (a mixture of experts), replicas and router,
`max_num_seqs`, `max_num_batched_tokens`, policy (`disaggregated`: prefill and decode
instances, at each prefill:decode ratio of the space) and prefix caching. For each, the
search finds the highest **load** (offered requests per second: `workload.rate`, or a trace
replayed faster or slower through `workload.time_scale`; in a closed loop,
`workload.concurrency` users) at which every bound (`ttft_p99 <= 500 ms`, ...) holds, by
growing then bisecting as `--find-max-rate` does (`sweep.RateSearch`; whole users in a closed
loop, whose cost divides by the throughput measured there). A candidate is
**feasible** when that load reaches the required one (the workload's own, `--rate` or
`--concurrency`) and its price fits the budget; feasible candidates rank by dollars per million
output tokens at their highest load.

What keeps it fast (`prune=False` turns all of it off but the runs that stop, for the exhaustive
answer):

- probes replay a short slice of the workload (its first `probe_requests` requests); the
  finalists are then checked on the whole workload and bisected down there if they fail;
- bounds carry between candidates that differ only in GPUs. More GPUs of one type with the same
  settings never support less load per replica: a replicated candidate starts its search at
  `replicas x` the single replica's highest load (checked by its first probe) and grows from
  there in small steps; a failure of the larger sibling caps a smaller one's load;
- a candidate whose best possible cost (its price over the most output tokens per second its
  load cap allows) cannot beat the cheapest deployment found so far stops probing (`pruned`);
  one that fails at the required load stops at once (`infeasible`);
- a run ends as soon as a bound is proven broken (`sweep.run_scenario`'s `stop`), which never
  changes whether it passes;
- the probes of every active candidate run together, a round at a time, on the sweep's
  `Runner` (local processes or Ray); a worker that a round's last probes would leave idle runs
  ahead what the search will likely ask next (`Scheduler`), and decisions wait for whole
  rounds, so the answer does not depend on the workers.

Results go to a JSON-lines file as each candidate ends, so a plan interrupted and run again
with the same file picks up where it stopped (`Journal`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import heapq
import itertools
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sim.errors import ScenarioError, ServesimError, cut, shown
from sim.fileio import json_loads, read_input_text, reason, toml_loads
from sim.inputs.scenario import (BUNDLED_DIR, Scenario, apply_override, find_scenario,
                                 scenario_from_dict)
from sim.inputs.workload import build_workload
from sim.limits import USD_PER_GPU_HOUR_TEXT, usd_per_gpu_hour_ok
from sim.model import presets
from sim.model import trust as T
from sim.model import validate as V
from sim.deploy.build import build
from sim.deploy.sweep import METRICS, RUN_ONLY, RateSearch, Runner, SweepError
from sim.stats.metrics import summarize

PRICES_FILE = BUNDLED_DIR / "prices" / "prices.toml"
GPU_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "h200": "h200", "l40s": "l40s"}
# Hugging Face ids of the model presets, for the serving command lines.
MODEL_IDS = {"llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
             "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
             "llama-2-7b": "meta-llama/Llama-2-7b-chat-hf",
             "llama-2-70b": "meta-llama/Llama-2-70b-chat-hf",
             "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3"}


class PlanError(ServesimError):
    """A plan that cannot run: a bad bound, price table, search space or output file."""


# --- bounds --------------------------------------------------------------------------------------
# The latency percentiles a bound may name: those a probe's row holds (sweep.METRICS).
BOUND_COLUMNS = {c[:-3]: c for c, _ in METRICS if c.endswith("_ms")}


@dataclass(frozen=True)
class Bound:
    """One SLO: a latency percentile of a run (`ttft_p99`) at most `limit_ms`."""

    name: str
    limit_ms: float

    @property
    def column(self) -> str:
        return BOUND_COLUMNS[self.name]

    def text(self) -> str:
        return f"{self.name} <= {self.limit_ms:g} ms"


def parse_bound(text: str) -> Bound:
    """`ttft_p99=500` (ms; `500ms` and `0.5s` too) -> Bound. Raises PlanError naming the
    bound on an unknown metric or a value that is not a positive number."""
    where = f"--slo {text}"
    name, eq, value = text.partition("=")
    name = name.strip()
    if not eq:
        raise PlanError(f"{where}: expected METRIC=MS (e.g. ttft_p99=500)")
    if name not in BOUND_COLUMNS:
        raise PlanError(f"{where}: unknown metric {name!r} (known: {', '.join(BOUND_COLUMNS)})")
    v = value.strip().lower()
    scale = 1.0
    if v.endswith("ms"):
        v = v[:-2]
    elif v.endswith("s"):
        v, scale = v[:-1], 1000.0
    try:
        limit = float(v) * scale
    except ValueError:
        limit = math.nan
    if not 0 < limit < math.inf:
        raise PlanError(f"{where}: the bound must be a positive number of ms "
                        f"(got {shown(value.strip())})")
    return Bound(name, limit)


def parse_bounds(texts: list[str]) -> list[Bound]:
    """Every `--slo`; a metric given twice is refused."""
    bounds = [parse_bound(t) for t in texts]
    if not bounds:
        raise PlanError("--slo: give at least one bound (e.g. --slo ttft_p99=2000 --slo "
                        "tpot_p99=100)")
    names = [b.name for b in bounds]
    for n in names:
        if names.count(n) > 1:
            raise PlanError(f"--slo {n}: given twice")
    return bounds


def worst_bound(row: dict, bounds: list[Bound]) -> tuple[Bound, float | None]:
    """The bound a run's row comes closest to breaking (or breaks most): (bound, value). A run
    stopped early (`stopped_s`) has lower bounds of some figures, none of the rest."""
    def ratio(b: Bound) -> float:
        v = row.get(b.column)
        if v is None:
            return -math.inf if row.get("stopped_s") is not None else math.inf
        return v / b.limit_ms
    b = max(bounds, key=ratio)
    return b, row.get(b.column)


def meets(row: dict, bounds: list[Bound]) -> bool:
    """Whether a run met every bound (a run with no value for one, nothing finished, did not)."""
    return all(row.get(b.column) is not None and row[b.column] <= b.limit_ms for b in bounds)


# --- prices --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Price:
    usd_per_gpu_hour: float
    source: str  # where the figure comes from, or "--price"
    date: str


def load_prices(path: str | Path = PRICES_FILE) -> dict[str, Price]:
    """The price table: `[gpu.PRESET]` tables of `usd_per_gpu_hour`, `source` and `date`.
    Raises PlanError naming the file, field and value of the first bad row."""
    path = Path(path)
    try:
        raw = toml_loads(read_input_text(path, limit=1 << 20))
    except ServesimError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"{path}: cannot read: {reason(e)}") from None
    except ValueError as e:  # tomllib.TOMLDecodeError
        raise PlanError(f"{path}: not valid TOML: {e}") from None
    table = raw.get("gpu")
    unknown = [k for k in raw if k not in ("gpu", "note")]
    if unknown:
        raise PlanError(f"{path}: {unknown[0]}: unknown key (a price table holds [gpu.NAME] "
                        "tables and a note)")
    if not isinstance(table, dict) or not table:
        raise PlanError(f"{path}: gpu: no [gpu.NAME] table (each needs usd_per_gpu_hour, "
                        "source, date)")
    out = {}
    for gpu, row in table.items():
        where = f"{path}: gpu.{gpu}"
        if gpu not in presets.HARDWARE:
            raise PlanError(f"{where}: unknown GPU (known: {', '.join(presets.HARDWARE)})")
        if not isinstance(row, dict):
            raise PlanError(f"{where} = {shown(row)}: expected a table")
        for k in row:
            if k not in ("usd_per_gpu_hour", "source", "date", "offer"):
                raise PlanError(f"{where}.{k}: unknown field (usd_per_gpu_hour, source, "
                                "date, offer)")
        usd = row.get("usd_per_gpu_hour")
        if not usd_per_gpu_hour_ok(usd):
            raise PlanError(f"{where}.usd_per_gpu_hour = {shown(usd)}: expected US dollars "
                            f"per GPU-hour, {USD_PER_GPU_HOUR_TEXT}")
        for k in ("source", "date"):
            v = row.get(k)
            if k == "date" and hasattr(v, "isoformat"):
                v = v.isoformat()
            if not isinstance(v, str) or not v.strip():
                raise PlanError(f"{where}.{k} = {shown(v)}: every price needs its {k}")
        date = row["date"]
        out[gpu] = Price(float(usd), row["source"], date.isoformat() if hasattr(date, "isoformat")
                         else date)
    return out


def price_override(text: str) -> tuple[str, Price]:
    """`--price GPU=USD_PER_HOUR` -> (preset, Price). Raises PlanError."""
    gpu, eq, value = text.partition("=")
    try:
        usd = float(value)
    except ValueError:
        usd = math.nan
    if not eq or not usd_per_gpu_hour_ok(usd):
        raise PlanError(f"--price {cut(text, 80)}: expected GPU=USD_PER_GPU_HOUR with a price "
                        f"{USD_PER_GPU_HOUR_TEXT}")
    return gpu_preset(gpu.strip(), "--price"), Price(usd, "--price", "")


def gpu_preset(name: str, where: str = "--gpus") -> str:
    """A GPU name (`h100`, or a hardware preset) -> its preset. Raises PlanError."""
    preset = GPU_ALIASES.get(name.lower(), name.lower())
    if preset not in presets.HARDWARE:
        raise PlanError(f"{where} {name}: unknown GPU (known: "
                        f"{', '.join(sorted({*GPU_ALIASES, *presets.HARDWARE}))})")
    return preset


# --- the search space ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One deployment of the scenario's model."""

    gpu: str
    tp: int
    replicas: int
    router: str
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str
    prefix_caching: bool
    dp: int = 1                    # data-parallel ranks of one engine (model.data_parallel)
    pp: int = 1                    # pipeline stages (model.pipeline_parallel)
    expert_parallel: bool = False  # a mixture of experts split over every GPU of the engine
    prefill: int = 1               # disaggregated: prefill instances (cluster.prefill_instances)
    decode: int = 1                # disaggregated: decode instances (cluster.decode_instances)

    @property
    def disaggregated(self) -> bool:
        return self.policy == "disaggregated"

    @property
    def instances(self) -> int:
        """Engine instances: the replicas, or the prefill and decode instances."""
        return self.prefill + self.decode if self.disaggregated else self.replicas

    @property
    def single(self) -> bool:
        """One engine on its own (no replicas, pair, ranks or stages): what a closed loop runs."""
        return self.replicas == 1 and not self.disaggregated and self.dp == 1 and self.pp == 1

    @property
    def gpus(self) -> int:
        """GPUs it rents: `tp x dp x pp` per instance."""
        return self.tp * self.dp * self.pp * self.instances

    @property
    def key(self) -> str:
        return json.dumps(dataclasses.astuple(self))

    def label(self) -> str:
        """A short description for tables: `h100-sxm TP4 x2 least-outstanding, chunked ...`."""
        deploy = f"P:D {self.prefill}:{self.decode}" if self.disaggregated else f"x{self.replicas}"
        router = f" {self.router}" if self.replicas > 1 or self.prefill > 1 else ""
        policy = "" if self.disaggregated else f" {self.policy}"
        cache = " +prefix-cache" if self.prefix_caching else ""
        par = (f" DP{self.dp}" if self.dp > 1 else "") + (f" PP{self.pp}" if self.pp > 1 else "")
        par += f" EP{self.tp * self.dp}" if self.expert_parallel else ""
        return (f"{self.gpu} TP{self.tp}{par} {deploy}{router}{policy} seqs {self.max_num_seqs} "
                f"tokens {self.max_num_batched_tokens}{cache}")

    def overrides(self) -> list[str]:
        """The scenario fields it sets (`--set` form)."""
        return [f'hardware.preset="{self.gpu}"', f"model.tensor_parallel={self.tp}",
                f"cluster.replicas={1 if self.disaggregated else self.replicas}",
                f'cluster.router="{self.router}"', f"scheduler.max_num_seqs={self.max_num_seqs}",
                f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens}",
                f'scheduler.policy="{self.policy}"',
                f"kv.enable_prefix_caching={str(self.prefix_caching).lower()}",
                f"model.data_parallel={self.dp}", f"model.pipeline_parallel={self.pp}",
                f"model.expert_parallel={self.tp * self.dp if self.expert_parallel else 1}",
                "model.num_gpus=0",  # (the product of the degrees above)
                *([f"cluster.prefill_instances={self.prefill}",
                   f"cluster.decode_instances={self.decode}"] if self.disaggregated else [])]

    def sibling(self, **changes) -> "Candidate":
        return dataclasses.replace(self, **changes)


@dataclass
class Space:
    """The axes searched; `candidates()` is their product, less the combinations not modeled
    (disaggregation with replicas) and the repeats (a router of one replica or prefill
    instance; a prefill:decode ratio for another policy)."""

    gpus: list[str]
    tp: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    replicas: list[int] = field(default_factory=lambda: [1, 2, 4])
    routers: list[str] = field(default_factory=lambda: ["round-robin", "least-outstanding"])
    max_num_seqs: list[int] = field(default_factory=lambda: [128, 256])
    max_num_batched_tokens: list[int] = field(default_factory=lambda: [2048, 8192])
    policies: list[str] = field(default_factory=lambda: ["chunked", "disaggregated"])
    prefix_caching: list[bool] = field(default_factory=lambda: [False, True])
    dp: list[int] = field(default_factory=lambda: [1, 2, 4])
    pp: list[int] = field(default_factory=lambda: [1, 2])
    # (expert parallelism on: searched only for a mixture of experts; see check_space)
    expert_parallel: list[bool] = field(default_factory=lambda: [False, True])
    # disaggregated: (prefill, decode) instances
    pd_ratios: list[tuple[int, int]] = field(
        default_factory=lambda: [(1, 1), (1, 2), (2, 1), (1, 3)])

    def candidates(self) -> list[Candidate]:
        out = []
        for g, tp, r, router, seqs, tokens, pol, pc, dp, pp, ep, (pf, dc) in itertools.product(
                self.gpus, self.tp, self.replicas, self.routers, self.max_num_seqs,
                self.max_num_batched_tokens, self.policies, self.prefix_caching, self.dp,
                self.pp, self.expert_parallel, self.pd_ratios):
            if (dp > 1 or pp > 1) and (r > 1 or pol == "disaggregated" or (dp > 1 and pp > 1)):
                continue  # (ranks or stages with replicas, a pair or each other: not modeled)
            if ep and tp * dp == 1:
                continue  # (experts over one GPU: no expert parallelism)
            if pol == "disaggregated":  # (never replicated: not modeled)
                if r != self.replicas[0] or (pf == 1 and router != self.routers[0]):
                    continue  # (one prefill instance: the router never chooses)
                r = 1
            elif (r == 1 and router != self.routers[0]) or (pf, dc) != self.pd_ratios[0]:
                continue  # (one replica: the router never chooses; no ratio but a pair's)
            out.append(Candidate(g, tp, r, router, seqs, tokens, pol, pc, dp, pp, ep,
                                 *((pf, dc) if pol == "disaggregated" else (1, 1))))
        return out


# --- the workload and its load -------------------------------------------------------------------
@dataclass
class Slice:
    """A workload slice the search replays: the scenario overrides that make it, and how a
    load (requests per second offered over the whole workload) maps onto it."""

    overrides: list[str]
    trace: bool
    native_rate: float  # requests/s the slice offers at time_scale 1 (a trace) / rate 1
    requests: int
    tokens_per_request: float  # output tokens, the mean over the whole workload
    shares_prefixes: bool = True  # whether requests share prompt prefixes (hash ids, a system prompt)
    peak: float = 1.0  # the slice's rate over the whole workload's at the same load
    closed: bool = False  # a closed loop: the load is its users (workload.concurrency)

    def at(self, sc: Scenario, load: float) -> Scenario:
        """A copy of a checked scenario of this slice standing for the workload at `load`."""
        sc = copy.deepcopy(sc)
        if self.closed:
            sc.workload.concurrency = int(load)
        elif self.trace:
            sc.workload.time_scale = self.native_rate / (load * self.peak)
        else:
            sc.workload.rate = load * self.peak
        return sc


def slices(sc: Scenario, probe_requests: int | None) -> tuple[Slice, Slice]:
    """(the whole workload, the probe slice: its first `probe_requests` requests, or the
    whole when None or larger). A trace's probe slice is replayed at the rate of the trace's
    busiest `probe_requests` consecutive requests, so that a probe at a load sees what the
    whole trace's peak sees at that load (a trace's rate moves over its hour; its p99 comes
    from the peaks). Raises PlanError, ScenarioError or TraceError."""
    w = sc.workload
    trace = w.arrival == "trace"
    if w.concurrency:
        return _closed_slices(sc, probe_requests)
    if w.arrival == "batch":
        raise PlanError(f"{sc.source}: workload.arrival = \"batch\": a plan needs arrivals over "
                        "time (a trace, or poisson, gamma or constant at a rate)")
    base = copy.deepcopy(sc)
    if trace:
        base.workload.time_scale = 1.0
    else:
        base.workload.rate = 1.0
    wl = build_workload(base)
    a = wl.arrival
    n = len(a)
    if n < 2 or a[-1] <= a[0]:
        raise PlanError(f"{sc.source}: [workload]: a plan needs at least 2 requests arriving "
                        f"over time (this workload makes {n}"
                        + (", all at once)" if n >= 2 else ")"))
    shares = _shares_prefixes(wl)
    rate = (n - 1) / float(a[-1] - a[0])
    per_request = wl.total_output_tokens / n
    full = Slice([], trace, rate, n, per_request, shares)
    if probe_requests is None or probe_requests >= n:
        return full, full
    k = max(probe_requests, 2)
    own = (k - 1) / float(a[k - 1] - a[0]) if a[k - 1] > a[0] else rate
    busiest = (k - 1) / float(max((a[k - 1:] - a[:n - k + 1]).min(), 1e-9)) if trace else rate
    probe = Slice([f"workload.num_requests={k}", "workload.duration_s=0"], trace, own, k,
                  per_request, shares, busiest / rate)
    return full, probe


def _shares_prefixes(wl) -> bool:
    """Whether any requests of a built workload share prompt prefixes (hash ids, a system
    prompt)."""
    return wl.hash_ids is not None or (wl.prefix_group is not None
                                       and bool((wl.prefix_group >= 0).any()))


def _closed_slices(sc: Scenario, probe_requests: int | None) -> tuple[Slice, Slice]:
    """`slices` of a closed loop: its rows, the first `probe_requests` of them for the probes."""
    wl = build_workload(sc)
    n = len(wl)
    shares = _shares_prefixes(wl)
    full = Slice([], False, 1.0, n, wl.total_output_tokens / n, shares, closed=True)
    if probe_requests is None or probe_requests >= n:
        return full, full
    k = max(probe_requests, 2)
    return full, dataclasses.replace(full, overrides=[f"workload.num_requests={k}"], requests=k)


def offered_load(sc: Scenario, full: Slice) -> float:
    """The load the scenario itself offers (requests/s; a closed loop's: its users)."""
    if full.closed:
        return float(sc.workload.concurrency)
    if full.trace:
        return full.native_rate / sc.workload.time_scale
    return sc.workload.rate


# --- one candidate's search ----------------------------------------------------------------------
@dataclass
class LoadSearch(RateSearch):
    """`RateSearch` that grows from a start known to be close by `growth`, squared after each
    probe that passes (galloping up to doubling), instead of doubling at once."""

    growth: float = 2.0
    integer: bool = False  # whole loads only (a closed loop's users): bisect down to a step of 1

    def next_rate(self) -> float | None:
        r = self._next()
        if r is None or not self.integer:
            return r
        lo, hi = self.passed and self.passed[0], self.failed and self.failed[0]
        if lo and hi:
            return None if hi - lo <= 1 else float((lo + hi) // 2)
        if lo:  # growing: at least one more
            return float(max(math.ceil(r), lo + 1))
        if hi:  # shrinking: at least one fewer, and never none
            return None if hi <= 1 else float(max(1, min(math.floor(r), hi - 1)))
        return float(max(1, round(r)))

    def _next(self) -> float | None:
        if self.passed and not self.failed and self.growth < 2.0:
            if self.passed[0] >= self.start * 2 ** self.max_doublings:
                return None
            return self.passed[0] * self.growth
        return super().next_rate()

    def record(self, rate: float, attainment: float) -> None:
        super().record(rate, attainment)
        if attainment >= self.target and not self.failed:
            self.growth = min(self.growth ** 2, 2.0)


@dataclass
class Result:
    """Where a candidate's search ended.

    `status`: `ok` (its highest load meeting every bound reaches the required load), `infeasible`
    (it fails the bounds at the required load), `pruned` (its best possible cost cannot beat a
    deployment already found), `no-fit` (the model does not fit its GPUs), `over-budget`."""

    candidate: Candidate
    status: str
    usd_per_hour: float
    max_load: float | None = None       # highest load meeting every bound
    row: dict | None = None             # the run at that load
    fail_load: float | None = None      # lowest load found failing
    fail_row: dict | None = None        # the run at that load
    probes: int = 0
    note: str = ""                      # why it is not ok, in words
    confirmed: bool = False             # figures from the whole workload, not the probe slice

    tokens_per_request: float = 0.0     # the workload's mean output tokens
    cap: float | None = None            # pruned: the load it cannot reach
    closed: bool = False                # a closed loop: the load is users, not requests/s

    @property
    def usd_per_m_tokens(self) -> float | None:
        """Dollars per million output tokens at its highest load."""
        if self.closed:
            tps = self.output_tokens_per_s
            return self.usd_per_hour / (tps * 3600) * 1e6 if tps else None
        return usd_per_m_tokens(self.usd_per_hour, self.max_load, self.tokens_per_request)

    @property
    def output_tokens_per_s(self) -> float | None:
        """Output tokens per second served at its highest load (what the cost divides by): an
        open loop serves its whole offered load; a closed loop what its users drew, measured."""
        if self.closed:
            return (self.row or {}).get("throughput_output_tokens_per_s") or None
        return self.max_load * self.tokens_per_request if self.max_load else None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["candidate"] = dataclasses.asdict(self.candidate)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Result":
        return cls(**{**d, "candidate": Candidate(**d["candidate"])})


class Track:
    """A candidate being searched: its LoadSearch and the runs at its bracket's ends."""

    def __init__(self, cand: Candidate, search: LoadSearch, usd_per_hour: float,
                 tokens_per_request: float) -> None:
        self.cand, self.search, self.usd_per_hour = cand, search, usd_per_hour
        self.tokens_per_request = tokens_per_request  # (0 in a closed loop: measured instead)
        self.pass_row: dict | None = None
        self.fail_row: dict | None = None
        self.cap: float | None = None  # a load it cannot meet, from a sibling with more GPUs
        # the probe whose result chose its next load: (candidate, load; None: its last)
        self.parent: tuple[Candidate, float | None] | None = None

    def record(self, load: float, row: dict, bounds: list[Bound]) -> None:
        self.parent = (self.cand, load)
        ok = meets(row, bounds)
        before = (self.search.passed, self.search.failed)
        self.search.record(load, 1.0 if ok else 0.0)
        if self.search.passed is not before[0] and ok:
            self.pass_row = row
        if self.search.failed is not before[1] and not ok:
            self.fail_row = row

    def step(self, load: float, bounds: list[Bound],
             then: Callable[["Track"], list[Step]]) -> Step:
        """Its probe at `load` as a Step: `then(the track with that row recorded)` is what
        follows (the track is copied now: the search goes on changing it)."""
        snap = copy.deepcopy(self)

        def after(row: dict) -> list[Step]:
            t = copy.deepcopy(snap)
            t.record(load, row, bounds)
            return then(t)
        return Step(self.cand, load, self.parent, after)

    def upper_load(self) -> float | None:
        loads = [x for x in (self.search.failed and self.search.failed[0], self.cap) if x]
        return min(loads) if loads else None

    def result(self, status: str, note: str = "") -> Result:
        s = self.search
        return Result(self.cand, status, self.usd_per_hour, s.passed and s.passed[0],
                      self.pass_row, s.failed and s.failed[0], self.fail_row, s.probes, note,
                      tokens_per_request=self.tokens_per_request, closed=s.integer)


# Runs probes (candidate, load) and returns their rows in order; reports (done, of) as it goes;
# keywords `steps` (the probes as Steps: what each leads to) and `spare` (Steps likely asked for
# later) let it run ahead (Probes).
Evaluate = Callable[..., list[dict]]
Progress = Callable[[int, int], None]


@dataclass
class SearchSettings:
    bounds: list[Bound]
    required: float                   # the load every feasible deployment must meet
    prices: dict[str, Price]
    tolerance: float = 0.03
    prune: bool = True
    budget: float | None = None       # most US dollars per hour
    max_doublings: int = 8
    first_router: str = "round-robin"  # the router a single replica carries in the space
    confirmed_cost: float | None = None  # the cheapest cost confirmed on the whole workload:
    # when given, the only cost a candidate must beat not to be pruned
    closed: bool = False  # a closed loop: whole loads (users), costs from measured throughput
    fixed: bool = False   # the load is given (--concurrency): probe it, search no higher

    def new_search(self, start: float, growth: float = 2.0) -> LoadSearch:
        """The search of one candidate's highest load, from `start`."""
        return LoadSearch(start, 1.0, self.tolerance, 0 if self.fixed else self.max_doublings,
                          growth=growth, integer=self.closed)


def usd_per_hour(c: Candidate, prices: dict[str, Price]) -> float:
    return c.gpus * prices[c.gpu].usd_per_gpu_hour


def usd_per_m_tokens(usd_per_hour: float, load: float | None,
                     tokens_per_request: float) -> float | None:
    """Dollars per million output tokens of a deployment serving `load` requests per second
    (all of them: at a load that meets the bounds every request is served)."""
    if not load or not tokens_per_request:
        return None
    return usd_per_hour / (load * tokens_per_request * 3600) * 1e6


def search(cands: list[Candidate], evaluate: Evaluate, slice_: Slice, s: SearchSettings, *,
           done: dict[str, Result] | None = None, on_result: Callable[[Result], None] | None = None,
           progress: Progress | None = None) -> dict[str, Result]:
    """Every candidate's highest load meeting the bounds (or why it has none), by key.

    `evaluate([(candidate, load), ...])` runs the probes and returns their rows in order;
    `done` holds results found earlier (a resumed plan), `on_result` sees each new one."""
    results: dict[str, Result] = dict(done or {})
    waiting = [c for c in cands if c.key not in results]
    keys = {c.key for c in cands}
    per_request = slice_.tokens_per_request
    tracks: dict[str, Track] = {}
    probes_done = 0

    def finish(r: Result) -> None:
        results[r.candidate.key] = r
        tracks.pop(r.candidate.key, None)
        if on_result:
            on_result(r)

    def dependents(r: Result) -> list[Track]:
        """The replicated candidates waiting for single replica `r`, their searches started."""
        return [_track(c, r, s, per_request) for c in waiting
                if _base(c, s.first_router) == r.candidate
                and (s.budget is None or usd_per_hour(c, s.prices) <= s.budget)]

    def incumbent() -> float | None:
        if s.confirmed_cost is not None:
            return s.confirmed_cost
        costs = [r.usd_per_m_tokens for r in results.values() if r.status == "ok"]
        costs += [t.result("ok").usd_per_m_tokens for t in tracks.values()
                  if t.search.passed and t.search.passed[0] >= s.required]
        costs = [c for c in costs if c is not None]
        return min(costs) if costs else None

    while waiting or tracks:
        for c in list(waiting):
            price = usd_per_hour(c, s.prices)
            if s.budget is not None and price > s.budget:
                waiting.remove(c)
                finish(Result(c, "over-budget", price, note=f"${price:,.2f}/h > budget "
                                                            f"${s.budget:,.2f}/h"))
                continue
            r1 = None
            if s.prune:
                base = _base(c, s.first_router)
                if base is not None and base.key in keys:
                    if base.key not in results:
                        continue  # wait for the single replica's answer
                    r1 = results[base.key]
            waiting.remove(c)
            tracks[c.key] = _track(c, r1, s, per_request)
        if s.prune:
            _apply_caps(tracks, results)
        best = incumbent() if s.prune else None
        proposals = []
        for key, t in list(tracks.items()):
            nxt = _next_load(t, s)
            if _fails_required(t, s):
                b, v = worst_bound(t.fail_row or {}, s.bounds)
                finish(t.result("infeasible", f"fails {b.name} at the required load: "
                                              f"{_ms(v, t.fail_row)} > {b.limit_ms:g} ms"))
                continue
            if nxt is None:
                finish(t.result("ok"))
                continue
            up = t.upper_load()
            # (a closed loop's throughput at a load is measured, not bounded by it: no floor)
            if best is not None and up is not None and not s.closed:
                floor = usd_per_m_tokens(t.usd_per_hour, up, per_request)
                if floor > best:
                    r = t.result("pruned", f"at most {up:.4g} req/s: no less than "
                                           f"${floor:.3f}/M tokens > ${best:.3f} found")
                    r.cap = up
                    finish(r)
                    continue
            proposals.append((t, nxt))
        if not proposals:  # (every track ended: start those that waited for them, or stop)
            continue
        total_guess = probes_done + len(proposals) + sum(
            t.search.probes_left() for t, _ in proposals) + 4 * len(waiting)
        report = (lambda d, n: progress(probes_done + d, max(total_guess, probes_done + n))) \
            if progress else None
        rows = evaluate([(t.cand, load) for t, load in proposals], report,
                        steps=[t.step(load, s.bounds, lambda t: _forecast(t, s, dependents))
                               for t, load in proposals])
        probes_done += len(proposals)
        for (t, load), row in zip(proposals, rows):
            t.record(load, row, s.bounds)
    return results


def _track(c: Candidate, r1: Result | None, s: SearchSettings, per_request: float) -> Track:
    """A candidate's search: from the required load, or from `replicas x` the highest load of
    its single replica (`r1`, when known and higher), growing in small steps from there."""
    start, growth = s.required, 2.0
    if r1 is not None and r1.max_load is not None and r1.max_load * c.replicas > start:
        start, growth = r1.max_load * c.replicas, 1 + 2 * s.tolerance
    t = Track(c, s.new_search(start, growth), usd_per_hour(c, s.prices), per_request)
    t.parent = (r1.candidate, None) if r1 is not None else None
    return t


def _fails_required(t: Track, s: SearchSettings) -> bool:
    return bool(t.search.failed) and t.search.failed[0] <= s.required * (1 + 1e-9)


def _next_load(t: Track, s: SearchSettings) -> float | None:
    """The load a track probes next; None when its search has ended (a failure at the required
    load, or a bracket within the tolerance)."""
    if _fails_required(t, s):
        return None
    return _at_least(t.search.next_rate(), t.search, s.required)


def _forecast(t: Track, s: SearchSettings,
              after: Callable[[Result], list[Track]] | None) -> list[Step]:
    """What a track (its last probe recorded) runs next were it never pruned: its next probe,
    or when its search ends feasible, the first probes of `after(its result)`."""
    def then(t: Track) -> list[Step]:
        return _forecast(t, s, after)
    nxt = _next_load(t, s)
    if nxt is not None:
        return [t.step(nxt, s.bounds, then)]
    if _fails_required(t, s) or after is None:
        return []
    out = []
    for d in after(t.result("ok")):
        load = _next_load(d, s)
        if load is not None:
            d.parent = t.parent  # (its start was chosen from that run)
            out.append(d.step(load, s.bounds, then))
    return out


def _at_least(load: float | None, search: LoadSearch, required: float) -> float | None:
    """A search that has only failed probes the required load next, not below it (below, no
    answer would be feasible)."""
    if load is not None and not search.passed and search.failed and load < required:
        return required
    return load


def _ms(v: float | None, row: dict | None = None) -> str:
    """A figure of a run's row in words (`row`: that run's, which may have stopped early with a
    lower bound of it)."""
    if v is None:
        return "no finished request"
    return f"{'at least ' if (row or {}).get('stopped_s') is not None else ''}{v:,.0f} ms"


def _base(c: Candidate, router: str) -> Candidate | None:
    """The single replica a replicated candidate scales (None: it is one)."""
    if c.replicas == 1 or c.disaggregated:
        return None
    return c.sibling(replicas=1, router=router)


def _apply_caps(tracks: dict[str, Track], results: dict[str, Result]) -> None:
    """Caps from siblings with more GPUs per replica or more replicas: a load they fail at
    (per replica) the smaller one fails at too."""
    failed: dict[str, tuple[Candidate, float]] = {}
    for r in results.values():
        if r.fail_load is not None:
            failed[r.candidate.key] = (r.candidate, r.fail_load)
    for t in tracks.values():
        if t.search.failed:
            failed[t.cand.key] = (t.cand, t.search.failed[0])
    by_rest: dict[tuple, list[tuple[Candidate, float]]] = {}
    for cand, load in failed.values():
        by_rest.setdefault(_rest(cand), []).append((cand, load))
    for t in tracks.values():
        for cand, load in by_rest.get(_rest(t.cand), []):
            if cand.tp >= t.cand.tp and cand.replicas >= t.cand.replicas and cand != t.cand:
                cap = load * t.cand.replicas / cand.replicas
                t.cap = cap if t.cap is None else min(t.cap, cap)


def _rest(c: Candidate) -> tuple:
    """What two siblings share: everything but their tensor-parallel degree and replicas (and
    the router of a single replica, which never chooses). Ranks, stages, experts split and
    prefill:decode ratios are kept apart: a pipeline's stages add latency, so more GPUs there
    may carry less, and more decode instances do nothing for a prefill-bound load."""
    return (c.gpu, c.max_num_seqs, c.max_num_batched_tokens, c.policy, c.prefix_caching, c.dp,
            c.pp, c.expert_parallel, c.prefill, c.decode)


# --- running probes on the simulator ------------------------------------------------------------
@dataclass
class Step:
    """A probe to run (`cand` at `load`), the probe whose result chose it (`parent`: (candidate,
    load), load None for that candidate's last run, None at a phase's start), and `then(row)`:
    the probes its row would lead to if the search went on with that candidate (nothing
    pruned), for running ahead."""

    cand: Candidate
    load: float
    parent: tuple[Candidate, float | None] | None = None
    then: Callable[[dict], list["Step"]] | None = None


@dataclass
class Run:
    """One simulator run a plan started, and what it cost."""

    slice: str                 # "probe" or "whole"
    key: tuple[str, float]     # (same_run key, load)
    ahead: int                 # 0: a probe the search asked for; n: started n probes ahead
    instances: int             # engine instances it simulates (for the size guess)
    used: bool = False         # whether the search used its result
    cpu_s: float = 0.0         # CPU seconds of the worker (load does not stretch it)
    wall_s: float = 0.0
    worker: int = 0            # the process that ran it
    chain_s: float = 0.0       # cpu_s plus its parent's chain: the critical path to its end


class Scheduler:
    """Keeps a Runner's workers busy for the search while every decision stays the search's.

    The search decides in rounds (each active candidate's next probe), on whole rounds, so its
    answer does not depend on the number of workers or on which run ends first. What would
    leave workers idle, a round's last probes, is filled by running ahead: as a probe ends,
    the probe its candidate's search would run next (and, when its search ends there, the first
    probes of the replicated candidates waiting for it) is started on any worker left free,
    up to `depth` probes ahead, and its row kept for the round that asks for it. Probes the
    search waits for start first, the largest (most engine instances, then the most CPU
    time a run of that candidate took) first. A run started ahead for a candidate the search
    then prunes is wasted; `runs` records each run, its CPU time and its worker."""

    def __init__(self, runner: Runner, depth: int = 3) -> None:
        self.runner = runner
        self.slots = runner.slots
        self.depth = depth if self.slots > 1 else 0  # (one worker is never idle)
        self.runs: dict[tuple, Run] = {}
        self._flight: dict[Any, tuple["Probes", Run, Step]] = {}
        self._cpu: dict[tuple[str, str], float] = {}  # (slice, candidate) -> CPU s of its last run
        self._base = 0.0  # the critical path up to the current phase's start
        self._t0 = time.perf_counter()
        self._n = 0

    def barrier(self) -> None:
        """A new phase starts: its first probes were chosen from everything before them."""
        self._base = max((r.chain_s for r in self.runs.values() if r.used), default=0.0)

    def evaluate(self, probes: "Probes", steps: list[Step], progress: Progress | None,
                 extra: list[Step] = ()) -> None:
        """Run `steps` of `probes`' slice until each has its row (in `probes.rows`), and while
        workers would idle, what they lead to and `extra`, one probe ahead."""
        need: dict[tuple, Step] = {}
        for st in steps:
            need.setdefault(probes.run_key(st.cand, st.load), st)
        spare: list[tuple] = []  # heap of (ahead, -size, n, probes, step)
        for st in extra if self.depth else ():
            self._queue(spare, 1, probes, st)
        todo = []
        for k, st in need.items():
            run = self.runs.get((probes.name, k))
            if run is None:
                todo.append(st)
            else:
                run.used, run.ahead = True, 0
                if k in probes.rows:
                    self._ahead(probes, run, st, spare)
        todo.sort(key=lambda st: -self._size(probes, st.cand))
        done = sum(1 for k in need if k in probes.rows)
        while done < len(need):
            while len(self._flight) < self.slots and (todo or spare):
                if todo:
                    self._start(probes, todo.pop(0), 0)
                    continue
                ahead, _, _, pr, st = heapq.heappop(spare)
                run = self.runs.get((pr.name, pr.run_key(st.cand, st.load)))
                if run is None:
                    self._start(pr, st, ahead)
                elif run.key in pr.rows:  # (already run: what it leads to may not be)
                    self._ahead(pr, run, st, spare)
            for h in self.runner.wait(list(self._flight)):
                pr, run, st = self._flight.pop(h)
                ok, value = self.runner.outcome(h)
                if ok:
                    run.wall_s, run.cpu_s, run.worker = (value.pop(k, 0) for k in
                                                         ("wall_s", *RUN_ONLY))
                    self._cpu[(pr.name, st.cand.key)] = run.cpu_s
                    run.chain_s = run.cpu_s + self._chain(pr, st.parent)
                pr.rows[run.key] = (ok, value)
                if pr is probes and run.key in need:
                    done += 1
                    if progress:
                        progress(done, len(need))
                if ok:
                    self._ahead(pr, run, st, spare)

    def _chain(self, probes: "Probes", parent: tuple | None) -> float:
        """The critical path to the end of a run's parent (a candidate's last: its longest)."""
        if parent is None:
            return self._base
        c, load = parent
        if load is not None:
            run = self.runs.get((probes.name, probes.run_key(c, load)))
            return run.chain_s if run else self._base
        same = same_run(c, probes.slice.shares_prefixes)
        return max((r.chain_s for (name, (k, _)), r in self.runs.items()
                    if name == probes.name and k == same and r.used), default=self._base)

    def _start(self, probes: "Probes", st: Step, ahead: int) -> None:
        key = probes.run_key(st.cand, st.load)
        run = Run(probes.name, key, ahead, st.cand.gpus // st.cand.tp, used=ahead == 0)
        self.runs[(probes.name, key)] = run
        self._flight[self.runner.submit(probes.at(st.cand, st.load), probes.stop)] = (
            probes, run, st)

    def _ahead(self, probes: "Probes", run: Run, st: Step, spare: list) -> None:
        """Queue what a run's row leads to, within `depth` probes ahead."""
        if st.then is None or run.ahead >= self.depth or not probes.rows[run.key][0]:
            return
        for nxt in st.then(probes.rows[run.key][1]):
            self._queue(spare, run.ahead + 1, probes, nxt)

    def _queue(self, spare: list, ahead: int, probes: "Probes", st: Step) -> None:
        self._n += 1  # (ties: first queued first)
        heapq.heappush(spare, (ahead, -self._size(probes, st.cand), self._n, probes, st))

    def _size(self, probes: "Probes", c: Candidate) -> float:
        """How long a run of `c` is guessed to take: its last run's CPU time, else its engine
        instances times the mean CPU time per instance of this slice's runs so far."""
        last = self._cpu.get((probes.name, c.key))
        if last is not None:
            return last
        runs = [r for r in self.runs.values() if r.slice == probes.name and r.cpu_s]
        per = sum(r.cpu_s for r in runs) / sum(r.instances for r in runs) if runs else 1.0
        return per * (c.gpus // c.tp)

    def figures(self) -> dict:
        """What the runs cost: the runs used and run ahead in vain, CPU time, each worker's busy
        time over `wall_s` (its utilisation), and the critical path (the longest chain of runs
        each chosen from the one before, phases one after another: no number of workers ends
        the plan sooner)."""
        wall_s = time.perf_counter() - self._t0
        runs = list(self.runs.values())
        busy: dict[int, float] = {}
        for r in runs:
            if r.worker:  # (a run still going as the plan ends has no figures yet)
                busy[r.worker] = busy.get(r.worker, 0.0) + r.wall_s
        return {"runs": sum(r.used for r in runs), "runs_ahead_unused": sum(not r.used for r in runs),
                "cpu_s": sum(r.cpu_s for r in runs),
                "cpu_s_unused": sum(r.cpu_s for r in runs if not r.used),
                "critical_path_s": max((r.chain_s for r in runs if r.used), default=0.0),
                "workers": self.slots, "wall_s": wall_s,
                "utilisation": [b / wall_s for b in sorted(busy.values(), reverse=True)]}


class Probes:
    """Runs (candidate, load) probes of one slice: each candidate's scenario is loaded and
    checked once, each probe a copy at its load, on the plan's Scheduler."""

    def __init__(self, raw: dict, source: str, base_dir: Path, slice_: Slice,
                 scheduler: Scheduler, name: str, stop: tuple[tuple[str, float], ...] = ()
                 ) -> None:
        self.raw, self.source, self.base_dir = raw, source, base_dir
        self.slice, self.scheduler, self.name = slice_, scheduler, name
        self.stop = stop  # (column, limit ms): a run ends once one is proven broken
        self._scenarios: dict[str, Scenario] = {}
        self.rows: dict[tuple[str, float], tuple[bool, Any]] = {}  # (same run, load) -> row
        self._used: set[tuple[str, float]] = set()

    @property
    def runs(self) -> int:
        """Runs whose rows the search used (those run ahead in vain aside)."""
        return len(self._used)

    def run_key(self, c: Candidate, load: float) -> tuple[str, float]:
        return same_run(c, self.slice.shares_prefixes), load

    def scenario(self, c: Candidate) -> Scenario:
        if c.key not in self._scenarios:
            self._scenarios[c.key] = load_variant(self.raw, self.source, self.base_dir,
                                                  c.overrides() + self.slice.overrides)
        return self._scenarios[c.key]

    def at(self, c: Candidate, load: float) -> Scenario:
        return self.slice.at(self.scenario(c), load)

    def __call__(self, probes: list[tuple[Candidate, float]], progress=None,
                 steps: list[Step] | None = None, spare: list[Step] = ()) -> list[dict]:
        """Rows of `probes` in order (`steps`: the same probes with what they lead to; `spare`:
        probes likely asked for later). Raises SweepError naming the first probe whose run
        failed."""
        steps = steps or [Step(c, load) for c, load in probes]
        self.scheduler.evaluate(self, steps, progress, spare)
        out = []
        for c, load in probes:
            k = self.run_key(c, load)
            self._used.add(k)
            ok, value = self.rows[k]
            if not ok:
                raise SweepError(f"{c.label()} at {load:.4g} "
                                 f"{'users' if self.slice.closed else 'req/s'}: {value}")
            out.append(value)
        return out


def same_run(c: Candidate, shares_prefixes: bool) -> str:
    """Candidates whose runs are identical share this key: with no prompt prefix shared
    between requests, prefix caching changes nothing."""
    return c.key if shares_prefixes else c.sibling(prefix_caching=False).key


def read_raw(spec: str | None) -> tuple[dict, str, Path]:
    """A scenario file's raw table, its path (for messages) and its folder."""
    path = find_scenario(spec)
    try:
        raw = toml_loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError) as e:
        raise ScenarioError(f"{path}: cannot read: {reason(e)}") from None
    except ValueError as e:
        raise ScenarioError(f"{path}: not valid TOML: {e}") from None
    return raw, str(path), path.resolve().parent


def load_variant(raw: dict, source: str, base_dir: Path, overrides: list[str]) -> Scenario:
    """The scenario with `overrides` applied, checked. Raises ScenarioError."""
    raw = copy.deepcopy(raw)
    for o in overrides:
        apply_override(raw, o, source)
    return scenario_from_dict(raw, source=source, base_dir=base_dir)


def variant_or_why(raw: dict, source: str, base_dir: Path,
                   c: Candidate) -> tuple[Scenario | None, str]:
    """(the candidate's scenario, '') when it loads (the model fits its GPUs, the shapes
    divide), else (None, the reason in a few words)."""
    try:
        return load_variant(raw, source, base_dir, c.overrides()), ""
    except ScenarioError as e:
        return None, cut(str(e).removeprefix(f"{source}: "), 120)


# --- resuming -------------------------------------------------------------------------------------
class Journal:
    """The plan's output file: a header line naming the plan (everything that decides a
    candidate's result but the space), then a JSON line per finished candidate. A plan run
    again with the same file reads the results back; a torn last line is ignored."""

    VERSION = 1

    def __init__(self, path: str | None, identity: dict) -> None:
        self.path = path
        self.identity = identity
        self.fingerprint = hashlib.sha256(
            json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self._fh = None
        self._whole: int | None = None  # bytes of whole lines, when the last one is torn

    def read(self) -> tuple[dict[str, Result], dict[str, Result]]:
        """(search results, confirmed results) already in the file, by candidate key."""
        found: dict[str, Result] = {}
        confirmed: dict[str, Result] = {}
        if not self.path or not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            return found, confirmed
        try:
            text = read_input_text(self.path)
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"{self.path}: cannot read: {reason(e)} (not a servesim plan file: "
                            "give another -o)") from None
        lines = text.split("\n")
        complete = text.endswith("\n")
        if not complete:  # the next line written replaces the torn one
            self._whole = len(text[:text.rfind("\n") + 1].encode("utf-8"))
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                d = json_loads(line)
            except ValueError:
                if i == len(lines) - 1 and not complete and (i or self.header().startswith(line)):
                    break  # the line being written when the plan stopped
                if i == 0:  # (never truncate a file that is not this plan's)
                    raise PlanError(f"{self.path}: not a servesim plan file (give another -o)"
                                    ) from None
                raise PlanError(f"{self.path}: line {i + 1}: not a plan record") from None
            if i == 0:
                if not isinstance(d, dict) or d.get("servesim_plan") != self.VERSION:
                    raise PlanError(f"{self.path}: not a servesim plan file (give another -o)")
                if d.get("fingerprint") != self.fingerprint:
                    raise PlanError(f"{self.path}: holds another plan (another scenario, "
                                    "bounds, slice, tolerance or prices): give another -o, or "
                                    "remove it to start again")
                continue
            try:
                r = Result.from_json(d["result"])
            except (KeyError, TypeError):
                raise PlanError(f"{self.path}: line {i + 1}: not a plan record") from None
            (confirmed if d.get("kind") == "confirmed" else found)[r.candidate.key] = r
        return found, confirmed

    def write(self, r: Result, kind: str = "searched") -> None:
        if not self.path:
            return
        if self._fh is None:
            if self._whole is not None:
                os.truncate(self.path, self._whole)
            new = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
            self._fh = open(self.path, "a", encoding="utf-8")
            if new:
                self._write(self.header())
        self._write(json.dumps({"kind": kind, "result": r.to_json()}, default=str))

    def header(self) -> str:
        """The file's first line, naming the plan."""
        return json.dumps({"servesim_plan": self.VERSION, "fingerprint": self.fingerprint,
                           "plan": self.identity}, default=str)

    def _write(self, line: str) -> None:
        self._fh.write(line + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


# --- the whole plan ------------------------------------------------------------------------------
@dataclass
class Plan:
    """A planning run's inputs."""

    spec: str | None
    bounds: list[Bound]
    space: Space
    prices: dict[str, Price]
    overrides: list[str] = field(default_factory=list)
    rate: float | None = None          # the required load; None: the workload's own
    concurrency: int | None = None     # the users to serve (a closed loop at this many)
    price_overrides: dict[str, Price] = field(default_factory=dict)  # --price: over all others
    budget: float | None = None
    tolerance: float = 0.03
    probe_requests: int | None = 1000  # None: probe on the whole workload
    finalists: int = 3
    prune: bool = True
    stop_early: bool = True  # end a run once a bound is proven broken (the answer is the same)


@dataclass
class Outcome:
    """A plan's answer: every candidate's result, best first, and what it was planned for."""

    results: list[Result]
    required: float
    bounds: list[Bound]
    scenario: Scenario
    raw: dict
    candidates: int
    probes: int
    resumed: int
    shares_prefixes: bool = True
    closed: bool = False               # a closed loop: loads are users
    skipped: int = 0                   # candidates a closed loop cannot run (several instances)
    prices: dict[str, Price] = field(default_factory=dict)  # the prices ranked by
    work: dict = field(default_factory=dict)  # what the runs cost (Scheduler.figures)

    @property
    def unit(self) -> str:
        """What a load counts."""
        return "users" if self.closed else "req/s"

    @property
    def feasible(self) -> list[Result]:
        """The feasible candidates, best first, one of each set whose runs are identical."""
        seen, out = set(), []
        for r in self.results:
            k = same_run(r.candidate, self.shares_prefixes)
            if r.status == "ok" and k not in seen:
                seen.add(k)
                out.append(r)
        return out

    @property
    def winner(self) -> Result | None:
        return self.feasible[0] if self.feasible else None

    def pareto(self) -> list[Result]:
        """The feasible deployments no other beats on both cost per hour and load."""
        front, best_load = [], -1.0
        for r in sorted(self.feasible, key=lambda r: (r.usd_per_hour, -(r.max_load or 0))):
            if (r.max_load or 0) > best_load:
                front.append(r)
                best_load = r.max_load or 0
        return front


def check_space(p: Plan, raw: dict, source: str, base_dir: Path) -> tuple[list[Candidate],
                                                                        list[Result]]:
    """The candidates to search, and those that cannot run (no-fit), with one line for the
    first problem with the space itself. Raises PlanError."""
    missing = [g for g in p.space.gpus if g not in p.prices]
    if missing:
        raise PlanError(f"--gpus {missing[0]}: no price for this GPU in the price table "
                        f"(give one with --price {missing[0]}=USD_PER_GPU_HOUR, or in the "
                        "scenario's plan.gpu_price_usd_per_hour)")
    cands = p.space.candidates()
    if not cands:
        raise PlanError("the search space is empty (check --gpus, --tp, --replicas, "
                        "--policies)")
    ok, bad = [], []
    fit_cache: dict[tuple, tuple[Scenario | None, str]] = {}
    moe = None  # whether the model is a mixture of experts, from the first variant that loads
    # (expert parallelism on last: searched only for a mixture of experts; for a dense model
    # it is a repeat, left out)
    for c in sorted(cands, key=lambda c: c.expert_parallel):
        if c.expert_parallel and moe is False:
            continue
        k = (c.gpu, c.tp, c.policy, c.max_num_seqs, c.max_num_batched_tokens, c.dp, c.pp,
             c.expert_parallel)
        if k not in fit_cache:
            fit_cache[k] = variant_or_why(raw, source, base_dir, c)
        sc, why = fit_cache[k]
        if sc is not None and moe is None:
            moe = sc.model.num_experts > 0
        if why:
            bad.append(Result(c, "no-fit", usd_per_hour(c, p.prices), note=why))
        else:
            ok.append(c)
    order = {c.key: i for i, c in enumerate(cands)}
    return (sorted(ok, key=lambda c: order[c.key]),
            sorted(bad, key=lambda r: order[r.candidate.key]))


def plan_prices(p: Plan, sc: Scenario) -> dict[str, Price]:
    """The prices a plan ranks by: the table, then the scenario's `plan.gpu_price_usd_per_hour`,
    then `--price`, each over the one before."""
    own = {gpu: Price(usd, f"{sc.source}: plan.gpu_price_usd_per_hour", "")
           for gpu, usd in sc.plan.gpu_price_usd_per_hour.items()}
    return {**p.prices, **own, **p.price_overrides}


def run_plan(p: Plan, runner: Runner, *, journal_path: str | None = None,
             progress: Progress | None = None) -> Outcome:
    """Search the space, confirm the finalists on the whole workload, rank."""
    raw, source, base_dir = read_raw(p.spec)
    for o in p.overrides:
        apply_override(raw, o, source)
    if p.concurrency is not None:
        if p.rate is not None:
            raise PlanError("--rate and --concurrency: give one load (requests/s, or users)")
        apply_override(raw, f"workload.concurrency={p.concurrency}", source)
    # The workload alone (the scenario as given may not fit its model on its GPUs).
    wl = scenario_from_dict({k: v for k, v in copy.deepcopy(raw).items()
                             if k in ("name", "seed", "workload", "plan")},
                            source=source, base_dir=base_dir)
    closed = bool(wl.workload.concurrency)
    if closed and p.rate is not None:
        raise PlanError(f"--rate {p.rate:g}: the workload is a closed loop (workload.concurrency"
                        f" = {wl.workload.concurrency}): give --concurrency N users instead")
    p = dataclasses.replace(p, prices=plan_prices(p, wl))
    cands, no_fit = check_space(p, raw, source, base_dir)
    # A closed loop runs on one engine only (the simulator refuses it with replicas or a pair,
    # and its ranks and stages do not run the users): the others are left out, and counted.
    skipped = sum(1 for c in [*cands, *(r.candidate for r in no_fit)] if closed and not c.single)
    cands = [c for c in cands if c.single or not closed]
    no_fit = [r for r in no_fit if r.candidate.single or not closed]
    sc = load_variant(raw, source, base_dir, cands[0].overrides()) if cands else wl
    full, probe = slices(wl, p.probe_requests if p.prune else None)  # (exhaustive: whole)
    required = p.rate if p.rate is not None else offered_load(wl, full)
    identity = {"scenario": raw, "source": source, "bounds": [b.text() for b in p.bounds],
                "required": required, "tolerance": p.tolerance, "probe": probe.requests,
                "prices": {g: dataclasses.asdict(v) for g, v in sorted(p.prices.items())},
                "budget": p.budget, "prune": p.prune, "fixed": p.concurrency is not None}
    journal = Journal(journal_path, identity)
    found, confirmed = journal.read()
    wanted = {c.key for c in cands}
    resumed = sum(1 for k in found if k in wanted)
    settings = SearchSettings(p.bounds, required, p.prices, p.tolerance, p.prune, p.budget,
                              first_router=p.space.routers[0], closed=closed,
                              fixed=p.concurrency is not None)
    scheduler = Scheduler(runner)
    stop = tuple((b.column, b.limit_ms) for b in p.bounds) if p.stop_early else ()
    run_probe = Probes(raw, source, base_dir, probe, scheduler, "probe", stop)
    run_full = Probes(raw, source, base_dir, full, scheduler, "whole", stop)
    try:
        results = search(cands, run_probe, probe, settings,
                         done={k: v for k, v in found.items() if k in wanted},
                         on_result=journal.write, progress=progress)
        while probe is not full:
            report = None
            if progress:
                offset = run_probe.runs + run_full.runs
                report = lambda d, n, o=offset: progress(o + d, o + n)  # noqa: E731
            scheduler.barrier()
            confirm(results, confirmed, p, settings, run_full, journal, report)
            # Pruned against the probe slice's cheapest; the whole workload's may cost more:
            # search again those that could beat it, against the cheapest confirmed or, with
            # none confirmed, against the slice's cheapest of those the whole workload has not
            # failed. Each pass that finds one meeting the bounds confirms at least one more.
            best = min((r.usd_per_m_tokens for k, r in confirmed.items()
                        if k in results and r.status == "ok"), default=None)
            reopen = [k for k, r in results.items() if r.status == "pruned" and (
                best is None or usd_per_m_tokens(r.usd_per_hour, r.cap, r.tokens_per_request)
                < best)]
            if not reopen:
                break
            settings = dataclasses.replace(settings, confirmed_cost=best)
            scheduler.barrier()
            results = search(cands, run_probe, probe, settings,
                             done={k: confirmed.get(k, v) for k, v in results.items()
                                   if k not in reopen},
                             on_result=journal.write, progress=progress)
            if not any(results[k].status == "ok" for k in reopen):
                break  # (pruned again: bounds that break the sibling rule; nothing to confirm)
    finally:
        journal.close()
    merged = {**results, **{k: v for k, v in confirmed.items() if k in results}}
    ranked = rank([*merged.values(), *no_fit])
    return Outcome(ranked, required, p.bounds, sc, raw, len(cands) + len(no_fit),
                   run_probe.runs + run_full.runs, resumed, full.shares_prefixes, closed,
                   skipped, p.prices, scheduler.figures())


def confirm(results: dict[str, Result], confirmed: dict[str, Result], p: Plan,
            s: SearchSettings, run_full: Evaluate, journal: Journal,
            progress: Progress | None = None, width: int = 1) -> None:
    """Search the cheapest candidates again on the whole workload, from the load their probes
    found (growing from there, or bisecting down where it fails), until the cheapest confirmed
    one is cheaper than every candidate not yet confirmed. Up to `width` (at least
    `p.finalists`) are searched at once, their probes run together, and as one ends the next
    cheapest starts; the next cheapest's first probes are offered to run ahead (idle workers
    run them; how many workers there are never changes which are confirmed).
    `progress(runs done, runs guessed)` as it goes."""
    runs = 0
    tracks: dict[str, Track] = {}
    width = max(p.finalists, width, 1)
    while True:
        best = min((r.usd_per_m_tokens for r in confirmed.values()
                    if r.status == "ok" and r.candidate.key in results), default=None)
        todo = sorted((r for k, r in results.items()
                       if r.status == "ok" and k not in confirmed and k not in tracks),
                      key=lambda r: r.usd_per_m_tokens)
        todo = [r for r in todo if best is None or r.usd_per_m_tokens < best]
        for r in todo[:width - len(tracks)]:  # (the others cannot beat what is confirmed)
            tracks[r.candidate.key] = _finalist(r, s)
        if not tracks:
            return
        proposals = []
        for key, t in list(tracks.items()):
            nxt = _next_load(t, s)
            if nxt is None:
                _confirmed(tracks.pop(key), results, confirmed, s, journal)
                continue
            proposals.append((t, nxt))
        if not proposals:
            continue  # (every track ended: start the next cheapest, or stop)
        guess = runs + len(proposals) + sum(t.search.probes_left() for t, _ in proposals)
        report = (lambda d, n, r=runs, g=guess: progress(r + d, max(g, r + n))) \
            if progress else None
        # (ahead: the next finalists' first probes, were these to end now)
        nxt = [(f, _next_load(f, s)) for f in (_finalist(r, s) for r in todo
                                                if r.candidate.key not in tracks)][:width]
        then = lambda t: _forecast(t, s, None)  # noqa: E731
        rows = run_full([(t.cand, load) for t, load in proposals], report,
                        steps=[t.step(load, s.bounds, then) for t, load in proposals],
                        spare=[f.step(load, s.bounds, then) for f, load in nxt
                               if load is not None])
        runs += len(proposals)
        for (t, load), row in zip(proposals, rows):
            t.record(load, row, s.bounds)


def _finalist(r: Result, s: SearchSettings) -> Track:
    """A finalist's search on the whole workload, from the load its probes found."""
    return Track(r.candidate, s.new_search(r.max_load, 1 + 2 * s.tolerance), r.usd_per_hour,
                 r.tokens_per_request)


def _confirmed(t: Track, results: dict[str, Result], confirmed: dict[str, Result],
               s: SearchSettings, journal: Journal) -> None:
    """A finalist's search on the whole workload ended: its result, confirmed."""
    key = t.cand.key
    r = t.result("ok")
    r.probes += results[key].probes
    if not t.search.passed or t.search.passed[0] < s.required * (1 - 1e-9):
        b, v = worst_bound(t.fail_row or {}, s.bounds)
        r.status = "infeasible"
        r.note = (f"on the whole workload fails {b.name} at the required load: "
                  f"{_ms(v, t.fail_row)} > {b.limit_ms:g} ms")
    r.confirmed = True
    confirmed[key] = r
    journal.write(r, "confirmed")


STATUS_ORDER = {"ok": 0, "pruned": 1, "infeasible": 2, "over-budget": 3, "no-fit": 4}


def rank(results: list[Result]) -> list[Result]:
    """Feasible first, cheapest per output token first; confirmed before the probe slice's
    figures at equal cost; the rest by how close they came."""
    def key(r: Result):
        cost = r.usd_per_m_tokens
        return (STATUS_ORDER[r.status], cost if cost is not None and r.status == "ok" else 0,
                not r.confirmed, -(r.max_load or 0), r.usd_per_hour, r.candidate.key)
    return sorted(results, key=key)


def nearest_misses(outcome: Outcome, n: int = 5) -> list[Result]:
    """The infeasible candidates that came closest: the most load meeting the bounds, then the
    least excess over the bound that binds."""
    misses = [r for r in outcome.results if r.status in ("infeasible", "over-budget", "no-fit")]

    def closeness(r: Result):
        b, v = worst_bound(r.fail_row or {}, outcome.bounds)
        excess = math.inf if v is None or r.fail_row is None else v / b.limit_ms
        return (STATUS_ORDER[r.status], -(r.max_load or 0), excess)
    return sorted(misses, key=closeness)[:n]


def binding(outcome: Outcome) -> str:
    """Which constraint keeps every candidate out, in words."""
    counts: dict[str, int] = {}
    for r in outcome.results:
        if r.status == "infeasible":
            b, _ = worst_bound(r.fail_row or {}, outcome.bounds)
            what = f"{b.text()} at {outcome.required:.4g} {outcome.unit}"
            counts[what] = counts.get(what, 0) + 1
        elif r.status == "over-budget":
            counts["the budget"] = counts.get("the budget", 0) + 1
        elif r.status == "no-fit":
            counts["GPU memory (the model does not fit)"] = counts.get(
                "GPU memory (the model does not fit)", 0) + 1
    if not counts:
        return "nothing was searched"
    top = max(counts, key=counts.get)
    return f"{top} ({counts[top]} of {sum(counts.values())} candidates)"


def why_runner_up_lost(outcome: Outcome) -> str:
    """One sentence: what the second-best deployment lacks against the winner."""
    f = outcome.feasible
    if len(f) < 2:
        return "no runner-up: only one deployment meets the bounds" if f else ""
    w, r = f[0], f[1]
    dw, dr = dataclasses.asdict(w.candidate), dataclasses.asdict(r.candidate)
    same = () if outcome.shares_prefixes else ("prefix_caching",)  # (it changes nothing)
    diff = [f"{k} {dr[k]} (winner {dw[k]})" for k in dw if dw[k] != dr[k] and k not in same]
    cost_gap = (r.usd_per_m_tokens / w.usd_per_m_tokens - 1) * 100
    parts = [f"the runner-up ({r.candidate.label()}) costs {cost_gap:.1f}% more per output "
             f"token"]
    if r.usd_per_hour > w.usd_per_hour:
        parts.append(f"rents more (${r.usd_per_hour:,.2f}/h against ${w.usd_per_hour:,.2f}/h)")
    elif r.usd_per_hour < w.usd_per_hour:
        parts.append(f"is cheaper per hour (${r.usd_per_hour:,.2f} against "
                     f"${w.usd_per_hour:,.2f}) but carries less: {r.max_load:.3g} against "
                     f"{w.max_load:.3g} {outcome.unit} within the bounds")
    if r.fail_row is not None:
        b, v = worst_bound(r.fail_row, outcome.bounds)
        parts.append(f"above {r.max_load:.3g} {outcome.unit} it breaks {b.name} "
                     f"({_ms(v, r.fail_row)} at {r.fail_load:.3g} {outcome.unit})")
    if diff:
        parts.append("it differs in " + ", ".join(diff[:4]))
    return "; ".join(parts) + "."


# --- trust: the validation error of each figure's regime ----------------------------------------
FIGURES = {"load": ("output_tps", "request_tps", "total_tps"), "ttft": ("ttft",),
           "tpot": ("tpot", "itl", "user_tps")}


@dataclass
class Regime:
    """Validation rows of one figure on one GPU and tensor-parallel degree."""

    figure: str
    gpu: str
    tp: int
    errors: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.errors)

    @property
    def worst(self) -> float:
        return max(self.errors)


def regimes(points, results: list[dict]) -> dict[tuple[str, str, int], Regime]:
    """(figure, gpu, tp) -> Regime from validation `results` (rows of `validate.run_point`)
    of `points` (validate.Point, whose scenarios say the GPU and TP)."""
    by_id = {r["id"]: r for r in results}
    out: dict[tuple[str, str, int], Regime] = {}
    for pt in points:
        r = by_id.get(pt.id)
        if r is None or r.get("ratio") is None:
            continue
        quantity = pt.metric.quantity
        fig = next((f for f, qs in FIGURES.items() if quantity in qs), None)
        if fig is None:
            continue
        sc = V.point_scenario(pt)
        key = (fig, sc.hardware.preset, sc.model.tensor_parallel)
        out.setdefault(key, Regime(fig, *key[1:], [])).errors.append(abs(r["ratio"] - 1))
    return out


def trust(c: Candidate, table: dict[tuple[str, str, int], Regime]) -> dict[str, Regime | None]:
    """Each figure's regime for a candidate: its GPU at its TP degree; None where no
    validation row was measured there (a disaggregated pair never was)."""
    return {fig: None if c.disaggregated else table.get((fig, c.gpu, c.tp)) for fig in FIGURES}


# The fewest published points of a regime for its interval to carry weight: fewer, and the plan
# says that the winner rests on a regime the model has (barely) not been validated in.
FEW_POINTS = 5


def winner_trust(outcome: Outcome, r: Result, trust: dict) -> dict:
    """The winner's headline figures on the whole workload at its highest load, each with the
    out-of-sample interval of its regime (`trust.attach`: regimes read from the run itself)."""
    sc = outcome.scenario
    variant = load_variant(outcome.raw, str(sc.source), sc.base_dir, r.candidate.overrides())
    engine = build(slices(sc, None)[0].at(variant, r.max_load), record_events=False,
                   keep_history=False)
    engine.run()
    return T.attach(summarize(engine), trust)


# --- the winner as something to run --------------------------------------------------------------
def winner_toml(outcome: Outcome, r: Result) -> str:
    """The winning deployment as a scenario file `servesim sim` runs: the planned scenario
    with the candidate's settings and its highest load, paths made absolute."""
    raw = copy.deepcopy(outcome.raw)
    source = str(outcome.scenario.source)
    for o in r.candidate.overrides():
        apply_override(raw, o, source)
    w = raw.setdefault("workload", {})
    sc = outcome.scenario
    if outcome.closed:
        w["concurrency"] = int(r.max_load)
    elif sc.workload.arrival == "trace":
        w["time_scale"] = slices(sc, None)[0].native_rate / r.max_load
        w["trace"] = str(sc.resolve_path(sc.workload.trace))
    else:
        w["rate"] = r.max_load
    for k, v in list(w.items()):
        if isinstance(v, dict) and isinstance(v.get("file"), str):
            v["file"] = str(sc.resolve_path(v["file"]))
    if isinstance(raw.get("engine"), dict) and str(raw["engine"].get("preset", "")).endswith(
            ".toml"):
        raw["engine"]["preset"] = str(sc.resolve_path(raw["engine"]["preset"]))
    raw["name"] = f"{raw.get('name', 'scenario')}-plan"
    raw["description"] = (f"servesim plan's winner: {r.candidate.label()} at "
                          f"{r.max_load:.4g} {outcome.unit}")
    head = [f"# servesim plan's winner for {source}",
            f"# bounds: {', '.join(b.text() for b in outcome.bounds)}",
            f"# ${r.usd_per_hour:,.2f}/h, ${r.usd_per_m_tokens:.3f} per million output tokens"]
    return "\n".join(head) + "\n" + toml_text(raw)


def toml_text(raw: dict) -> str:
    """A scenario table as TOML: top-level keys, then a [section] per table."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for k, v in raw.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if hasattr(v, "isoformat"):
        return v.isoformat()
    raise PlanError(f"cannot write {shown(v)} as TOML")


def vllm_command(sc: Scenario, c: Candidate) -> str:
    """The `vllm serve` line of a candidate (disaggregated or replicas: how to run each
    instance)."""
    model = MODEL_IDS.get(sc.model.preset, "MODEL")
    args = ["vllm", "serve", model, f"--tensor-parallel-size {c.tp}"]
    if c.pp > 1:
        args.append(f"--pipeline-parallel-size {c.pp}")
    if c.dp > 1:
        args.append(f"--data-parallel-size {c.dp}")
    if c.expert_parallel:
        args.append("--enable-expert-parallel")
    args += [f"--max-num-seqs {c.max_num_seqs}",
             f"--max-num-batched-tokens {c.max_num_batched_tokens}",
             "--enable-prefix-caching" if c.prefix_caching else "--no-enable-prefix-caching",
             f"--gpu-memory-utilization {sc.kv.gpu_memory_utilization:g}",
             f"--block-size {sc.kv.block_size}"]
    if c.policy == "fcfs":
        args.append("--no-enable-chunked-prefill")
    if c.policy == "priority":
        args.append("--scheduling-policy priority")
    if sc.model.dtype_bytes == 1:
        args.append("--quantization fp8")
    if (sc.model.kv_dtype_bytes or sc.model.dtype_bytes) == 1:
        args.append("--kv-cache-dtype fp8")
    line = " ".join(args)
    if c.disaggregated:
        return (f"# {_instances(c.prefill, 'prefill')} and {_instances(c.decode, 'decode')}, "
                f"{c.tp} GPU(s) each, joined by a KV connector (vLLM's --kv-transfer-config, "
                "kv_role kv_producer / kv_consumer); a proxy in front sends each request to a "
                "prefill instance, then to a decode instance (vLLM's disaggregated serving "
                "examples).\n"
                f"# each prefill instance runs:\n"
                f"{line} --kv-transfer-config '{{\"kv_connector\":\"NixlConnector\","
                f"\"kv_role\":\"kv_producer\"}}'\n"
                f"# each decode instance runs:\n"
                f"{line} --kv-transfer-config '{{\"kv_connector\":\"NixlConnector\","
                f"\"kv_role\":\"kv_consumer\"}}'")
    if c.replicas > 1:
        return (f"# {c.replicas} replicas of {c.tp} GPU(s) each behind a {c.router} router; "
                "each replica runs:\n" + line)
    return line


def sglang_command(sc: Scenario, c: Candidate) -> str:
    """The SGLang `launch_server` line of a candidate."""
    model = MODEL_IDS.get(sc.model.preset, "MODEL")
    args = ["python", "-m", "sglang.launch_server", f"--model-path {model}", f"--tp-size {c.tp}"]
    if c.pp > 1:
        args.append(f"--pp-size {c.pp}")
    if c.dp > 1:
        args.append(f"--dp-size {c.dp}")
    if c.expert_parallel:
        args.append(f"--ep-size {c.tp * c.dp}")
    args += [f"--max-running-requests {c.max_num_seqs}",
             f"--chunked-prefill-size {c.max_num_batched_tokens}",
             f"--mem-fraction-static {sc.kv.gpu_memory_utilization:g}"]
    if not c.prefix_caching:
        args.append("--disable-radix-cache")
    if c.policy == "lpm":
        args.append("--schedule-policy lpm")
    if c.replicas > 1 and not c.disaggregated:
        method = "round_robin" if c.router == "round-robin" else "shortest_queue"
        args += [f"--dp-size {c.replicas}", f"--load-balance-method {method}"]
    if sc.model.dtype_bytes == 1:
        args.append("--quantization fp8")
    line = " ".join(args)
    if c.disaggregated:
        return (f"# {_instances(c.prefill, 'prefill')} and {_instances(c.decode, 'decode')}; "
                "each prefill instance runs:\n"
                f"{line} --disaggregation-mode prefill\n# each decode instance runs:\n"
                f"{line} --disaggregation-mode decode\n"
                "# and a router in front, with one --prefill URL per prefill instance and one "
                "--decode URL per decode instance:\n"
                "python -m sglang_router.launch_router --pd-disaggregation"
                + " --prefill http://PREFILL_HOST:PORT" * c.prefill
                + " --decode http://DECODE_HOST:PORT" * c.decode)
    return line


def _instances(n: int, role: str) -> str:
    return f"{'a' if n == 1 else n} {role} instance{'s' if n > 1 else ''}"
