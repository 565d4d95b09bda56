"""`servesim calibrate`: fit an engine profile's coefficients to measurements of a real deployment
and write them as a TOML file a scenario names in `[engine] preset`.

Two kinds of measurements:

- A kernel-timing CSV, one measured operation per row. Columns: `kind` and one time column whose
  name gives the unit (`time_s`, `time_ms` or `time_us`), and per kind:
    decode     `batch` (sequences), `context` (cached tokens per sequence): one decode-only
               forward pass on the GPU
    prefill    `tokens`, optional `context` (cached tokens before the chunk, default 0) and
               `batch` (sequences sharing the tokens equally, default 1): one prefill forward pass
    allreduce  `bytes` (per GPU), optional `gpus` (default the scenario's tensor_parallel): one
               all-reduce
    cpu        `batch`: the engine's CPU time for one step of that many sequences
  Forward passes fit the kernel coefficients (GEMM, bandwidth, K/V bandwidth and attention
  efficiencies, the fixed cost per layer), all-reduces the latency and bandwidth efficiency, CPU
  rows the CPU time per step and per sequence; a kind with no rows keeps the base profile's.
- The result JSON `vllm bench serve --save-result --save-detailed` writes (`input_lens`,
  `output_lens`, `ttfts`, `itls`, `start_times` or `request_rate` and `burstiness`): the exact
  requests are replayed through the scenario's deployment and the GEMM and bandwidth
  efficiencies and the CPU time per step and per sequence are fitted to every request's measured
  TTFT and TPOT.

Every fitted coefficient keeps the prior of `sim.model.profiles.FIT` (or `OWN_PRIORS`), so a coefficient the
measurements do not constrain stays at its physical value. A file with a missing column, an
unknown unit or kind, a negative or non-numeric time, a value in a column its row's kind does
not read, too few points, or rows that contradict each other raises MeasurementError naming the
file, line and field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.model import presets
from sim.errors import ServesimError, shown
from sim.fileio import csv_rows, json_loads, read_input_text, reason
from sim.model.fit import least_squares, nelder_mead
from sim.limits import MAX_TIME_S, MAX_TOKENS
from sim.model.profiles import FIT, POINT_SPREAD
from sim.model.costmodel import CostModel, nccl_over_pcie
from sim.inputs.workload import Workload
from sim.deploy.build import build
from sim.stats.metrics import summarize

UNITS = {"time_s": 1.0, "time_ms": 1e-3, "time_us": 1e-6}
KINDS = {"decode": ("batch", "context"), "prefill": ("tokens",), "allreduce": ("bytes",),
         "cpu": ("batch",)}
OPTIONAL = {"prefill": {"context": 0.0, "batch": 1.0}, "allreduce": {"gpus": 0.0},
            "decode": {}, "cpu": {}}
# Repeated measurements of one configuration further apart than this factor contradict.
CONTRADICTION = 1.5
MIN_ROWS = {"forward": 3, "allreduce": 2, "cpu": 2}
MIN_REQUESTS = 10
# The spread of log(model / measured) a kernel timing is weighed with against the priors: such
# measurements repeat to a few percent (end-to-end latencies use sim.model.profiles.POINT_SPREAD).
KERNEL_SPREAD = 0.02


class MeasurementError(ServesimError):
    """A measurement file that cannot be read, or that cannot be fitted."""


@dataclass
class Row:
    kind: str
    values: dict  # the kind's inputs
    seconds: float
    line: int


# --- reading -------------------------------------------------------------------------------------
# The largest value each input may take: past these a measurement describes no machine (a
# 23-digit batch, a petabyte all-reduce), and the fit would be about float overflow.
TOP = {"batch": MAX_TOKENS, "context": MAX_TOKENS, "tokens": MAX_TOKENS, "bytes": 1e15, "gpus": 1e6}
# A measured duration (seconds) outside this range is not one a kernel or a step takes.
SECONDS_RANGE = (1e-9, MAX_TIME_S)


def _number(path, line, field, text, top: float = math.inf) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError, OverflowError):
        raise MeasurementError(f"{path}:{line}: {field}: {shown(text)} is not a number") from None
    if not math.isfinite(v):
        raise MeasurementError(f"{path}:{line}: {field}: {shown(text)} is not a finite number")
    if v < 0:
        raise MeasurementError(f"{path}:{line}: {field}: {shown(text)} is negative")
    if v > top:
        raise MeasurementError(f"{path}:{line}: {field}: {shown(text)} is more than {top:g}")
    return v


def _seconds(path, line, field, v) -> None:
    lo, hi = SECONDS_RANGE
    if not lo <= v <= hi:
        raise MeasurementError(f"{path}:{line}: {field}: {v:g} s is outside {lo:g}-{hi:g} s, not a "
                               "duration a GPU step takes")


def read_kernel_csv(path: Path) -> list[Row]:
    """The rows of a kernel-timing CSV (module docstring). Raises MeasurementError."""
    try:
        text = read_input_text(path, encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise MeasurementError(f"{path}: cannot read: {reason(e)}") from None
    header, table = csv_rows(path, text, MeasurementError)
    if "kind" not in header:
        raise MeasurementError(f"{path}:1: kind: missing column (need kind and one of "
                               f"{', '.join(UNITS)})")
    times = [h for h in header if h.startswith("time")]
    if len(times) != 1 or times[0] not in UNITS:
        found = ", ".join(times) or "none"
        raise MeasurementError(f"{path}:1: time column: {found}: need exactly one of "
                               f"{', '.join(UNITS)} (the name gives the unit)")
    tcol = times[0]
    rows = []
    for line, raw in table:
        if not any(raw.values()):
            continue
        kind = raw.get("kind", "")
        if kind not in KINDS:
            raise MeasurementError(f"{path}:{line}: kind: {shown(kind)}: expected one of "
                                   f"{', '.join(KINDS)}")
        values = {}
        for col in KINDS[kind]:
            if col not in header or raw.get(col, "") == "":
                raise MeasurementError(f"{path}:{line}: {col}: missing (a {kind} row needs "
                                       f"{', '.join(KINDS[kind])})")
            values[col] = _number(path, line, col, raw[col], TOP[col])
        for col, default in OPTIONAL[kind].items():
            values[col] = (_number(path, line, col, raw[col], TOP[col]) if raw.get(col, "") != ""
                           else default)
        unused = [c for c in TOP if raw.get(c, "") != "" and c not in values]
        if unused:  # a value the fit would drop without a word (the row is likely mistyped)
            raise MeasurementError(f"{path}:{line}: {unused[0]}: {shown(raw[unused[0]])}: a "
                                   f"{kind} row does not read it (it reads "
                                   f"{', '.join([*KINDS[kind], *OPTIONAL[kind]])})")
        seconds = _number(path, line, tcol, raw.get(tcol, "")) * UNITS[tcol]
        if seconds <= 0:
            raise MeasurementError(f"{path}:{line}: {tcol}: {shown(raw.get(tcol))} must be "
                                   "positive")
        _seconds(path, line, tcol, seconds)
        if kind in ("decode", "cpu") and values["batch"] < 1:
            raise MeasurementError(f"{path}:{line}: batch: must be at least 1")
        if kind == "prefill" and (values["tokens"] < 1 or values["batch"] < 1):
            raise MeasurementError(f"{path}:{line}: tokens: must be at least 1 (batch too)")
        rows.append(Row(kind, values, seconds, line))
    if not rows:
        raise MeasurementError(f"{path}: no measurement rows")
    _check_contradictions(path, rows)
    return rows


def _check_contradictions(path, rows: list[Row]) -> None:
    seen: dict[tuple, Row] = {}
    for r in rows:
        key = (r.kind, tuple(sorted(r.values.items())))
        other = seen.get(key)
        if other is None:
            seen[key] = r
        elif max(r.seconds, other.seconds) > CONTRADICTION * min(r.seconds, other.seconds):
            raise MeasurementError(
                f"{path}:{r.line}: time: contradicts line {other.line} (the same {r.kind} "
                f"configuration measured {other.seconds * 1e3:.4g} ms there, "
                f"{r.seconds * 1e3:.4g} ms here)")


# --- kernel-timing fit ---------------------------------------------------------------------------
def _forward_args(r: Row) -> tuple:
    """The cost model's step arguments for a forward-pass row."""
    v = r.values
    if r.kind == "decode":
        b = int(v["batch"])
        return (0, 0, 0, b, b * v["context"], b, b)
    k = max(int(v["batch"]), 1)
    m = v["tokens"] / k
    c = v["context"]
    return (v["tokens"], k * (m * c + m * (m + 1) / 2), k * c, 0, 0, k, k)


