"""How far to trust a predicted figure: the out-of-sample error of the service-time model in
the regime the figure comes from.

Each published point of `servesim validate` has an out-of-sample prediction: its leave-one-out
prediction when it is a `fit` row (the profiles fitted on every other row), the shipped
profiles' when it is a `holdout` row (never fitted). `servesim validate --fit --loo --trust FILE`
writes each point's regime and its ratio predicted / published; `scenarios/fidelity/trust.json`
is that file for the bundled points. A figure's interval is the spread, over the points of its
regime, of what the published value was relative to the prediction (published / predicted - 1):
the 10th to 90th percentile with ten or more points, else the whole range.

The regimes are classes of behaviour read from the run itself, so that a new scenario falls in
one as a published point does:

| regime | figure | the run |
|---|---|---|
| `throughput` | token or request throughput | any |
| `queued` | TTFT, E2E | the mean queue wait is at least half the mean TTFT |
| `first token` | TTFT | otherwise |
| `decode, small batch` | TPOT, ITL, E2E, tokens/s per user | mean running batch <= 16 |
| `decode, large batch` | the same | mean running batch > 16 |

The interval says how the model has done on runs like this one; it does not say whether any of
them ran on this run's GPU, model or engine. So the trust file also records each point's GPU,
model and engine profile (its `setup`, named as `validate --leave-out` names them: `GROUPS`),
and `coverage` counts the points that share each of the run's, separately, and all three
together: a GPU no published point ran on is predicted from its data sheet and profiles fitted
on other GPUs, and its intervals come from those.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from sim.errors import ServesimError
from sim.fileio import json_loads, read_input_text, reason

TRUST_FILE = Path(__file__).resolve().parents[2] / "scenarios" / "fidelity" / "trust.json"

REGIMES = ("first token", "queued", "decode, small batch", "decode, large batch", "throughput")
SMALL_BATCH = 16  # mean running requests at most this: a decode is weight-read bound
QUEUED_SHARE = 0.5  # the queue is at least this share of TTFT: the figure measures the queue
MIN_POINTS_FOR_PERCENTILES = 10

THROUGHPUTS = ("output_tps", "total_tps", "input_tps", "request_tps")

# A point's (or a scenario's) value of each key `validate --leave-out` can hold out together.
GROUPS = {
    # (a model read from a config.json is named by the file, which is a preset's name for the
    # bundled ones: Llama 3.1 8B is one model whether a row names its preset or its config)
    "model": lambda sc: (sc.model.preset or Path(sc.model.config).name.removesuffix(".json")
                         or f"{sc.model.num_params:.3g} parameters"),
    "hardware": lambda sc: sc.hardware.preset or f"{sc.hardware.mem_bandwidth_gbps:g} GB/s",
    "dtype": lambda sc: f"{sc.model.dtype_bytes}-byte weights",
    "tp": lambda sc: f"tensor_parallel {sc.model.tensor_parallel}",
    "engine": lambda sc: sc.engine.preset,
}
# A point's setup: the groups the trust file records for each point, and `coverage` counts.
SETUP = ("hardware", "model", "engine")


class TrustError(ServesimError):
    """A trust table that cannot be read."""


def regime(quantity: str, summary: dict) -> str:
    """The regime of a figure of `quantity` (a validate metric's quantity: ttft, tpot, itl,
    e2e, user_tps or a throughput) from the run's `summarize()` output."""
    if quantity in THROUGHPUTS:
        return "throughput"
    ttft = summary["ttft_ms"]["mean"] or 0.0
    queue = summary["queue_ms"]["mean"] or 0.0
    if quantity in ("ttft", "e2e") and ttft > 0 and queue >= QUEUED_SHARE * ttft:
        return "queued"
    if quantity == "ttft":
        return "first token"
    return ("decode, small batch" if (summary["batch"]["mean"] or 0.0) <= SMALL_BATCH
            else "decode, large batch")


def spread(ratios) -> dict:
    """For predicted / published ratios: how the published values lay around the predictions
    (published / predicted - 1), as `low` and `high` (the 10th and 90th percentiles with ten or
    more ratios, else the least and the most), the median, and the count."""
    dev = 1.0 / np.asarray(list(ratios), dtype=np.float64) - 1.0
    if not len(dev):
        return {"count": 0, "low": None, "median": None, "high": None}
    if len(dev) >= MIN_POINTS_FOR_PERCENTILES:
        low, high = np.percentile(dev, [10, 90])
    else:
        low, high = dev.min(), dev.max()
    return {"count": int(len(dev)), "low": float(low), "median": float(np.median(dev)),
            "high": float(high)}


def table(points: dict[str, dict]) -> dict:
    """Per regime, the `spread` of the out-of-sample ratios of `points` (id -> {"regime",
    "ratio"})."""
    return {name: spread([p["ratio"] for p in points.values() if p["regime"] == name])
            for name in REGIMES}


def setup(scenario) -> dict[str, str]:
    """The scenario's GPU, model and engine profile, as `GROUPS` names them."""
    return {k: GROUPS[k](scenario) for k in SETUP}


