"""Published measurements of real engines, and servesim's predictions of them.

A points file is a CSV with one measured point per row: `id`, `engine` (name and version, as
published), `config`, `metric` (what was measured, in the publication's words), `published`
(the value) and optionally `regime`, `source` and `use` (`fit`: the engine profiles were fitted
on it; `holdout`: never fitted, validation only). Each row is reproduced by a scenario: the
`scenario` column's path, else `scenarios/<id>.toml` next to the CSV (a folder holding
`published.csv` and `scenarios/` is accepted for the CSV); an optional `set` column holds the
row's own changes to it (`SECTION.KEY=VALUE` separated by `;`, a relative path from the CSV's
folder), so that the rows of one table share one scenario. A scenario that does not set
`[engine] preset` gets the profile `engine_preset_for` infers from the `engine` column.

`parse_metric` understands the usual wordings: TTFT / time to first token / 1st-token latency,
TPOT / time per output token, ITL / inter-token latency, E2E / end-to-end / request latency, each
with mean (the default), median / p50 or a percentile, in s, ms or us; output / total / input
token throughput and request throughput, per GPU (`/GPU`, `per GPU`) or not, and tokens/s per
user (1 / TPOT).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sim.errors import ServesimError, shown
from sim.model import presets
from sim.deploy.build import build
from sim.fileio import csv_rows, read_input_text, reason, save_figure, toml_loads
from sim.gcpause import collect_frozen
from sim.inputs.scenario import load_scenario, override_path, parse_override
from sim.model import trust
from sim.stats.metrics import summarize


class ValidationError(ServesimError):
    """A points file or one of its rows that cannot be read or reproduced."""


# --- what a metric column says --------------------------------------------------------------------
@dataclass(frozen=True)
class Metric:
    """A published metric: `quantity` (ttft, tpot, itl, e2e, output_tps, total_tps, input_tps,
    request_tps, user_tps), its statistic over requests (mean, p50, p90, ...), whether it is per
    GPU, and the factor from servesim's unit (s, or per s) to the published one."""

    quantity: str
    stat: str = "mean"
    per_gpu: bool = False
    scale: float = 1.0

    @property
    def is_latency(self) -> bool:
        return self.quantity in ("ttft", "tpot", "itl", "e2e")


_LATENCY = [  # checked in this order: the first match names the quantity
    ("ttft", r"ttft|time[ -]to[ -]first|first[ -]token|1st[ -]token"),
    ("tpot", r"tpot|time[ -]per[ -]output[ -]token|per[ -]output[ -]token|ms/tok"),
    ("itl", r"\bitl\b|inter[ -]?token"),
    ("e2e", r"e2e|end[ -]to[ -]end|request latency|\blatency\b"),
]
_RATE = r"tok(en)?s?\s*/\s*s|tokens?\s+per\s+s(ec(ond)?)?|throughput|req(uest)?s?\s*/\s*s"


def parse_metric(text: str) -> Metric:
    """The Metric a published metric's wording names. Raises ValueError naming what is
    missing (the quantity or the unit)."""
    t = text.lower().strip()
    per_gpu = bool(re.search(r"/\s*gpu|per[ -]gpu", t))
    if re.search(r"/\s*user|per[ -]user", t):
        return Metric("user_tps", "mean", per_gpu)
    for quantity, pattern in _LATENCY:
        if re.search(pattern, t) and not re.search(r"tok(en)?s?\s*/\s*s", t):
            stat = "mean"
            m = re.search(r"\bp(\d{2}(\.\d+)?)\b", t)
            if re.search(r"median|\bp50\b", t):
                stat = "p50"
            elif m:
                stat = f"p{m.group(1)}"
            elif re.search(r"\bmax(imum)?\b", t):
                stat = "max"
            if re.search(r"\(\s*ms\s*\)|\bms\b|millisec", t):
                scale = 1e3
            elif re.search(r"\(\s*(us|µs|μs)\s*\)|\b(us|µs|μs)\b|microsec", t):
                scale = 1e6
            elif re.search(r"\(\s*s\s*\)|\bs\b|\bsec(ond)?s?\b", t):
                scale = 1.0
            else:
                raise ValueError(f"{shown(text)}: no unit (ms, s or us)")
            return Metric(quantity, stat, per_gpu, scale)
    if re.search(_RATE, t):
        if re.search(r"req(uest)?s?\s*/\s*s|request throughput|requests per", t):
            return Metric("request_tps", "mean", per_gpu)
        if re.search(r"total|input\s*\+\s*output|prompt\s*\+", t):
            return Metric("total_tps", "mean", per_gpu)
        if re.search(r"\b(input|prompt|prefill)\b", t):
            return Metric("input_tps", "mean", per_gpu)
        return Metric("output_tps", "mean", per_gpu)
    raise ValueError(f"{shown(text)}: not a latency (TTFT, TPOT, ITL, E2E) or a throughput (tok/s)")