# Priors of what calibration fits and the bundled fit does not: a layer's fixed time, at the
# graph-replaying engines' value (Vidur's profiles: sim.model.presets), loosely.
OWN_PRIORS = {"layer_overhead_us": (presets._KERNELS["layer_overhead_us"], 1.0)}


def _prior(name: str) -> tuple[float, float]:
    if name in OWN_PRIORS:
        return OWN_PRIORS[name]
    for group in FIT.values():
        if name in group:
            return group[name]
    raise KeyError(name)


def _prior_terms(c: dict) -> list[float]:
    out = []
    for k, v in c.items():
        mean, spread = _prior(k)
        out.append((math.log(max(v, 1e-6)) - math.log(mean)) / spread)
    return out


def _kind(name: str) -> str:
    return "eff" if name.endswith("efficiency") else "pos"


def _engine_with(scenario, coeffs: dict):
    return dataclasses.replace(scenario, engine=dataclasses.replace(scenario.engine, **coeffs))


@dataclass
class Fit:
    """What a calibration found: the coefficients, and per measurement the fitted value."""

    coeffs: dict
    residuals: list[dict]  # {what, measured, fitted, error}

    def errors(self) -> np.ndarray:
        return np.array([abs(r["error"]) for r in self.residuals], dtype=np.float64)


