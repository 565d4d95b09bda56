"""Fitting the built-in engine profiles (`sim.model.presets.ENGINES`) to published measurements, and
their leave-one-out and leave-group-out errors.

What is fitted (`FIT`): the kernel efficiencies and the all-reduce's time beyond its kernel are
shared by every engine (the GEMM, attention and collective libraries are largely the same, and
few points would otherwise pin them), and each engine with points has its own CPU time per step.
The fixed time per layer is not fitted: the profiles' own (sim.model.presets: launched one by one
by TensorRT-LLM's C++ runtime, 0.6's included, or replayed from CUDA graphs by the others). Every fitted
coefficient has a prior, a value and a spread in log space from public micro-benchmarks
(Vidur's per-operator profiles of vLLM on A100/H100, NCCL all-reduce latencies), so that a
coefficient the points do not constrain stays where the physics puts it rather than drifting to
fit noise. The objective is the sum of squared log(predicted / published) / POINT_SPREAD over the
`use = fit` rows plus the priors' squared (log(value / prior) / spread).

Points whose requests all arrive at t = 0 (fixed batches, offline throughput) have a schedule
that does not depend on the step times, so `sim.model.fit.RunRecord.replay` re-times them exactly for
any coefficients; the fit runs on those first (stage 1). The others (online rows: arrivals over
time) are simulated at every trial of the engine's own CPU coefficients (stage 2).

The terms only mixtures of experts, FP4 weights and TensorRT-LLM's PyTorch backend use
(`FIT_MOE`) are fitted last (stage 3), every stage-1 and stage-2 coefficient fixed, on the rows
they touch (`touched`); stages 1 and 2 never see those rows, so the dense coefficients are the
same with or without them. Those rows run with the dense coefficients of the profile their
engine derives from (`DERIVED`); the data-parallel ones are deployments of several ranks,
simulated at every trial.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from sim.deploy.build import is_deployment
from sim.model import presets, trust
from sim.model.fit import least_squares, nelder_mead, record_run
from sim.model.validate import Point, metric_value, point_scenario, simulate as simulate_run
from sim.model.costmodel import CostModel
from sim.inputs.scenario import BUNDLED_DIR, load_scenario

# name -> (prior value, spread of its log); "shared" coefficients apply to every engine.
FIT: dict[str, dict[str, tuple[float, float]]] = {
    "shared": {
        "fp8_gemm_efficiency": (0.6, 0.3),
        "bandwidth_efficiency": (0.85, 0.1),
        "attention_efficiency": (0.5, 0.5),
        "allreduce_sync_us": (10.0, 1.0),  # (no measurement: a loose prior)
    },
    # (its all-reduce: NCCL called outside CUDA graphs, no one-shot kernel; the prior is Vidur's
    # profiles of NCCL called so, 30-40 us per small all-reduce at TP 4 on a DGX)
    "tensorrt-llm-0.6": {"gemm_efficiency": (0.75, 0.15), "cpu_base_us": (1000.0, 2.0),
                         "cpu_per_seq_us": (10.0, 2.0),
                         "allreduce_latency_us": (35.0, 0.5), "kv_bandwidth_efficiency": (0.75, 0.3),
                         "gqa_reread": (0.5, 1.0)},
    "vllm-0.6-multistep": {"gemm_efficiency": (0.75, 0.15), "cpu_base_us": (1000.0, 2.0),
                           "cpu_per_seq_us": (10.0, 2.0),
                           "kv_bandwidth_efficiency": (0.75, 0.3)},
    "sglang-0.3": {"gemm_efficiency": (0.75, 0.15), "cpu_base_us": (1000.0, 2.0),
                   "cpu_per_seq_us": (10.0, 2.0),
                   "kv_bandwidth_efficiency": (0.75, 0.3)},
}
# Stage 3 (see the module docstring): name -> (prior value, spread of its log), as FIT.
FIT_MOE: dict[str, dict[str, tuple[float, float]]] = {
    "shared": {
        "moe_gemm_efficiency": (0.5, 0.5),  # (no measurement: a loose prior)
        # (collectives of uneven sizes, a few MB per layer: below the all-reduce's measured
        # fraction of the link, presets.COLLECTIVES; loosely)
        "moe_comm_efficiency": (presets.COLLECTIVES["allreduce_efficiency"], 0.5),
        # (FP4 tensor cores: twice FP8's peak; with their block scales and smaller tiles
        # about FP8's FLOP/s, so half FP8's fraction; loosely)
        "fp4_gemm_efficiency": (FIT["shared"]["fp8_gemm_efficiency"][0] / 2, 0.5),
    },
    # (Python's host time per sequence: the other engines' prior, loose)
    "tensorrt-llm-pytorch": {"cpu_per_seq_us": FIT["tensorrt-llm-0.6"]["cpu_per_seq_us"]},
}
# The spread of log(predicted / published) expected of a good model (measurement noise and what
# no model of this size captures): it weighs the points against the priors.
POINT_SPREAD = 0.1
# Profiles that take every coefficient of a fitted one but their own flags (presets.DERIVED:
# TensorRT-LLM's C++ runtime's launches, NIM's serial host time and vLLM V1's API server's time
# fixed apart on published points of their own; the PyTorch backend's time per sequence fitted
# in stage 3).
DERIVED = presets.DERIVED


def _kind(name: str) -> str:
    return "eff" if name.endswith(("efficiency", "reread")) else "pos"  # eff: in (0, 1)


def _table(key: str) -> dict:
    """The table (FIT or FIT_MOE) that fits the flat key `key` (`name` or `engine:name`)."""
    group, _, name = key.rpartition(":")
    return FIT if name in FIT.get(group or "shared", {}) else FIT_MOE


def touched(scenario) -> bool:
    """Whether a stage-3 coefficient (FIT_MOE) times the scenario: a mixture of experts, FP4
    weights, or an engine with stage-3 coefficients of its own."""
    m = scenario.model
    return (m.num_experts > 0 or scenario.engine.preset in FIT_MOE
            or presets.QUANTIZATIONS.get(m.quantization, (0.0, ""))[1] == "fp4")


def _source(name: str) -> tuple[str, set[str]]:
    """The profile `name` takes its fitted coefficients from (itself, or the one DERIVED from)
    and the keys the derived profiles' own flags set on the way."""
    own: set[str] = set()
    while name in DERIVED:
        name, flags = DERIVED[name]
        own |= set(flags)
    return name, own