def metric_value(metric: Metric, summary: dict, tensor_parallel: int = 1) -> float:
    """The value a servesim summary (sim.stats.metrics.summarize) gives for `metric`, in the
    published unit."""
    if metric.is_latency:
        stats = summary[f"{metric.quantity}_ms"]
        v = stats.get(metric.stat)
        if v is None:
            raise ValueError(f"statistic {metric.stat!r} is not reported for {metric.quantity}")
        v = v / 1e3 * metric.scale
    elif metric.quantity == "user_tps":
        v = 1e3 / summary["tpot_ms"]["mean"]
    else:
        th = summary["throughput"]
        v = {"output_tps": th["output_tokens_per_s"], "total_tps": th["total_tokens_per_s"],
             "request_tps": th["requests_per_s"],
             "input_tps": th["total_tokens_per_s"] - th["output_tokens_per_s"]}[metric.quantity]
    if metric.per_gpu:
        v /= tensor_parallel
    return float(v)


# --- which engine profile a publication's engine column means -------------------------------------
def _version(text: str, after: str = "") -> tuple[int, ...] | None:
    """The first version number in `text`, or the first after the pattern `after` where it
    matches (the engine's own, not a library's before it: "CUDA 12.4, vLLM 0.5.3")."""
    m = re.search(after, text) if after else None
    rest = text[m.end():] if m else text
    m = re.search(r"\bv?(\d+)\.(\d+)(?:\.(\d+))?", rest)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


TRT_LLM = r"tensorrt[ _-]?llm|trt[ _-]?llm"  # TensorRT-LLM by its own name (its package: tensorrt_llm)
TRT_NAME = rf"{TRT_LLM}|tensorrt"  # how a publication names it (a bare "TensorRT" too)
# Its version: the one right after its own name
TRT_LLM_VERSION = re.compile(rf"(?:{TRT_LLM})\W{{0,3}}v?(\d+)\.(\d+)")
# Triton Inference Server (not OpenAI Triton's kernels)
TRITON = re.compile(r"tritonserver|triton[_ -]?(?:inference|server|backend)"
                    r"|\btriton\b(?![_ -]?(?:moe|kernels?|attention|compiled))")
# TensorRT-LLM's C++ runtime named: its TensorRT engines and backend, their benchmarks, or
# Triton's TensorRT-LLM backend, which drives that runtime
TRT_CPP = re.compile(r"c\+\+|\bcpp\b|backend\W*(?:tensorrt|trt)\b"
                     r"|\b(?:tensorrt|trt) (?:engine|backend)"
                     r"|trtllm-build|gpt(?:manager|session)benchmark|" + TRITON.pattern)
# A NIM's version: after its name and words such as "for LLMs" or "version", dotted unless
# "v", "version" or "release" says it is one ("NIM, 2 x H100" names none)
NIM_VERSION = re.compile(r"\bnim\b(?:[\s:,(-]+(?:for|llms?|large|language|models))*[\s:,(-]+"
                         r"(?:(?:v|version\W*|release\W*)(\d+)(?:\.(\d+))?|(\d+)\.(\d+))\b")