def fit_kernels(rows: list[Row], scenario, path) -> Fit:
    """Coefficients fitted to kernel-timing rows on `scenario`'s model and hardware."""

    fwd = [r for r in rows if r.kind in ("decode", "prefill")]
    ar = [r for r in rows if r.kind == "allreduce"]
    cpu = [r for r in rows if r.kind == "cpu"]
    for name, group in (("forward", fwd), ("allreduce", ar), ("cpu", cpu)):
        if group and len(group) < MIN_ROWS[name]:
            kinds = "decode and prefill" if name == "forward" else name
            raise MeasurementError(f"{path}: too few {kinds} rows ({len(group)}; at least "
                                   f"{MIN_ROWS[name]} are needed to fit them)")
    coeffs: dict = {}
    residuals: list[dict] = []
    e = scenario.engine
    if fwd:
        gemm = ("fp8_gemm_efficiency" if scenario.model.dtype_bytes == 1
                and scenario.hardware.fp8_tflops > 0 else "gemm_efficiency")
        names = [gemm, "bandwidth_efficiency", "kv_bandwidth_efficiency", "attention_efficiency",
                 "layer_overhead_us"]
        start = {k: getattr(e, k) for k in names}
        # GPU time only: no CPU term, and one layer's all-reduces as the scenario has them.
        base = _engine_with(scenario, {"cpu_base_us": 0.0, "cpu_per_seq_us": 0.0,
                                       "cpu_overlap": False, "preset": presets.DEFAULT_ENGINE})
        args = np.array([_forward_args(r) for r in fwd], dtype=np.float64).T
        measured = np.array([r.seconds for r in fwd])

        def model(c):
            return np.asarray(CostModel(_engine_with(base, c)).steps(*args)[0])

        def res(c):
            return list(np.log(model(c) / measured) / KERNEL_SPREAD) + _prior_terms(c)

        got, _ = least_squares(res, start, {k: _kind(k) for k in names})
        coeffs.update(got)
        for r, m, f in zip(fwd, measured, model(got)):
            residuals.append({"what": f"line {r.line}: {r.kind} " + _describe(r.values),
                              "measured": m, "fitted": float(f), "error": float(f / m - 1)})
    if ar:
        gpus = {int(r.values["gpus"] or scenario.model.tensor_parallel) for r in ar}
        if min(gpus) < 2:
            raise MeasurementError(f"{path}: allreduce rows need gpus >= 2 (a gpus column, or "
                                   "model.tensor_parallel > 1 in the scenario)")
        x = np.array([2.0 * (g - 1) / g * r.values["bytes"] for r, g in
                      zip(ar, [int(r.values["gpus"] or scenario.model.tensor_parallel)
                               for r in ar])])
        y = np.array([r.seconds for r in ar])
        latency, per_byte = _line(x, y, path, ar, "bytes")
        link = scenario.hardware.interconnect_gbps * 1e9
        # (the latency and bandwidth of the GPUs' link: PCIe's where that is all they have)
        pcie = nccl_over_pcie(scenario.hardware, scenario.engine)
        if per_byte > 0 and link > 0:
            coeffs["allreduce_efficiency_pcie" if pcie else "allreduce_efficiency"] = float(
                min(1.0, 1.0 / (per_byte * link)))
        coeffs["allreduce_latency_pcie_us" if pcie else "allreduce_latency_us"] = latency * 1e6
        # (the measured line, whichever kernel ran, stands for every size: no one-shot or
        # in-switch reduction apart)
        coeffs["custom_allreduce_us"] = 0.0
        coeffs["allreduce_nvls"] = False
        for r, xi, yi in zip(ar, x, y):
            f = latency + per_byte * xi
            residuals.append({"what": f"line {r.line}: allreduce " + _describe(r.values),
                              "measured": yi, "fitted": f, "error": f / yi - 1})
    if cpu:
        x = np.array([r.values["batch"] for r in cpu])
        y = np.array([r.seconds for r in cpu])
        base_s, per_seq = _line(x, y, path, cpu, "batch")
        coeffs["cpu_base_us"] = base_s * 1e6
        coeffs["cpu_per_seq_us"] = per_seq * 1e6
        for r, xi, yi in zip(cpu, x, y):
            f = base_s + per_seq * xi
            residuals.append({"what": f"line {r.line}: cpu " + _describe(r.values),
                              "measured": yi, "fitted": f, "error": f / yi - 1})
    return Fit(coeffs, residuals)