@dataclasses.dataclass
class _Row:
    point: Point
    scenario: object
    record: object  # None for a deployment of several ranks (simulated at every trial)
    static: bool  # every request arrives at t = 0: the schedule does not depend on timing


def _own(c: dict, engine: str) -> dict:
    """`engine`'s own coefficients in the flat fit vector `c` (keys `engine:name`), by name."""
    return {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith(engine + ":")}


def _coeffs(row: _Row, c: dict) -> dict:
    """The engine coefficients `row` runs with under the flat fit vector `c`: the shared ones,
    those of the profile its engine derives from (less what the derived flags set) and its
    engine's own; a row no stage-3 coefficient touches takes none of them."""
    name = row.scenario.engine.preset
    src, flags = _source(name)
    shared = [*FIT["shared"], *(FIT_MOE["shared"] if touched(row.scenario) else ())]
    out = {k: c[k] for k in shared if k in c}
    if src != name:
        out.update({k: v for k, v in _own(c, src).items() if k not in flags})
    out.update(_own(c, name))
    return out


def _with(scenario, coeffs: dict):
    return dataclasses.replace(scenario, engine=dataclasses.replace(scenario.engine, **coeffs))


def predict(row: _Row, c: dict, simulate: bool = False) -> float:
    """The row's metric under coefficients `c`: re-timed from its record, or simulated."""

    sc = _with(row.scenario, _coeffs(row, c))
    m = row.point.metric
    if simulate or not row.static:
        run = simulate_run(sc) if row.record is None else record_run(sc).summary
        return metric_value(m, run, sc.model.tensor_parallel)
    r = row.record.replay(CostModel(sc))
    if m.is_latency:
        a = r[m.quantity]
        a = a[np.isfinite(a)]
        v = float(np.mean(a) if m.stat == "mean" else np.percentile(a, float(m.stat[1:])))
        v *= m.scale
    elif m.quantity == "output_tps":
        v = r["output_tokens"] / r["duration"]
    else:  # the other throughputs need the whole summary
        return metric_value(m, record_run(sc).summary, sc.model.tensor_parallel)
    return v / sc.model.tensor_parallel if m.per_gpu else v