# vLLM's async scheduling named (`--async-scheduling`, `async_scheduling=True`, "async
# scheduling on"), and named off (`--no-async-scheduling`, "without --async-scheduling",
# `async_scheduling=False`, "async scheduling off")
ASYNC_ON = re.compile(r"async[-_ ]scheduling")
ASYNC_OFF = re.compile(r"no[-_ ]async|without\W+(?:--)?async|async[-_ ]scheduling\W{0,3}"
                       r"(?:off|false|0|disabled)\b")


def engine_preset_for(engine: str) -> str | None:
    """The engine profile for a publication's engine name and version, or None when it names
    none servesim has. The mapping (its one definition; sim/README.md's Validation restates it):

    TensorRT-LLM up to 0.6 -> tensorrt-llm-0.6 (its decode attention read K/V per query head);
    its PyTorch backend, or 1.0 and later (that backend its default) not naming its C++ runtime
    (TRT_CPP: its TensorRT engines or backend, or Triton's TensorRT-LLM backend, which drives it)
    -> tensorrt-llm-pytorch; 0.7 to 0.9 -> tensorrt-llm-0.9 (XQA for Llama 2 70B's shape only);
    0.10 to 0.x not naming the PyTorch backend, a 1.x naming its C++ runtime, or of no stated
    version -> tensorrt-llm (the version is the one right after TensorRT-LLM's name, not a
    TensorRT, CUDA or container version elsewhere). SGLang up to 0.3 ->
    sglang-0.3; later (its overlap scheduler) or of no stated version -> sglang. vLLM with
    multi-step scheduling (`--num-scheduler-steps`, "multi-step") -> vllm-0.6-multistep; vLLM
    V1, or 0.8 and later (V1 became the default): with async scheduling named off, or before
    0.14 (its default from then) not naming it on -> vllm-v1-sync; otherwise (0.14 and later, V1
    of no stated version, async scheduling named on) -> vllm-v1; 0.6 and 0.7, or the V0 engine
    (`VLLM_USE_V1=0`) -> vllm-0.6; up to 0.5 -> vllm-0.5; vLLM of no stated version -> vllm-v1.
    NVIDIA NIM naming neither vLLM nor SGLang: before 1.8 (the year-numbered first containers,
    24.05, among them), or of no stated version -> nim (its optimized profiles, those its
    benchmarks measure, are TensorRT-LLM engines, served with a serial host time in their loop:
    the sizing course's runs, taken as NIM 1.0; 1.1 to 1.7 are unmeasured and taken as 1.0);
    1.8 to 1.x -> tensorrt-llm, or tensorrt-llm-pytorch where it names TensorRT-LLM's PyTorch
    backend (NIM 1.8's measured runs keep no such time); 2.0 and later -> vllm-v1 (2.0's
    release notes name vLLM its sole backend; a NIM naming SGLang maps to sglang).
    """
    t = engine.lower()
    if re.search(r"\bnim\b", t) and not re.search(r"vllm|sglang", t):
        m = NIM_VERSION.search(t)  # (groups 1-2 or 3-4: the version marked, or dotted)
        v = (int(m.group(1) or m.group(3)), int(m.group(2) or m.group(4) or 0)) if m else None
        if v is None or v < (1, 8) or v[0] >= 24:
            return "nim"
        if v[0] >= 2:
            return "vllm-v1"
        return "tensorrt-llm-pytorch" if "pytorch" in t else "tensorrt-llm"
    if re.search(TRT_NAME, t):
        m = TRT_LLM_VERSION.search(t)
        v = (int(m.group(1)), int(m.group(2))) if m else None
        if "pytorch" in t or (v is not None and v[0] >= 1 and not TRT_CPP.search(t)):
            return "tensorrt-llm-pytorch"
        if v is not None and v[:2] <= (0, 6):
            return "tensorrt-llm-0.6"
        return "tensorrt-llm-0.9" if v is not None and v[:2] <= (0, 9) else "tensorrt-llm"
    if "sglang" in t:
        v = _version(t, "sglang")
        return "sglang-0.3" if v is not None and v[:2] <= (0, 3) else "sglang"
    if "vllm" in t:
        if re.search(r"scheduler[ -]steps|multi[ -]?step", t):
            return "vllm-0.6-multistep"
        # the V0 engine of 0.6-0.10 ("V0", not a version: "v0.11.0" is V1's)
        if re.search(r"\bv0\b(?!\.\d)|vllm_use_v1=0", t):
            return "vllm-0.6"
        v = _version(t, "vllm")
        if re.search(r"\bv1\b|vllm_use_v1", t) or v is None or v[:2] >= (0, 8):
            # V1 schedules in series where async scheduling is off: said so, or by default
            # before 0.14 unless said on
            if ASYNC_OFF.search(t) or (v is not None and v[:2] < (0, 14)
                                       and not ASYNC_ON.search(t)):
                return "vllm-v1-sync"
            return "vllm-v1"
        return "vllm-0.5" if v[:2] <= (0, 5) else "vllm-0.6"
    return None