def _describe(values: dict) -> str:
    return " ".join(f"{k}={v:g}" for k, v in values.items() if v or k != "gpus")


def _line(x, y, path, rows, field) -> tuple[float, float]:
    """Least-squares intercept and slope (both >= 0) of y over x. Raises MeasurementError when
    the rows cannot tell them apart or time falls as the work grows."""
    if len(set(x.tolist())) < 2:
        raise MeasurementError(f"{path}: the {rows[0].kind} rows need at least two different "
                               f"{field} values")
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        worst = rows[int(np.argmax(np.abs(y - (intercept + slope * x))))]
        raise MeasurementError(f"{path}:{worst.line}: time: the {rows[0].kind} times fall as "
                               f"{field} grows (contradictory measurements)")
    return float(max(intercept, 0.0)), float(slope)


# --- vllm bench serve results --------------------------------------------------------------------
@dataclass
class BenchRun:
    """The requests of a `vllm bench serve --save-detailed` result, as measured."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    ttft: np.ndarray  # s
    tpot: np.ndarray  # s, NaN for one-token outputs
    itl: list
    duration: float
    model_id: str
    path: Path


def read_bench_json(path: Path) -> BenchRun:
    """The successful requests of a `vllm bench serve` result file. Raises MeasurementError."""
    try:
        data = json_loads(read_input_text(path))
    except (OSError, UnicodeDecodeError) as e:
        raise MeasurementError(f"{path}: cannot read: {reason(e)}") from None
    except json.JSONDecodeError as e:
        raise MeasurementError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise MeasurementError(f"{path}:1: expected a JSON object (vllm bench serve "
                               "--save-result)")
    need = ("input_lens", "output_lens", "ttfts", "itls")
    missing = [k for k in need if k not in data]
    if missing:
        raise MeasurementError(f"{path}:1: {missing[0]}: missing (run vllm bench serve with "
                               "--save-result --save-detailed)")
    if not isinstance(data["input_lens"], list):
        raise MeasurementError(f"{path}:1: input_lens: expected a list (one entry per request)")
    n = len(data["input_lens"])
    for k in (*need, "start_times", "errors"):
        if k in data and (not isinstance(data[k], list) or len(data[k]) != n):
            raise MeasurementError(f"{path}:1: {k}: expected a list of {n} entries (one per "
                                   "request, as input_lens)")
    errors = data.get("errors") or [""] * n
    ok = []
    for i in range(n):
        if errors[i]:
            continue
        for k in ("input_lens", "output_lens", "ttfts"):
            v = data[k][i]
            if not _is_number(v):
                raise MeasurementError(f"{path}:1: {k}[{i}]: {shown(v)} is not a number")
            if v < 0:
                raise MeasurementError(f"{path}:1: {k}[{i}]: {shown(v)} is negative")
            if k != "ttfts" and not (v == int(v) and v <= MAX_TOKENS):
                raise MeasurementError(f"{path}:1: {k}[{i}]: {shown(v)}: expected a token count "
                                       f"(a whole number up to {MAX_TOKENS:,})")
        if data["ttfts"][i] > 0:  # (0: no first token, a failed request)
            _seconds(path, 1, f"ttfts[{i}]", data["ttfts"][i])
        gaps = data["itls"][i]
        if not isinstance(gaps, list) or not all(_is_number(g) and 0 <= g <= MAX_TIME_S for g in gaps):
            raise MeasurementError(f"{path}:1: itls[{i}]: expected a list of non-negative "
                                   "seconds")
        if data["output_lens"][i] >= 1 and data["ttfts"][i] > 0:
            ok.append(i)
    if len(ok) < MIN_REQUESTS:
        raise MeasurementError(f"{path}: too few successful requests ({len(ok)}; at least "
                               f"{MIN_REQUESTS} are needed)")
    duration = data.get("duration") or 0.0
    if not _is_number(duration) or not 0 <= duration <= MAX_TIME_S:
        raise MeasurementError(f"{path}:1: duration: {shown(duration)}: expected the run's seconds")
    if "start_times" in data:
        bad = next((i for i in ok if not _is_number(data["start_times"][i])), None)
        if bad is not None:
            raise MeasurementError(f"{path}:1: start_times[{bad}]: {shown(data['start_times'][bad])} "
                                   "is not a number")
        t = np.array([data["start_times"][i] for i in ok], dtype=np.float64)
        arrival = t - t.min()
        if arrival.max() > MAX_TIME_S:
            raise MeasurementError(f"{path}:1: start_times: span {arrival.max():.3g} s, past the "
                                   f"{MAX_TIME_S:g} s a simulated clock can hold")
    else:
        rate = data.get("request_rate", "inf")
        if data.get("max_concurrency") not in (None, 0):
            raise MeasurementError(
                f"{path}:1: max_concurrency: {shown(data['max_concurrency'])}: a "
                "concurrency-bounded run cannot be replayed without start_times (use a newer vllm bench)")
        if rate not in ("inf", float("inf")):
            raise MeasurementError(
                f"{path}:1: request_rate: {shown(rate)}: without start_times the arrival times "
                "of a rate-limited run are unknown (use a newer vllm bench, which saves them)")
        arrival = np.zeros(len(ok))
    order = np.argsort(arrival, kind="stable")
    ok = [ok[i] for i in order]
    out = np.array([data["output_lens"][i] for i in ok], dtype=np.int64)
    itls = [data["itls"][i] for i in ok]
    ttft = np.array([data["ttfts"][i] for i in ok], dtype=np.float64)
    tpot = np.array([sum(g) / (o - 1) if o > 1 and g else np.nan for g, o in zip(itls, out)])
    return BenchRun(arrival[order], np.array([data["input_lens"][i] for i in ok], dtype=np.int64),
                    out, ttft, tpot, itls, float(duration),
                    str(data.get("model_id", "")), path)


def _is_number(v) -> bool:
    """A finite JSON number (not a bool, not a string); a 30-digit integer is one."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def bench_workload(run: BenchRun):
    """The measured requests as a servesim workload."""

    n = len(run.arrival)
    return Workload(arrival=run.arrival.astype(np.float64),
                    prompt=np.maximum(run.prompt, 1).astype(np.int64),
                    output=np.maximum(run.output, 1).astype(np.int64),
                    priority=np.zeros(n, dtype=np.int64), cancel_at=np.full(n, np.nan))