def prepare(points: list[Point]) -> list[_Row]:
    """Each point's scenario (engine from its row) and its recorded schedule."""
    rows = []
    for p in points:
        sc = point_scenario(p)
        if is_deployment(sc):  # (several ranks: no one engine's schedule to replay)
            rows.append(_Row(p, sc, None, False))
            continue
        rec = record_run(sc)
        rows.append(_Row(p, sc, rec, bool(len(rec.arrival)) and float(rec.arrival.max()) == 0.0))
    return rows


def _prior_terms(c: dict) -> list[float]:
    out = []
    for k, v in c.items():
        group, _, name = k.rpartition(":")
        mean, spread = _table(k)[group or "shared"][name]
        out.append((math.log(max(v, 1e-6)) - math.log(mean)) / spread)
    return out


def _start(engines: set[str], table: dict = FIT) -> dict:
    """The shipped profiles' values of what `table` fits for `engines`."""
    c = {k: presets.ENGINES[presets.DEFAULT_ENGINE].get(k, m)
         for k, (m, _) in table["shared"].items()}
    for name in sorted(engines):  # (a fixed parameter order: a set follows string hashing)
        for k, (m, _) in table.get(name, {}).items():
            c[f"{name}:{k}"] = presets.ENGINES.get(name, {}).get(k, m)
    return c


def fit(rows: list[_Row], start: dict | None = None, log=None,
        stage2: set[str] | None = None, stage2_iter: int = 12, stage3: bool = True,
        stage3_iter: int = 12) -> dict:
    """Coefficients fitted to `rows` (see the module docstring): a flat dict whose keys are
    shared names or `engine:name`. Stage 2 runs for the engines in `stage2` (default: all),
    stage 3 where `stage3` and a row is `touched`."""
    moe = [r for r in rows if touched(r.scenario)]
    rows = [r for r in rows if not touched(r.scenario)]
    engines = {r.scenario.engine.preset for r in rows} & set(FIT)
    given = dict(start or _start(engines))
    c = {k: v for k, v in given.items() if _table(k) is FIT
         and (":" not in k or k.split(":")[0] in engines)}
    kinds = {k: _kind(k.rpartition(":")[2]) for k in c}
    static = [r for r in rows if r.static]

    def res1(cc):
        return [math.log(predict(r, cc) / r.point.published) / POINT_SPREAD
                for r in static] + _prior_terms(cc)

    c, _ = least_squares(res1, c, kinds)
    if log:
        log(f"stage 1 ({len(static)} static rows): {_fmt(c)}")
    for name in sorted(engines if stage2 is None else engines & stage2):
        mine = [r for r in rows if r.scenario.engine.preset == name]
        if all(r.static for r in mine):
            continue
        own = {k: v for k, v in c.items() if k.startswith(name + ":")}
        fixed = {k: v for k, v in c.items() if k not in own}
        own, _ = least_squares(_residuals(mine, fixed), own, {k: kinds[k] for k in own},
                               max_iter=stage2_iter, tol=1e-4, diff_step=0.03)
        c.update(own)
        if log:
            log(f"stage 2 ({name}, {len(mine)} rows): {_fmt(own)}")
    if moe and stage3:
        mine3 = {r.scenario.engine.preset for r in moe} & set(FIT_MOE)
        own = {k: given.get(k, v) for k, v in _start(mine3, FIT_MOE).items()}
        res3 = _residuals(moe, c)
        own, _ = least_squares(res3, host_time_start(res3, own),
                               {k: _kind(k.rpartition(":")[2]) for k in own},
                               max_iter=stage3_iter, tol=1e-4, diff_step=0.03)
        c.update(own)
        if log:
            log(f"stage 3 ({len(moe)} rows): {_fmt(own)}")
    return c