# --- points files ---------------------------------------------------------------------------------
@dataclass
class Point:
    """One published measurement and the scenario that reproduces it."""

    id: str
    engine: str
    config: str
    metric_text: str
    metric: Metric
    published: float
    regime: str
    source: str
    use: str
    scenario_path: Path
    line: int
    origin: str  # the points file
    extra: dict = field(default_factory=dict)
    # The row's own changes to its scenario (the `set` column: SECTION.KEY=VALUE, separated by
    # ";"), applied before any the command line gives: rows of one table share one scenario.
    overrides: list[str] = field(default_factory=list)


REQUIRED = ("id", "engine", "metric", "published")
# The `set` column's entries: SECTION.KEY=VALUE, each `;` followed by a key and `=` starting the
# next (a `;` inside a quoted value stays in it unless a key and `=` follow it).
_SET_SPLIT = re.compile(r";(?=\s*[A-Za-z_][\w.]*\s*=)")
# The least published figure taken (ms, tokens/s or requests/s): a prediction is divided by it,
# and a subnormal one (1e-320) would make every ratio infinite.
MIN_PUBLISHED = 1e-9


def points_file(spec: str | Path) -> Path:
    """The CSV a points argument names: a CSV file, or a folder holding `published.csv`."""
    p = Path(spec).expanduser()
    if p.is_dir():
        for name in ("published.csv", "points.csv"):
            if (p / name).is_file():
                return p / name
        raise ValidationError(f"{p}: no published.csv in this folder")
    if not p.is_file():
        raise ValidationError(f"{p}: no such file or folder")
    return p