def replay_bench(run: BenchRun, scenario) -> tuple[np.ndarray, np.ndarray, dict]:
    """Per-request predicted TTFT and TPOT (s) of the measured requests on `scenario`, as the
    benchmark's client measured them (from sending, through the API server in front when the
    profile has one), and the run's summary."""

    engine = build(scenario, workload=bench_workload(run), record_events=False)
    if hasattr(engine, "instances"):
        raise MeasurementError(f"{scenario.source}: a bench result replays on one engine "
                               "instance (cluster.replicas = 1, no disaggregation)")
    engine.run()
    reqs = sorted((r for r in engine.requests.values() if r.parent_id is None),
                  key=lambda r: r.req_id)
    ttft = np.array([np.nan if r.client_ttft is None else r.client_ttft for r in reqs])
    # (client_tpot: None with fewer than two tokens)
    tpot = np.array([np.nan if r.finish_time is None or r.client_tpot is None else r.client_tpot
                     for r in reqs])
    return ttft, tpot, summarize(engine)


QUANTILES = np.arange(5, 100, 10)  # the deciles' midpoints: 5th, 15th, ... 95th percentile


def _distribution(ttft: np.ndarray, tpot: np.ndarray) -> dict[str, float]:
    """The latency distribution a bench result is fitted on: TTFT and TPOT at each of
    QUANTILES and their means. (One request's latency jumps with the step it happens to wait
    for; the distribution moves smoothly with the coefficients.)"""
    out = {}
    for name, a in (("ttft", ttft), ("tpot", tpot)):
        a = a[np.isfinite(a)]
        if not len(a):
            continue
        for q, v in zip(QUANTILES, np.percentile(a, QUANTILES)):
            out[f"{name} p{q}"] = float(v)
        out[f"{name} mean"] = float(a.mean())
    return out


