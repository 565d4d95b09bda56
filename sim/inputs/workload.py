"""Workloads: the requests of a run, materialized before it starts so that every policy sees the
same trace (in a closed loop, `workload.concurrency`, the rows only: the users time them as
requests end, sim.engine.users).

Arrivals come from a process (Poisson, gamma, constant, or a batch at t = 0) or from a trace's
timestamps; prompt and output lengths from a fixed number, a distribution, or an empirical length
file. Traces are read from the Azure 2023 CSV, the Mooncake JSONL (whose `hash_ids` are kept for
prefix caching) and length-pairs CSVs. Each random draw uses its own seeded stream, so changing one knob (say the
cancellation fraction) does not reshuffle the others.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import functools
import io
import json
import math
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.errors import ScenarioError, TraceError
from sim.fileio import json_loads, open_input
from sim.limits import (BYTES_PER_REQUEST, BYTES_PER_STEP, INT64_MAX, MAX_TIME_S, MAX_TOKENS,
                        check_memory)

# Seed-stream ids: one per kind of draw.
_ARRIVAL, _PROMPT, _OUTPUT, _CANCEL, _CANCEL_DELAY, _PRIORITY, _PAIRS, _PREFIX, _CLIENT = range(9)


@dataclass
class Trace:
    """Columns read from a trace or length file. `timestamps` is None for length-only files."""

    path: str
    timestamps: np.ndarray | None  # seconds from the first request
    prompt: np.ndarray
    output: np.ndarray
    hash_ids: list[tuple[int, ...]] | None
    hash_block_size: int = 512


@dataclass
class Workload:
    """The materialized requests, sorted by arrival time."""

    arrival: np.ndarray      # float64 seconds
    prompt: np.ndarray       # int64 tokens
    output: np.ndarray       # int64 tokens
    priority: np.ndarray     # int64, lower is more urgent
    cancel_at: np.ndarray    # float64 seconds, NaN = never
    hash_ids: list[tuple[int, ...]] | None = None
    hash_block_size: int = 512
    # Synthetic shared system prompts: request i starts with the `prefix_tokens` tokens of
    # system prompt `prefix_group[i]` (-1: none).
    prefix_group: np.ndarray | None = None
    prefix_tokens: int = 0
    # A client mix (`workload.clients`): each request's client, an index into that list.
    client: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def total_output_tokens(self) -> int:
        return int(self.output.sum())


# --- trace files ---------------------------------------------------------------------------------
def _parse_clock(ts: str) -> tuple[int, float]:
    """`2023-11-16 18:15:46.6805900` -> (day ordinal, seconds since midnight).
    Raises ValueError on anything else (a second that is not a finite number in [0, 61))."""
    date, _, clock = ts.strip().partition(" ")
    h, m, s = clock.split(":")
    y, mo, d = date.split("-")
    sec = float(s)
    if not 0 <= sec < 61 or not 0 <= int(h) < 24 or not 0 <= int(m) < 60:
        raise ValueError(ts)
    return _dt.date(int(y), int(mo), int(d)).toordinal(), int(h) * 3600 + int(m) * 60 + sec


def _int_field(path: Path, line: int, name: str, text) -> int:
    """A token count of a trace row: a finite, non-negative number up to MAX_TOKENS."""
    try:
        v = float(text)
    except (TypeError, ValueError, OverflowError):
        raise TraceError(f"{path}:{line}: {name} = {str(text)[:40]!r} is not a number") from None
    if not math.isfinite(v):
        raise TraceError(f"{path}:{line}: {name} = {text!r} is not a finite number")
    if v < 0:
        raise TraceError(f"{path}:{line}: {name} = {text!r} is negative")
    if v > MAX_TOKENS:
        raise TraceError(f"{path}:{line}: {name} = {text!r} is more than {MAX_TOKENS:,} tokens")
    return int(v)


# Traces are read whole into memory; past this a file is not one servesim reads.
MAX_TRACE_BYTES = 1 << 30


def _read_text(path: Path) -> str:
    """A trace file's text. Raises TraceError naming the file (and the line) when it is a
    directory or a device, unreadable, over MAX_TRACE_BYTES, or binary (a NUL byte or bytes
    that are not UTF-8), found within the first megabyte of the damage."""
    try:
        if stat.S_ISDIR(path.stat().st_mode):
            raise TraceError(f"{path}: is a directory, not a trace file")
        if not stat.S_ISREG(path.stat().st_mode) and not stat.S_ISFIFO(path.stat().st_mode):
            raise TraceError(f"{path}: not a regular file (a device?), not a trace file")
        chunks, size = [], 0
        with open_input(path) as fh:
            while chunk := fh.read(1 << 20):
                if b"\0" in chunk:  # a binary file (or /dev/zero): stop at once
                    data = b"".join(chunks) + chunk
                    line = data[:data.index(b"\0")].count(b"\n") + 1
                    raise TraceError(f"{path}:{line}: a NUL byte: a binary file, not a trace")
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_TRACE_BYTES:
                    raise TraceError(f"{path}: larger than {MAX_TRACE_BYTES >> 20} MiB, more "
                                     "than a trace servesim reads")
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    data = b"".join(chunks)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise TraceError(f"{path}:{line}: not UTF-8 text (byte {e.start}): a binary file, "
                         "not a trace") from None


@functools.lru_cache(maxsize=16)
def _read_trace_cached(path: str, mtime: float) -> Trace:
    p = Path(path)
    if p.suffix == ".jsonl":
        return _read_mooncake(p)
    return _read_csv(p)


def read_trace(path: Path) -> Trace:
    """Read a trace or length file, cached by path and modification time.

    Raises TraceError naming the file (and line) on a missing, unreadable or binary file or a
    malformed row (lengths must be finite, 0 to MAX_TOKENS; times finite, 0 to MAX_TIME_S).
    """
    try:
        mtime = path.stat().st_mtime
    except (OSError, ValueError):
        raise TraceError(f"{path}: trace file not found") from None
    return _read_trace_cached(str(path), mtime)


def _read_csv(path: Path) -> Trace:
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
    try:
        return _parse_csv(path, reader)
    except csv.Error as e:
        raise TraceError(f"{path}:{reader.line_num}: not CSV: {e}") from None


def _parse_csv(path: Path, reader) -> Trace:
    header = next(reader, None)
    if not header:
        raise TraceError(f"{path}:1: empty file")
    cols = [h.strip() for h in header]
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(cols):
        kind = "azure"
        it, ip, io_ = (cols.index(c) for c in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    elif {"num_prefill_tokens", "num_decode_tokens"} <= set(cols):
        kind = "pairs"
        it, ip, io_ = -1, cols.index("num_prefill_tokens"), cols.index("num_decode_tokens")
    else:
        raise TraceError(
            f"{path}:1: unknown columns {cols}; expected TIMESTAMP,ContextTokens,"
            "GeneratedTokens (Azure) or num_prefill_tokens,num_decode_tokens (length pairs)"
        )
    ts, pr, out, lines = [], [], [], []
    for row in reader:
        line = reader.line_num  # (a quoted field can span lines: the reader's count, not ours)
        if not row:
            continue
        if len(row) < len(cols):
            raise TraceError(f"{path}:{line}: expected {len(cols)} fields, got {len(row)}")
        if kind == "azure":
            try:
                ts.append(_parse_clock(row[it]))
                lines.append(line)
            except (ValueError, IndexError):
                raise TraceError(f"{path}:{line}: TIMESTAMP = {row[it]!r} is not a "
                                 "'YYYY-MM-DD HH:MM:SS.f' time") from None
        pr.append(_int_field(path, line, cols[ip], row[ip]))
        out.append(_int_field(path, line, cols[io_], row[io_]))
    if not pr:
        raise TraceError(f"{path}: no rows")
    stamps = None
    if ts:
        days = np.asarray([d for d, _ in ts], dtype=np.int64)
        secs = np.asarray([x for _, x in ts])
        # Relative to the first day before going to float, to keep sub-millisecond precision.
        stamps = (days - days.min()) * 86400.0 + secs
        stamps = stamps - stamps.min()
        if stamps.max() > MAX_TIME_S:
            line = lines[int(stamps.argmax())]
            raise TraceError(f"{path}:{line}: TIMESTAMP lies {stamps.max():.3g} s after the "
                             f"first: more than {MAX_TIME_S:g} s")
    return Trace(str(path), stamps, np.asarray(pr, dtype=np.int64),
                 np.asarray(out, dtype=np.int64), None)


def _read_mooncake(path: Path) -> Trace:
    ts, pr, out, hashes = [], [], [], []
    for line, text in enumerate(_read_text(path).split("\n"), start=1):
        if not text.strip():
            continue
        try:
            rec = json_loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{line}: not JSON: {e.msg}") from None
        if not isinstance(rec, dict):
            raise TraceError(f"{path}:{line}: expected a JSON object, got {text.strip()[:40]!r}")
        for name in ("timestamp", "input_length", "output_length"):
            v = rec.get(name)
            if name not in rec:
                raise TraceError(f"{path}:{line}: missing field {name!r}")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TraceError(f"{path}:{line}: {name} = {v!r} is not a number")
        t = rec["timestamp"]  # milliseconds
        if not 0 <= t <= MAX_TIME_S * 1000:  # (NaN fails too)
            raise TraceError(f"{path}:{line}: timestamp = {t!r} is not a time from 0 to "
                             f"{MAX_TIME_S * 1000:g} ms")
        h = rec.get("hash_ids", [])
        if not isinstance(h, list) or not all(
                type(x) is int and -INT64_MAX - 1 <= x <= INT64_MAX for x in h):
            raise TraceError(f"{path}:{line}: hash_ids must be a list of 64-bit integers")
        ts.append(t / 1000.0)
        pr.append(_int_field(path, line, "input_length", rec["input_length"]))
        out.append(_int_field(path, line, "output_length", rec["output_length"]))
        hashes.append(tuple(h))
    if not pr:
        raise TraceError(f"{path}: no rows")
    stamps = np.asarray(ts, dtype=np.float64)
    return Trace(str(path), stamps - stamps.min(), np.asarray(pr, dtype=np.int64),
                 np.asarray(out, dtype=np.int64), hashes)


# --- distributions -------------------------------------------------------------------------------
def _rng(seed: int, stream: int, *more: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, *more])


def _empirical_column(scenario, spec: dict, field: str) -> np.ndarray:
    trace = read_trace(scenario.resolve_path(spec["file"]))
    col = spec.get("column")
    names = {"num_prefill_tokens": trace.prompt, "ContextTokens": trace.prompt,
             "input_length": trace.prompt, "num_decode_tokens": trace.output,
             "GeneratedTokens": trace.output, "output_length": trace.output}
    if col is None:
        column = trace.prompt if field == "prompt_tokens" else trace.output
    elif col not in names:
        raise ScenarioError(f"{scenario.source}: workload.{field}.column = {col!r}: expected one "
                            f"of {', '.join(names)}")
    else:
        column = names[col]
    keep = _kept_rows(scenario, spec, field, trace)
    return column if keep is None else column[keep]


# An empirical table's row filters, as `vllm bench serve` filters ShareGPT's conversations
# (`is_valid_sequence` in vllm/benchmarks/datasets.py: min_len 4, max_prompt_len 1,024,
# max_total_len 2,048).
ROW_FILTERS = ("min_len", "max_prompt_len", "max_total_len")


def _kept_rows(scenario, spec: dict, field: str, trace: Trace) -> np.ndarray | None:
    """The rows of a length file an empirical table keeps: prompt and output at least
    `min_len`, the prompt at most `max_prompt_len`, both together at most `max_total_len`;
    None without filters. Raises ScenarioError when they keep none."""
    if not any(k in spec for k in ROW_FILTERS):
        return None
    p, o = trace.prompt, trace.output
    keep = np.ones(len(p), dtype=bool)
    if "min_len" in spec:
        keep &= (p >= spec["min_len"]) & (o >= spec["min_len"])
    if "max_prompt_len" in spec:
        keep &= p <= spec["max_prompt_len"]
    if "max_total_len" in spec:
        keep &= p + o <= spec["max_total_len"]
    if not keep.any():
        given = ", ".join(k for k in ROW_FILTERS if k in spec)
        raise ScenarioError(f"{scenario.source}: workload.{field}: {given} keep none of the "
                            f"{len(p):,} rows of {spec['file']}")
    return keep


def sample(scenario, field: str, n: int, rng: np.random.Generator, *,
           integer: bool = True, index: np.ndarray | None = None, spec=None) -> np.ndarray:
    """Draw `n` values of the distribution in `workload.<field>` (or `spec`, a client's).

    `index` picks rows of an empirical file instead of drawing them, so that prompt and output
    lengths read from the same file stay paired.
    """
    if spec is None:
        spec = getattr(scenario.workload, field)
    if not isinstance(spec, dict):
        spec = {"dist": "fixed", "value": spec}
    d = spec["dist"]
    if d == "fixed":
        x = np.full(n, float(spec["value"]))
    elif d == "uniform":
        lo, hi = float(spec["min"]), float(spec["max"])
        x = (rng.integers(int(lo), int(hi) + 1, size=n).astype(float) if integer
             else rng.uniform(lo, hi, size=n))
    elif d == "lognormal":
        mean, cv = float(spec["mean"]), float(spec.get("cv", 1.0))
        sigma2 = math.log1p(cv * cv)
        x = rng.lognormal(math.log(max(mean, 1e-12)) - sigma2 / 2, math.sqrt(sigma2), size=n)
    elif d == "normal":
        x = rng.normal(float(spec["mean"]), float(spec["std"]), size=n)
    elif d == "exponential":
        x = rng.exponential(float(spec["mean"]), size=n)
    elif d == "empirical":
        col = _empirical_column(scenario, spec, field)
        idx = index if index is not None else rng.integers(0, len(col), size=n)
        x = col[idx].astype(float)
    elif d == "random":  # vllm bench serve's random dataset (its --random-range-ratio)
        lo, hi = random_bounds(spec)
        x = (rng.integers(lo, hi + 1, size=n).astype(float) if integer
             else rng.uniform(lo, hi, size=n))
    elif d == "choice":
        vals = np.asarray(spec["values"], dtype=float)
        w = np.asarray(spec.get("weights", [1.0] * len(vals)), dtype=float)
        if w.sum() <= 0:
            raise ScenarioError(f"{scenario.source}: workload.{field}.weights must not all be 0")
        x = rng.choice(vals, size=n, p=w / w.sum())
    else:  # _check_dist makes this unreachable
        raise ScenarioError(f"{scenario.source}: workload.{field}.dist = {d!r}")
    if "min" in spec and d != "uniform":
        x = np.maximum(x, float(spec["min"]))
    if "max" in spec and d != "uniform":
        x = np.minimum(x, float(spec["max"]))
    # Within the field's own bounds whatever the spread (a wide lognormal overflows to inf),
    # so that every draw converts to int64 and stays a length, delay or priority.
    top = _field_max(type(scenario.workload), field)
    x = np.clip(np.nan_to_num(x, nan=0.0, posinf=top, neginf=0.0), 0.0, top)
    if integer:
        x = np.rint(x).astype(np.int64)
    return x


def random_bounds(spec: dict) -> tuple[int, int]:
    """The lengths a `{dist = "random"}` table draws from, both included: as `vllm bench serve
    --dataset-name random`, floor(value (1 - range_ratio)) to ceil(value (1 + range_ratio))."""
    v, r = float(spec["value"]), float(spec.get("range_ratio", 0.0))
    return math.floor(v * (1 - r)), math.ceil(v * (1 + r))


@functools.cache
def _field_max(config: type, field: str) -> float:
    """The schema's upper bound of a distribution field of `[workload]` (`config`, the
    section's dataclass)."""
    f = {f.name: f for f in dataclasses.fields(config)}[field]
    return float(f.metadata.get("max") or INT64_MAX)


def _paired_rows(scenario, p_spec=None, o_spec=None) -> int | None:
    """Rows of the one empirical file both lengths come from (so they stay paired), or None.
    (`p_spec`, `o_spec`: a client's own distributions, else the workload's.)"""
    if p_spec is None:
        p_spec, o_spec = scenario.workload.prompt_tokens, scenario.workload.output_tokens
    if (isinstance(p_spec, dict) and isinstance(o_spec, dict)
            and p_spec.get("dist") == o_spec.get("dist") == "empirical"
            and p_spec.get("file") == o_spec.get("file")
            and all(p_spec.get(k) == o_spec.get(k) for k in ROW_FILTERS)):
        return len(_empirical_column(scenario, p_spec, "prompt_tokens"))
    return None


def sample_lengths(scenario, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`n` (prompt, output) length pairs from the scenario's workload: drawn from the same rows
    when both come from one empirical file, independently otherwise (live injections use it).
    With a trace arrival, lengths are drawn from the trace's rows."""
    w = scenario.workload
    if w.arrival == "trace":
        trace = read_trace(scenario.resolve_path(w.trace))
        idx = rng.integers(0, len(trace.prompt), size=n)
        return trace.prompt[idx], trace.output[idx]
    rows = _paired_rows(scenario)
    index = None if rows is None else rng.integers(0, rows, size=n)
    prompt = np.maximum(sample(scenario, "prompt_tokens", n, rng, index=index), 1)
    output = np.maximum(sample(scenario, "output_tokens", n, rng, index=index), 1)
    return prompt, output


def min_length(scenario, field: str) -> int:
    """The smallest length `workload.<field>` (or a client's, in a mix) can produce (at least
    1)."""
    w = scenario.workload
    if w.arrival == "trace":
        return 1
    return min(_min_of(scenario, spec, field) for spec in _specs(w, field))


def _specs(w, field: str) -> list:
    """The distributions `workload.<field>` is drawn from: the workload's, or each client's."""
    own = getattr(w, field)
    return [c.get(field, own) for c in w.clients] if w.clients else [own]


def _min_of(scenario, spec, field: str) -> int:
    if not isinstance(spec, dict):
        return max(1, int(round(spec)))
    d = spec["dist"]
    if d == "fixed":
        return max(1, int(round(spec["value"])))
    if d == "uniform":
        return max(1, int(spec["min"]))
    if d == "random":
        return max(1, random_bounds(spec)[0])
    if d == "empirical":
        col = _empirical_column(scenario, spec, field)
        return max(1, int(col.min()))
    if d == "choice":
        return max(1, int(min(spec["values"])))
    return max(1, int(spec.get("min", 1)))


# --- arrivals ------------------------------------------------------------------------------------
def load_label(w) -> str:
    """What drives the arrivals of `[workload]` `w`, in a few words (a screen's header):
    `concurrency 8`, `4 req/s`, `trace`, `batch`."""
    if w.concurrency:
        return f"concurrency {w.concurrency:,}"
    if w.arrival == "trace":
        return "trace" if w.time_scale == 1 else f"trace x{w.time_scale:g}"
    if w.arrival == "batch":
        return "batch"
    return f"{w.rate:g} req/s"


def _num_draws(scenario) -> int:
    """How many arrivals a synthetic workload draws: `num_requests`, or enough to cover
    `duration_s` with a wide margin. Raises ScenarioError when those would not fit in memory
    (checked before anything is drawn)."""
    w = scenario.workload
    if w.num_requests:
        n, what = float(w.num_requests), f"workload.num_requests = {w.num_requests}"
    else:
        n = w.duration_s * w.rate * 1.5 + 10 * math.sqrt(w.duration_s * w.rate) + 16
        n *= max(1.0, w.cv)
        what = f"workload.rate = {w.rate:g} x duration_s = {w.duration_s:g}"
    shown = f"{n:,.0f}" if n < 1e15 else f"{n:.3g}"
    check_memory(f"{scenario.source}: {what}", n * BYTES_PER_REQUEST,
                 f" for {shown} requests drawn up front")
    return int(n)


def _arrivals(w, rng: np.random.Generator, n_max: int) -> np.ndarray:
    if w.arrival == "batch":  # a fixed batch: everything at t = 0 (offline benchmarks)
        return np.zeros(n_max)
    mean_gap = 1.0 / w.rate
    if w.arrival == "constant":
        gaps = np.full(n_max, mean_gap)
    elif w.arrival == "poisson":
        gaps = rng.exponential(mean_gap, size=n_max)
    else:  # gamma: shape k = 1/cv^2 keeps the mean gap at 1/rate
        k = 1.0 / (w.cv * w.cv)
        gaps = rng.gamma(k, mean_gap / k, size=n_max)
    return np.cumsum(gaps) - gaps[0]  # the first request arrives at t = 0


def _clients(scenario, n: int, prompt: np.ndarray, output: np.ndarray) -> np.ndarray | None:
    """A client mix: each request's client, drawn by share, and the lengths of the clients that
    give their own drawn into `prompt` and `output` in place (each client its own streams, so
    one client's change reshuffles no other's). None without a mix."""
    w, seed = scenario.workload, scenario.seed
    if not w.clients:
        return None
    shares = np.asarray([c.get("share", 1.0) for c in w.clients])
    client = _rng(seed, _CLIENT).choice(len(shares), size=n, p=shares / shares.sum())
    for k, c in enumerate(w.clients):
        rows = np.flatnonzero(client == k)
        p_spec, o_spec = c.get("prompt_tokens"), c.get("output_tokens")
        index = None
        if p_spec is not None and o_spec is not None:
            paired = _paired_rows(scenario, p_spec, o_spec)
            if paired is not None:
                index = _rng(seed, _PAIRS, k).integers(0, paired, size=len(rows))
        for col, spec, field, stream in ((prompt, p_spec, "prompt_tokens", _PROMPT),
                                         (output, o_spec, "output_tokens", _OUTPUT)):
            if spec is not None and len(rows):
                col[rows] = sample(scenario, field, len(rows), _rng(seed, stream, k),
                                   index=index, spec=spec)
    return client.astype(np.int64)


def repeat_trace(arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray,
                 times: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sorted trace played `times` times in a row: copy k arrives k trace periods later, the
    period being the span from first to last arrival plus the mean gap between arrivals (1 s
    for a trace of one request), so the copies keep the trace's own rate across the seams."""
    n = len(arrival)
    shifts = np.repeat(np.arange(times, dtype=np.float64) * trace_period(arrival), n)
    return np.tile(arrival, times) + shifts, np.tile(prompt, times), np.tile(output, times)


def trace_period(arrival: np.ndarray) -> float:
    """How much later each copy of a sorted trace starts when it is repeated (repeat_trace)."""
    n = len(arrival)
    span = float(arrival[-1] - arrival[0]) if n else 0.0
    return span + span / (n - 1) if n > 1 else 1.0


def _copies_needed(w, arrival: np.ndarray) -> int:
    """How many of the `workload.repeat` copies of a sorted trace can hold a request that
    `num_requests` and `duration_s` keep: only those are made."""
    n, times = len(arrival), w.repeat
    if not n:
        return 1
    if w.num_requests:
        times = min(times, -(-w.num_requests // n))
    if w.duration_s:
        period = trace_period(arrival)  # (0 when every request arrives at once)
        if period > 0:  # (one copy more than the division says: its rounding may differ from the cut's)
            times = min(times, max(1, math.floor((w.duration_s - float(arrival[0])) / period) + 2))
    return times


def build_workload(scenario) -> Workload:
    """Materialize the scenario's requests. Raises ScenarioError / TraceError."""
    w, seed = scenario.workload, scenario.seed
    hashes, hash_block = None, 512
    if w.arrival == "trace":
        trace = read_trace(scenario.resolve_path(w.trace))
        if trace.timestamps is None:
            raise ScenarioError(
                f"{scenario.source}: workload.trace = {w.trace!r} has no timestamps (a length "
                "file); use it as prompt_tokens = {dist = \"empirical\", file = ...} with a "
                "synthetic arrival process")
        order = np.argsort(trace.timestamps, kind="stable")
        arrival = trace.timestamps[order] * w.time_scale
        prompt, output = trace.prompt[order], trace.output[order]
        if trace.hash_ids is not None:
            hashes = [trace.hash_ids[i] for i in order]
            hash_block = trace.hash_block_size
        if w.repeat > 1:
            times = _copies_needed(w, arrival)
            check_memory(f"{scenario.source}: workload.repeat = {w.repeat:,}",
                         times * len(arrival) * BYTES_PER_REQUEST,
                         f" for {times:,} copies of the trace's {len(arrival):,} requests")
            arrival, prompt, output = repeat_trace(arrival, prompt, output, times)
            hashes = None if hashes is None else hashes * times
        keep = np.ones(len(arrival), dtype=bool)
        if w.duration_s:
            keep &= arrival < w.duration_s
        if w.num_requests:
            keep &= np.arange(len(arrival)) < w.num_requests
        arrival, prompt, output = arrival[keep], prompt[keep], output[keep]
        if hashes is not None:
            hashes = [h for h, k in zip(hashes, keep) if k]
    elif w.concurrency:  # closed loop: rows only; the users time them (sim.engine.users)
        check_memory(f"{scenario.source}: workload.num_requests = {w.num_requests}",
                     w.num_requests * BYTES_PER_REQUEST, f" for {w.num_requests:,} requests "
                     "drawn up front")
        arrival = np.zeros(w.num_requests)
    else:
        n = _num_draws(scenario)
        arrival = _arrivals(w, _rng(seed, _ARRIVAL), n)
        if w.duration_s:
            arrival = arrival[arrival < w.duration_s]
    if w.arrival != "trace":
        n = len(arrival)
        rows = _paired_rows(scenario)
        index = None if rows is None else _rng(seed, _PAIRS).integers(0, rows, size=n)
        prompt = sample(scenario, "prompt_tokens", n, _rng(seed, _PROMPT), index=index)
        output = sample(scenario, "output_tokens", n, _rng(seed, _OUTPUT), index=index)
    client = _clients(scenario, len(arrival), prompt, output)
    n = len(arrival)
    # (arrivals are sorted; NaN fails too. Half the clock's range is left to serve them in.)
    if n and not arrival[-1] <= MAX_TIME_S / 2:
        what = (f"workload.trace = {w.trace!r} x time_scale = {w.time_scale:g}" if w.arrival == "trace"
                else f"workload.rate = {w.rate:g}")
        raise ScenarioError(f"{scenario.source}: {what}: the last request would arrive at "
                            f"t = {arrival[-1]:.3g} s, past {MAX_TIME_S / 2:g} s (half the "
                            f"{MAX_TIME_S:g} s a simulated clock can hold)")
    check_memory(f"{scenario.source}: workload", n * BYTES_PER_REQUEST,
                 f" for its {n:,} requests")
    if n:  # the longest request alone takes a step per output token
        longest = int(output.max())
        check_memory(f"{scenario.source}: workload.output_tokens", longest * BYTES_PER_STEP,
                     f" for the per-step records of a request of {longest:,} output tokens")
    prompt = np.maximum(prompt, 1)
    output = np.maximum(output, 1)
    priority = sample(scenario, "priority", n, _rng(seed, _PRIORITY))
    for k, c in enumerate(w.clients if client is not None else ()):
        rows = np.flatnonzero(client == k)
        if "priority" in c and len(rows):
            priority[rows] = sample(scenario, "priority", len(rows), _rng(seed, _PRIORITY, k),
                                    spec=c["priority"])
    cancel_at = np.full(n, np.nan)
    if w.cancel_fraction > 0 and n:
        chosen = _rng(seed, _CANCEL).random(n) < w.cancel_fraction
        delay = sample(scenario, "cancel_after_s", n, _rng(seed, _CANCEL_DELAY), integer=False)
        cancel_at[chosen] = arrival[chosen] + np.maximum(delay[chosen], 0.0)
    group, shared = None, 0
    if w.shared_prefix_tokens and n:
        shared = w.shared_prefix_tokens
        rng = _rng(seed, _PREFIX)
        group = (rng.permutation(np.arange(n) % w.shared_prefix_groups)
                 if w.shared_prefix_balanced
                 else rng.integers(0, w.shared_prefix_groups, size=n))
        # the system prompt comes before the request's own tokens
        prompt = prompt + shared
    return Workload(arrival=arrival.astype(np.float64), prompt=prompt.astype(np.int64),
                    output=output.astype(np.int64), priority=priority.astype(np.int64),
                    cancel_at=cancel_at, hash_ids=hashes, hash_block_size=hash_block,
                    prefix_group=group, prefix_tokens=shared, client=client)