def load_points(spec: str | Path) -> list[Point]:
    """Every row of a points file, checked. Raises ValidationError naming the file, line and
    field of the first bad row."""
    path = points_file(spec)
    try:
        text = read_input_text(path, encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ValidationError(f"{path}: cannot read: {reason(e)}") from None
    header, rows = csv_rows(path, text, ValidationError)
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise ValidationError(f"{path}:1: missing column(s) {', '.join(missing)} "
                              f"(need {', '.join(REQUIRED)})")
    out, seen = [], set()
    for line, row in rows:
        pid = row["id"]
        if not pid:
            raise ValidationError(f"{path}:{line}: id: empty")
        if pid in seen:
            raise ValidationError(f"{path}:{line}: id: {shown(pid)} appears twice")
        seen.add(pid)
        try:
            metric = parse_metric(row["metric"])
        except ValueError as e:
            raise ValidationError(f"{path}:{line}: metric: {e}") from None
        try:
            value = float(row["published"].replace(",", ""))
        except ValueError:
            raise ValidationError(f"{path}:{line}: published: {shown(row['published'])} is not "
                                  "a number") from None
        if not (math.isfinite(value) and MIN_PUBLISHED <= value):
            raise ValidationError(f"{path}:{line}: published: {shown(row['published'])} must be "
                                  f"a positive number of at least {MIN_PUBLISHED:g}")
        use = row.get("use", "") or "validate"
        if use not in ("fit", "holdout", "validate"):
            raise ValidationError(f"{path}:{line}: use: {shown(use)}: expected fit or holdout")
        sc = row.get("scenario") or f"scenarios/{pid}.toml"
        sc_path = Path(sc) if Path(sc).is_absolute() else path.parent / sc
        if not sc_path.is_file():
            raise ValidationError(f"{path}:{line}: scenario: {sc_path} not found (one scenario "
                                  "per row: the scenario column, or scenarios/<id>.toml)")
        sets = []
        for text in _SET_SPLIT.split((row.get("set") or "").strip().rstrip(";")):
            text = text.strip()
            if not text:
                continue
            try:
                parts, given = parse_override(text, "set")
            except ServesimError as e:
                raise ValidationError(f"{path}:{line}: {e}") from None
            # (a relative path names a file from the points file's folder)
            resolved = override_path(parts, given, path.parent)
            if resolved != given:
                text = f"{'.'.join(parts)}={json.dumps(resolved)}"  # (a TOML string too)
            sets.append(text)
        out.append(Point(pid, row["engine"], row.get("config", ""), row["metric"], metric, value,
                         row.get("regime", "") or "-", row.get("source", ""), use, sc_path, line,
                         str(path), overrides=sets))
    if not out:
        raise ValidationError(f"{path}: no rows")
    return out


# TensorRT-LLM's programs, and a column's words on chunking (turned off first: "enable_chunked_
# prefill: false" says off)
TRT_BENCH = re.compile(r"trtllm[_ -]bench")
TRT_SERVE = re.compile(r"trtllm[_ -]serve")
CHUNKING_OFF = re.compile(r"disable[_ -]chunked|\bnon?[_ -]?(?:enable[_ -])?chunked"
                          r"|chunked[\w -]{0,20}?\b(?:off|disabled|false)\b"
                          r"|enable[_ -]chunked[_ -](?:prefill|context)\W{0,3}[=:]\s*false")
CHUNKING_ON = re.compile(r"enable[_ -]chunked[_ -](?:prefill|context)"
                         r"|chunked[\w -]{0,20}?\b(?:on|enabled|true)\b")


def profile_settings(profile: str | None) -> list[str]:
    """What a profile asks of the scenario beyond `[engine]`: `vllm-v1-sync`, that release's
    scheduler (without async scheduling a finished request frees its blocks and seat at once)."""
    return ["scheduler.async_scheduling=false"] if profile == "vllm-v1-sync" else []


def engine_settings_for(engine: str) -> list[str]:
    """What a publication's engine column says of the engine beyond its profile, as overrides.
    Whether TensorRT-LLM chunks its prompts is the program's default, not the runtime's, so a
    row naming one of its programs sets it on either profile: `trtllm-bench` chunks
    (`--enable_chunked_context/--disable_chunked_context`, on by default), where the C++
    runtime's profile, as its executor and Triton's backend, does not; `trtllm-serve` computes
    a prompt whole (its LLM API's `enable_chunked_prefill` default), where the PyTorch backend's
    profile chunks. What the column says of chunking (`--enable_chunked_prefill`,
    `--disable_chunked_context`, "chunked context off", ...) overrides the program's default; a
    row naming both programs, or neither, keeps its profile's. (Computed whole, a prompt as long
    as the step's token budget waits until no decode is left beside it: every request of a
    2,048/2,048 table under a 2,048-token budget would run alone.) A TensorRT-LLM row served
    through Triton's TensorRT-LLM backend (Triton named beside TensorRT-LLM) takes that server's
    API terms (`presets.TRITON_FRONTEND`), which the profiles, also driven without a server
    (`trtllm-bench`, NIM's own), leave out, and over the C++ executor (`tensorrt-llm`) its
    serial host time per sequence (`presets.TRITON_HOST`). A vLLM V1 row scheduling in series
    (`vllm-v1-sync`) has the scheduler of that release too: without async scheduling, a
    finished request gives its blocks and seat back at once."""
    t = engine.lower()
    out = []
    # (not a NIM's: its profile's serial host time was fitted on runs through its own server)
    profile = engine_preset_for(engine)
    if re.search(TRT_NAME, t) and TRITON.search(t) and profile != "nim":
        terms = presets.TRITON_FRONTEND | (presets.TRITON_HOST if profile == "tensorrt-llm" else {})
        out += [f"engine.{k}={json.dumps(v)}" for k, v in terms.items()]
    out += profile_settings(profile)
    bench, serve = TRT_BENCH.search(t) is not None, TRT_SERVE.search(t) is not None
    if not (bench or serve):
        return out
    if serve and not bench:  # (its LLM API captures CUDA graphs without padding to them)
        out.append("engine.cuda_graph_padding=false")
    if CHUNKING_OFF.search(t):
        return out + ["engine.chunked_prefill=false"]
    if CHUNKING_ON.search(t):
        return out + ["engine.chunked_prefill=true"]
    if bench == serve:
        return out
    return out + [f"engine.chunked_prefill={'true' if bench else 'false'}"]


def point_scenario(point: Point, engine: str | None = None, overrides: list[str] | None = None):
    """The point's scenario, with `engine` (a profile name) as its engine, and what that
    profile asks of the scenario (`profile_settings`), unless the scenario names one; else the
    profile its engine column maps to, and what else the column says of the engine
    (`engine_settings_for`). Raises ServesimError."""
    import tomllib

    try:
        raw = toml_loads(point.scenario_path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        raw = {}  # load_scenario reports it
    named = isinstance(raw.get("engine"), dict) and "preset" in raw["engine"]
    preset = engine or (None if named else engine_preset_for(point.engine))
    head = [f'engine.preset="{preset}"'] if preset is not None else []
    if not (engine or named):
        head += engine_settings_for(point.engine)
    elif engine:
        head += profile_settings(engine)
    given = list(overrides or [])
    try:
        return load_scenario(str(point.scenario_path), [*head, *point.overrides, *given])
    except ServesimError as e:
        if point.overrides:  # the row's own fields, when its scenario loads without them
            load_scenario(str(point.scenario_path), [*head, *given])
            raise ServesimError(f"set: {e}") from None
        raise


# --- summaries --------------------------------------------------------------------------------------
def error_stats(ratios) -> dict:
    """Median and worst |ratio - 1| of predicted / published ratios."""
    e = np.abs(np.asarray(ratios, dtype=np.float64) - 1.0)
    if not len(e):
        return {"count": 0, "median_abs_error": None, "worst_abs_error": None}
    return {"count": int(len(e)), "median_abs_error": float(np.median(e)),
            "worst_abs_error": float(e.max())}


# --- running points ---------------------------------------------------------------------------------
def simulate(scenario) -> dict:
    """Run `scenario` (one engine or a deployment) and return its summary
    (sim.stats.metrics.summarize). Raises ServesimError."""
    eng = build(scenario, record_events=False)
    eng.run()
    out = summarize(eng)
    del eng
    collect_frozen()  # (validate and its fit run every point in this process)
    return out


def run_point(point: Point, engine: str | None = None,
              overrides: list[str] | None = None) -> dict:
    """Simulate one point. Returns its result row (predicted, ratio, the engine profile used).
    Raises ServesimError naming the point when its scenario cannot run."""

    try:
        sc = point_scenario(point, engine, overrides)
        run = simulate(sc)
        predicted = metric_value(point.metric, run, sc.model.tensor_parallel)
    except ServesimError as e:
        raise ValidationError(f"{point.origin}:{point.line}: {point.id}: {e}") from None
    except (KeyError, ValueError) as e:
        raise ValidationError(f"{point.origin}:{point.line}: {point.id}: metric "
                              f"{point.metric_text!r}: {e}") from None
    return {"id": point.id, "engine": point.engine, "profile": sc.engine.preset,
            "metric": point.metric_text, "published": point.published,
            "predicted": predicted, "ratio": predicted / point.published,
            "regime": point.regime, "trust_regime": trust.regime(point.metric.quantity, run),
            "setup": trust.setup(sc), "use": point.use, "source": point.source}


def summary(results: list[dict]) -> dict:
    """Median and worst |ratio - 1| over all rows, per `use` and per regime."""
    out = {"all": error_stats([r["ratio"] for r in results]), "use": {}, "regimes": {}}
    for key, field_ in (("use", "use"), ("regimes", "regime")):
        for name in dict.fromkeys(r[field_] for r in results):
            out[key][name] = error_stats([r["ratio"] for r in results if r[field_] == name])
    return out


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def format_report(results: list[dict], stats: dict) -> str:
    """The table `servesim validate` prints."""
    w_id = max(4, *(len(r["id"]) for r in results))
    w_pr = max(7, *(len(r["profile"]) for r in results))
    w_me = min(34, max(6, *(len(r["metric"]) for r in results)))
    lines = [f"{'id':<{w_id}}  {'profile':<{w_pr}}  {'metric':<{w_me}}  {'published':>10}  "
             f"{'predicted':>10}  {'ratio':>6}  use"]
    for r in results:
        lines.append(f"{r['id']:<{w_id}}  {r['profile']:<{w_pr}}  {r['metric'][:w_me]:<{w_me}}  "
                     f"{_fmt(r['published']):>10}  {_fmt(r['predicted']):>10}  "
                     f"{r['ratio']:>6.3f}  {r['use']}")
    w_re = max(10, *(len(k) for k in stats["regimes"]))
    lines += ["", f"{'regime':<{w_re}}  {'rows':>4}  {'median |err|':>12}  {'worst |err|':>11}"]

    def row(name, s):
        return (f"{name:<{w_re}}  {s['count']:>4}  {s['median_abs_error']:>12.3f}  "
                f"{s['worst_abs_error']:>11.3f}")

    for name, s in stats["regimes"].items():
        lines.append(row(name, s))
    lines.append("")
    for name, s in stats["use"].items():
        lines.append(row(f"use = {name}", s))
    lines.append(row("all", stats["all"]))
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """Predicted against published, log-log, with the y = x line, one colour per regime; PNG
    or SVG by the file's suffix. Raises ValidationError when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValidationError("--plot needs matplotlib: pip install 'servesim[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 7))
    for regime in dict.fromkeys(r["regime"] for r in results):
        pts = [r for r in results if r["regime"] == regime]
        ax.scatter([r["published"] for r in pts], [r["predicted"] for r in pts], label=regime,
                   s=24, marker="o" if pts[0]["use"] != "holdout" else "^")
    lo = min(min(r["published"], r["predicted"]) for r in results) / 1.5
    hi = max(max(r["published"], r["predicted"]) for r in results) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="y = x")
    ax.plot([lo, hi], [lo * 1.3, hi * 1.3], color="grey", linewidth=0.5, linestyle="--")
    ax.plot([lo, hi], [lo / 1.3, hi / 1.3], color="grey", linewidth=0.5, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("published (ms or tokens/s)")
    ax.set_ylabel("servesim (same unit)")
    ax.set_title("servesim validate: predicted against published (dashed: ±30%)")
    ax.legend(fontsize=7, loc="upper left")

    try:
        save_figure(fig, path, bbox_inches="tight")
    except (OSError, ValueError) as e:
        raise ValidationError(f"--plot {path}: cannot write: {e}") from None
    finally:
        plt.close(fig)