# A step overlapping its host's work takes max(GPU time, host time): below the host time per
# sequence where the host binds, no row moves with it, and a local search started there stays.
HOST_TIME_SCAN = (2.0, 4.0, 8.0)


def host_time_start(residuals, start: dict) -> dict:
    """`start` with each host time per sequence (`cpu_per_seq_us`) raised to the multiple of
    its value in `HOST_TIME_SCAN` (or kept) whose sum of squared `residuals` is least: a start
    on the side of the kink where the rows that bind it speak."""
    out = dict(start)
    for k in start:
        if k.rpartition(":")[2] != "cpu_per_seq_us":
            continue
        best, pick = math.inf, start[k]
        for m in (1.0, *HOST_TIME_SCAN):
            r = np.asarray(residuals({**out, k: start[k] * m}), dtype=np.float64)
            cost = float(r @ r) if np.all(np.isfinite(r)) else math.inf
            if cost < best:
                best, pick = cost, start[k] * m
        out[k] = pick
    return out


def _residuals(rows: list[_Row], fixed: dict):
    """Stages 2 and 3's residuals: the rows' log errors, simulated unless static, under the
    trial coefficients over `fixed`, and the trial coefficients' priors."""
    def res(cc):
        full = {**fixed, **cc}
        return ([math.log(predict(r, full) / r.point.published) / POINT_SPREAD for r in rows]
                + _prior_terms(cc))
    return res


def _fmt(c: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in c.items())


def profiles(c: dict) -> dict[str, dict]:
    """The engine profiles a fit gives: each fitted engine's coefficients over its current
    profile, and the derived profiles (with their own stage-3 coefficients)."""
    out = {}
    shared = [*FIT["shared"], *FIT_MOE["shared"]]
    for name in FIT:
        if name == "shared":
            continue
        base = dict(presets.ENGINES[name])
        base.update({k: c[k] for k in shared if k in c})
        base.update(_own(c, name))
        out[name] = base
    for name, (src, flags) in DERIVED.items():
        if src in out:
            out[name] = {**out[src], **flags}
            out[name].update(_own(c, name))
    return out


def prior_start(engines: set[str]) -> dict:
    """The priors' values of every coefficient fitted for `engines` (a start that has seen no
    point, unlike the shipped profiles)."""
    c = {}
    for table in (FIT, FIT_MOE):
        c.update({k: m for k, (m, _) in table["shared"].items()})
        for name in sorted(engines):
            c.update({f"{name}:{k}": m for k, (m, _) in table.get(name, {}).items()})
    return c


def leave_one_out(rows: list[_Row], log=None) -> list[tuple[Point, float]]:
    """For each row: fit the others from the priors (neither the shipped profiles nor a fit
    of all rows, which have seen the row) and predict it by simulation. Returns (point,
    predicted / published) pairs."""
    folds = _held_out(rows, [(r.point.id, [i]) for i, r in enumerate(rows)], log)
    return [pair for _, pairs in folds for pair in pairs]


def leave_group_out(rows: list[_Row], key: str,
                    log=None) -> list[tuple[str, list[tuple[Point, float]]]]:
    """Hold out every row sharing a value of `key` (one of `trust.GROUPS`: what a point's
    scenario names) at once, fit the rest from the priors and predict the held-out rows: the
    error on a model, a GPU, a data type, a degree of tensor parallelism or an engine the fit
    has not seen. Returns, per value, (value, [(point, predicted / published)]). A value held
    by every row is skipped (nothing would be left to fit)."""
    of = trust.GROUPS[key]
    values: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        values.setdefault(of(r.scenario), []).append(i)
    return _held_out(rows, [(v, ix) for v, ix in sorted(values.items()) if len(ix) < len(rows)],
                     log)