def fit_bench(run: BenchRun, scenario) -> Fit:
    """GEMM and bandwidth efficiencies and CPU time per step fitted to the measured TTFT and
    TPOT distributions, replaying the exact requests."""

    e = scenario.engine
    gemm = ("fp8_gemm_efficiency" if scenario.model.dtype_bytes == 1
            and scenario.hardware.fp8_tflops > 0 else "gemm_efficiency")
    names = [gemm, "bandwidth_efficiency", "cpu_base_us", "cpu_per_seq_us"]
    start = {k: getattr(e, k) for k in names}
    measured = _distribution(run.ttft, run.tpot)
    # Each statistic summarises many requests: its noise shrinks as the run grows (a decile of
    # 1,000 requests is a hundred measurements), so a long run outweighs the priors more.
    spread = POINT_SPREAD * min(1.0, math.sqrt(len(measured) / max(len(run.ttft), 1)))

    def predicted(c):
        ttft, tpot, _ = replay_bench(run, _engine_with(scenario, c))
        return _distribution(ttft, tpot)

    def objective(c):
        p = predicted(c)
        r = np.array([math.log(p[k] / v) for k, v in measured.items()]) / spread
        return float(r @ r) + float(np.sum(np.square(_prior_terms(c))))

    # The latencies still move in small jumps as steps shift: a simplex search rather than
    # finite differences, restarted once to polish.
    kinds = {k: _kind(k) for k in names}
    got, _ = nelder_mead(objective, start, kinds, max_evals=120)
    got, _ = nelder_mead(objective, got, kinds, max_evals=80, scale=0.05)
    p = predicted(got)
    residuals = [{"what": k, "measured": v, "fitted": p[k], "error": p[k] / v - 1}
                 for k, v in measured.items()]
    return Fit(got, residuals)