def load(path: Path = TRUST_FILE) -> dict:
    """A trust file written by `validate --fit --loo --trust`: its points and their table.
    Raises TrustError naming the file and what is wrong."""
    try:
        data = json_loads(read_input_text(path))
    except (OSError, UnicodeDecodeError) as e:
        raise TrustError(f"{path}: cannot read: {reason(e)}") from None
    except ValueError as e:
        raise TrustError(f"{path}: not JSON: {e}") from None
    points = data.get("points") if isinstance(data, dict) else None
    if not isinstance(points, dict):
        raise TrustError(f"{path}: points: expected an object of id -> regime and ratio")
    for pid, p in points.items():
        ok = (isinstance(p, dict) and p.get("regime") in REGIMES
              and isinstance(p.get("ratio"), (int, float)) and math.isfinite(p["ratio"])
              and p["ratio"] > 0)
        if not ok:
            raise TrustError(f"{path}: points.{pid}: expected a regime ({', '.join(REGIMES)}) "
                             "and a positive ratio")
        for k in SETUP:
            if k in p and not isinstance(p[k], str):
                raise TrustError(f"{path}: points.{pid}.{k}: expected a string")
    # (a file `validate --loo --trust` wrote records every point's setup, or none: an older one)
    recorded = {k for p in points.values() for k in SETUP if k in p}
    for pid, p in points.items():
        missing = sorted(recorded - p.keys())
        if missing:
            raise TrustError(f"{path}: points.{pid}: no {missing[0]} (other points record theirs)")
    return {"points": points, "regimes": table(points)}


# The headline figures `attach` qualifies: (summary section, key, validate quantity)
HEADLINE = (("ttft_ms", "p50", "ttft"), ("ttft_ms", "p99", "ttft"),
            ("tpot_ms", "p50", "tpot"), ("tpot_ms", "p99", "tpot"),
            ("throughput", "output_tokens_per_s", "output_tps"))


def attach(summary: dict, trust: dict) -> dict:
    """The headline figures of `summary` with the interval a measurement of each is expected
    in: {"ttft_ms.p50": {"value", "regime", "points", "low", "high"}, ...}, `low`/`high` as
    fractions of the value (-0.12, 0.18: between 12% under and 18% over). A regime with no
    validated point gets None for both: no claim is made."""
    out = {}
    for section, key, quantity in HEADLINE:
        value = summary.get(section, {}).get(key)
        if value is None or not summary.get("ttft_ms", {}).get("count"):
            continue
        name = regime(quantity, summary)
        s = trust["regimes"][name]
        out[f"{section}.{key}"] = {"value": value, "regime": name, "points": s["count"],
                                   "low": s["low"], "high": s["high"]}
    return out


def coverage(scenario, trust: dict) -> dict | None:
    """How many of the trust file's points share the scenario's GPU, model and engine profile,
    each counted on its own, and all three at once (`setup`): {"hardware": {"value":
    "h100-sxm", "points": 100}, "model": ..., "engine": ..., "setup": {"value": "h100-sxm,
    llama-3.1-8b, vllm-v1", "points": 0}}. None where the file records no setups (written
    without them)."""
    points = list(trust["points"].values())
    if not points or any(k not in p for p in points for k in SETUP):
        return None
    mine = setup(scenario)
    out = {k: {"value": mine[k], "points": sum(p[k] == mine[k] for p in points)} for k in SETUP}
    out["setup"] = {"value": ", ".join(mine[k] for k in SETUP),
                    "points": sum(all(p[k] == mine[k] for k in SETUP) for p in points)}
    return out


COVERAGE_NAMES = {"hardware": "on this GPU", "model": "of this model",
                  "engine": "through this engine profile",
                  "setup": "of this GPU, model and engine profile together"}


def describe_coverage(cov: dict) -> list[str]:
    """One line per entry of `coverage`: "published points on this GPU (h100-pcie): none:
    predicted from its data sheet and profiles fitted on other GPUs"."""
    lines = []
    for k, c in cov.items():
        head = f"published points {COVERAGE_NAMES[k]} ({c['value']}): "
        if c["points"]:
            lines.append(f"{head}{c['points']}")
        elif k == "hardware":
            lines.append(f"{head}none: predicted from its data sheet and profiles fitted on "
                         "other GPUs")
        else:
            lines.append(f"{head}none")
    return lines


def describe(figures: dict) -> list[str]:
    """One line per figure of `attach`: "ttft_ms.p50 120.3: expected within -12%/+18%
    (first token, 14 points)"."""
    lines = []
    for name, f in figures.items():
        if f["points"]:
            lines.append(f"{name} {f['value']:,.4g}: expected within {f['low']:+.0%}/"
                         f"{f['high']:+.0%} ({f['regime']}, {f['points']} published points)")
        else:
            lines.append(f"{name} {f['value']:,.4g}: not validated ({f['regime']}: no "
                         "published point)")
    return lines