def _held_out(rows: list[_Row], folds: list[tuple[str, list[int]]],
              log=None) -> list[tuple[str, list[tuple[Point, float]]]]:
    start = prior_start({r.scenario.engine.preset for r in rows} & (set(FIT) | set(FIT_MOE)))
    out = []
    for name, held in folds:
        out_ix = set(held)
        rest = [r for i, r in enumerate(rows) if i not in out_ix]
        test = [rows[i] for i in held]
        # Stage 2 runs for the engines the held-out rows take their coefficients from, and
        # stage 3 when a held-out row is touched by it, only (the others' rows do not change
        # what predicts them).
        c = fit(rest, start=start, stage2={_source(r.scenario.engine.preset)[0] for r in test},
                stage3=any(touched(r.scenario) for r in test))
        # (an engine with no other row keeps its priors, not the profile its scenario was
        # built from, which was fitted on these rows too)
        c = {**start, **c}
        pairs = [(r.point, predict(r, c, simulate=True) / r.point.published) for r in test]
        out.append((name, pairs))
        if log:
            log(f"leave out {name}: ratio " + ", ".join(f"{p.id} {x:.3f}" for p, x in pairs))
    return out


# --- profiles derived from published ratios -------------------------------------------------------
# Engines with no absolute points of their own but a published throughput ratio to one that has:
# (engine, reference, scenario in scenarios/fidelity/ratios/, throughput(engine) / throughput(ref)).
# Source: the vLLM team, "vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency Reduction"
# (blog.vllm.ai, 2024-09-05): v0.6.0 (multi-step) against v0.5.3 gave 2.7x the throughput for
# Llama 3 8B on one H100 and 1.8x for 70B on four; multi-step alone 1.28x for the 70B.
RATIOS = [
    ("vllm-0.5", "vllm-0.6-multistep", "vllm-8b-h100", 1 / 2.7),
    ("vllm-0.5", "vllm-0.6-multistep", "vllm-70b-h100", 1 / 1.8),
    ("vllm-0.6", "vllm-0.6-multistep", "vllm-70b-h100", 1 / 1.28),
]
# What each ratio-derived engine fits (its kernels are its reference's: same code): the CPU
# time per sequence only. Vidur's measured vLLM CPU time grows with the batch (~2 ms per step at
# batch 8, ~7.6 ms at 64), and the two 0.5 ratios (8B and 70B, both at large batches) cannot
# tell a per-step from a per-sequence cost (fitting both gave 4.7 ms + 408 us or 27 ms + 14 us
# from two starts): a small batch is not charged a large batch's overhead.
RATIO_FIT = {"vllm-0.5": ("cpu_per_seq_us",), "vllm-0.6": ("cpu_per_seq_us",)}


def fit_ratios(engines: dict[str, dict], log=None) -> dict[str, dict]:
    """The ratio-derived engines' CPU coefficients (RATIOS), on top of `engines` (profile name
    -> coefficients, the reference profiles already fitted). Returns the updated profiles."""

    out = {k: dict(v) for k, v in engines.items()}

    def throughput(name: str, scenario: str, coeffs: dict) -> float:
        sc = load_scenario(str(BUNDLED_DIR / "fidelity" / "ratios" / f"{scenario}.toml"),
                           [f'engine.preset="{name}"'])
        sc = _with(sc, coeffs)
        return record_run(sc).summary["throughput"]["output_tokens_per_s"]

    for name, names in RATIO_FIT.items():
        rows = [r for r in RATIOS if r[0] == name]
        ref = {scen: throughput(r, scen, out[r]) for _, r, scen, _ in rows}
        base = out[name]

        def objective(c, rows=rows, ref=ref, base=base, name=name):
            err = [math.log(throughput(name, scen, {**base, **c}) / ref[scen] / ratio)
                   for _, _, scen, ratio in rows]
            return float(np.sum(np.square(err)))

        start = {k: base[k] for k in names}
        got, _ = nelder_mead(objective, start, {k: "pos" for k in names}, max_evals=60)
        out[name] = {**base, **got}
        if log:
            log(f"ratio-derived {name}: {_fmt(got)}")
    return out