def is_bench_json(path: Path) -> bool:
    return path.suffix.lower() == ".json"


def calibrate(path: Path, scenario) -> Fit:
    """Fit `scenario`'s engine to the measurements in `path` (kernel CSV or bench JSON)."""
    if is_bench_json(path):
        return fit_bench(read_bench_json(path), scenario)
    return fit_kernels(read_kernel_csv(path), scenario, path)


def preset_toml(fit: Fit, scenario, source: Path) -> str:
    """The engine profile a scenario can name (`[engine] preset = "FILE.toml"`): every
    coefficient, the measured ones replaced, and what it was fitted on."""
    e = dataclasses.asdict(scenario.engine)
    base = e.pop("preset")
    if base not in presets.ENGINES:
        base = presets.DEFAULT_ENGINE
    e.update(fit.coeffs)
    err = fit.errors()
    m, h = scenario.model, scenario.hardware
    lines = [
        f"# Engine profile fitted by `servesim calibrate` to {source.name}",
        f"# ({len(fit.residuals)} measurements; {m.num_params / 1e9:.3g} B parameters, "
        f"tensor_parallel {m.tensor_parallel}, hardware {h.preset or 'custom'}).",
        f"# Residuals: median |fitted / measured - 1| = {np.median(err):.3f}, "
        f"worst {err.max():.3f}.",
        "# Use it from a scenario:  [engine]  preset = \"<this file>\"",
        "[engine]",
        f'preset = "{base}"  # the profile it was fitted from',
    ]
    for k, v in e.items():
        fitted = "  # fitted" if k in fit.coeffs else ""
        text = str(v).lower() if isinstance(v, bool) else repr(v if isinstance(v, int) else float(v))
        lines.append(f"{k} = {text}{fitted}")
    return "\n".join(lines) + "\n"


def validate_bench(run: BenchRun, scenario) -> list[dict]:
    """Measured against predicted for a bench result's summary metrics (the rows
    `sim.model.validate.format_report` prints)."""
    _, _, s = replay_bench(run, scenario)
    itl = np.array([g for gaps in run.itl for g in gaps], dtype=np.float64)
    tpot = run.tpot[np.isfinite(run.tpot)]
    e2e = run.ttft + np.array([sum(g) for g in run.itl])
    span = run.duration or float((run.arrival + e2e).max())
    measured = {
        ("ttft", "mean"): run.ttft.mean() * 1e3, ("ttft", "p50"): np.median(run.ttft) * 1e3,
        ("tpot", "mean"): tpot.mean() * 1e3 if len(tpot) else None,
        ("tpot", "p50"): np.median(tpot) * 1e3 if len(tpot) else None,
        ("itl", "mean"): itl.mean() * 1e3 if len(itl) else None,
        ("itl", "p50"): np.median(itl) * 1e3 if len(itl) else None,
        ("e2e", "mean"): e2e.mean() * 1e3, ("e2e", "p50"): np.median(e2e) * 1e3,
    }
    words = {"mean": "mean", "p50": "median"}
    rows = []
    for (q, stat), m in measured.items():
        if m is None or not m > 0:
            continue
        p = s[f"{q}_ms"][stat]
        rows.append({"id": f"{words[stat]}_{q}", "engine": "", "profile": scenario.engine.preset,
                     "metric": f"{words[stat]} {q.upper()} (ms)", "published": float(m),
                     "predicted": float(p), "ratio": float(p / m), "regime": q, "use": "bench",
                     "source": str(run.path)})
    out = int(run.output.sum())
    if span > 0:
        m = out / span
        p = s["throughput"]["output_tokens_per_s"]
        rows.append({"id": "output_throughput", "engine": "", "profile": scenario.engine.preset,
                     "metric": "output tok/s", "published": m, "predicted": p, "ratio": p / m,
                     "regime": "throughput", "use": "bench", "source": str(run.path)})
    return rows
