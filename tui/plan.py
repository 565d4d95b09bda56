"""`servesim plan`: its options, and the answer printed for a person to act on: the ranked
table, the Pareto front of cost against load (on the terminal or to an SVG/PNG), the winner as a
scenario file and as `vllm serve` / SGLang command lines, why the runner-up lost, and how far the
figures can be trusted. The search itself is `sim.deploy.plan`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from sim.deploy import plan as P
from sim.deploy import sweep
from sim.errors import shown
from sim.fileio import (check_writable, json_loads, read_input_text, reason, save_figure,
                        write_atomic)
from sim.inputs.scenario import BUNDLED_DIR, ClusterConfig, ModelConfig
from sim.model import trust as T
from sim.model import validate as V
from sim.policies import POLICIES
from tui import plot
from tui.bench.common import positive


def _ints(text: str) -> list[int]:
    try:
        v = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers, comma-separated") \
            from None
    if not v or min(v) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers of at least 1")
    return v


def _degrees(section: type, name: str):
    """`_ints` for a search over the scenario field `name` of `section`, each value within that
    field's own upper bound (an absurd count is refused here, not after the probes)."""
    top = next(f for f in dataclasses.fields(section) if f.name == name).metadata["max"]

    def parse(text: str) -> list[int]:
        v = _ints(text)
        if max(v) > top:
            raise argparse.ArgumentTypeError(f"{shown(text)}: at most {top} ({name})")
        return v

    return parse


def _ratios(text: str) -> list[tuple[int, int]]:
    """`1:1,2:1`: prefill:decode instance counts, each 1 to 64 (the scenario's limit)."""
    out = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        p, _, d = x.partition(":")
        try:
            pair = (int(p), int(d))
        except ValueError:
            pair = (0, 0)
        if not all(1 <= n <= 64 for n in pair):
            raise argparse.ArgumentTypeError(
                f"{x!r}: expected prefill:decode instance counts from 1 to 64, such as 2:1")
        out.append(pair)
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: expected prefill:decode ratios, such as "
                                         "1:1,2:1")
    return out


def _words(text: str) -> list[str]:
    v = [x.strip() for x in text.split(",") if x.strip()]
    if not v:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list")
    return v


def _switches(text: str) -> list[bool]:
    table = {"on": True, "off": False, "true": True, "false": False}
    v = _words(text)
    bad = [x for x in v if x.lower() not in table]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r}: expected on or off")
    return [table[x.lower()] for x in v]


def add_arguments(s: argparse.ArgumentParser) -> None:
    d = P.Space(gpus=[])
    s.add_argument("scenario", help="scenario file or bundled name: the model and the workload")
    s.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a scenario field (repeatable)")
    s.add_argument("--slo", action="append", default=[], metavar="METRIC=MS",
                   help="a bound every deployment must meet: ttft_p99=2000, tpot_p99=100, ... "
                        f"(repeatable; metrics: {', '.join(P.BOUND_COLUMNS)})")
    s.add_argument("--rate", type=positive("load"), metavar="R",
                   help="the load to serve, requests/s (default: the scenario's workload's)")
    s.add_argument("--concurrency", type=_ints_one, metavar="N",
                   help="the load to serve as N users in a closed loop (each sends its next "
                        "request when its last completes): the cheapest deployment meeting the "
                        "bounds at N")
    s.add_argument("--gpus", type=_words, metavar="a100,h100,h200",
                   help="GPU types (default: every GPU in the price table)")
    s.add_argument("--tp", type=_degrees(ModelConfig, "tensor_parallel"), default=d.tp,
                   metavar="1,2,4,8",
                   help="tensor-parallel degrees (default 1,2,4,8; those the model does not "
                        "fit are skipped)")
    s.add_argument("--replicas", type=_degrees(ClusterConfig, "replicas"), default=d.replicas,
                   metavar="1,2,4")
    s.add_argument("--dp", type=_degrees(ModelConfig, "data_parallel"), default=d.dp,
                   metavar="1,2,4",
                   help="data-parallel ranks of one engine (default 1,2,4; not with replicas)")
    s.add_argument("--pp", type=_degrees(ModelConfig, "pipeline_parallel"), default=d.pp,
                   metavar="1,2",
                   help="pipeline stages (default 1,2; those that do not divide the layers are "
                        "skipped)")
    s.add_argument("--expert-parallel", type=_switches, default=d.expert_parallel,
                   metavar="off,on", help="a mixture of experts split over the engine's GPUs "
                                          "(default off,on; dense models: off)")
    s.add_argument("--routers", type=_words, default=d.routers, metavar="R,R",
                   help="routers of replicated deployments (default round-robin,"
                        "least-outstanding)")
    s.add_argument("--max-num-seqs", type=_ints, default=d.max_num_seqs, metavar="N,N")
    s.add_argument("--max-num-batched-tokens", type=_ints, default=d.max_num_batched_tokens,
                   metavar="N,N")
    s.add_argument("--policies", type=_words, default=d.policies, metavar="P,P",
                   help="scheduling policies; disaggregated is prefill and decode instances "
                        "(default chunked,disaggregated)")
    s.add_argument("--pd-ratios", type=_ratios, default=d.pd_ratios, metavar="P:D,P:D",
                   help="disaggregated: prefill:decode instance counts (default 1:1,1:2,2:1,"
                        "1:3; the GPUs and the price follow P + D)")
    s.add_argument("--prefix-caching", type=_switches, default=d.prefix_caching,
                   metavar="off,on")
    s.add_argument("--budget", type=positive("price"), metavar="USD_PER_HOUR",
                   help="the most a deployment may cost per hour")
    s.add_argument("--prices", metavar="FILE.toml", help="another price table "
                   "(default: the bundled scenarios/prices/prices.toml)")
    s.add_argument("--price", action="append", default=[], metavar="GPU=USD_PER_HOUR",
                   help="the price of one GPU-hour (repeatable; over the table and the "
                        "scenario's plan.gpu_price_usd_per_hour)")
    s.add_argument("--probe-requests", type=int, default=1000, metavar="N",
                   help="probes replay the workload's first N requests; the finalists are "
                        "checked on all of it (default 1000; 0: always all of it)")
    s.add_argument("--tolerance", type=float, default=0.03,
                   help="relative precision of each highest-load search (default 0.03)")
    s.add_argument("--finalists", type=int, default=3, metavar="K",
                   help="candidates confirmed on the whole workload at a time (default 3)")
    s.add_argument("--exhaustive", action="store_true",
                   help="no pruning, no bounds carried between candidates (for checking)")
    s.add_argument("-o", "--output", metavar="FILE.jsonl",
                   help="record each finished candidate here; run again with the same file to "
                        "resume")
    s.add_argument("--workers", type=int, metavar="N",
                   help="local worker processes (default: the CPU count)")
    s.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="run the probes on Ray: a local instance, or the cluster at ADDRESS")
    s.add_argument("--progress", action="store_true",
                   help="draw the progress bar even when stderr is not a terminal")
    s.add_argument("--plot", nargs="?", const="", metavar="FILE",
                   help="the Pareto front, $/hour against load: to FILE.svg or FILE.png "
                        "(needs servesim[plot]), or on the terminal")
    s.add_argument("--winner", metavar="FILE.toml",
                   help="write the winner as a scenario here (default: print it)")
    s.add_argument("--validation", metavar="FILE.json",
                   help="`servesim validate --json` output to take the regime errors from "
                        "(default: run the bundled points that match the space)")
    s.add_argument("--trust", metavar="FILE.json", default=str(T.TRUST_FILE),
                   help="the winner's regime intervals from this trust file (`servesim validate "
                        "--fit --loo --trust`; default: the bundled one)")
    s.add_argument("--no-validation", action="store_true",
                   help="leave out the validation errors and the regime intervals (faster)")
    s.add_argument("--top", type=_ints_one, default=15, metavar="N", help="table rows (default 15)")
    s.add_argument("--json", action="store_true", help="print the outcome as one JSON object")


def _ints_one(text: str) -> int:
    v = _ints(text)
    if len(v) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one whole number")
    return v[0]


def build_plan(args) -> P.Plan:
    """The plan the options describe. Raises PlanError / ScenarioError (one line)."""
    bounds = P.parse_bounds(args.slo)
    prices = P.load_prices(args.prices) if args.prices else P.load_prices()
    given = dict(P.price_override(text) for text in args.price)
    # (default: every GPU with a price here; the scenario's own prices add theirs in run_plan)
    gpus = [P.gpu_preset(g) for g in args.gpus] if args.gpus else sorted({*prices, *given})
    for pol in args.policies:
        if pol not in POLICIES and pol != "disaggregated":
            raise P.PlanError(f"--policies {pol}: unknown policy (known: "
                              f"{', '.join([*POLICIES, 'disaggregated'])})")
    routers = ["round-robin", "least-outstanding", "least-kv", "prefix-affinity"]
    for r in args.routers:
        if r not in routers:
            raise P.PlanError(f"--routers {r}: unknown router (known: {', '.join(routers)})")
    if not 1e-3 <= args.tolerance < 1:
        raise P.PlanError(f"--tolerance {args.tolerance}: must be from 0.001 to below 1")
    if args.probe_requests < 0:
        raise P.PlanError(f"--probe-requests {args.probe_requests}: must be 0 or more")
    if args.finalists < 1:
        raise P.PlanError(f"--finalists {args.finalists}: must be at least 1")
    space = P.Space(gpus, args.tp, args.replicas, args.routers, args.max_num_seqs,
                    args.max_num_batched_tokens, args.policies, args.prefix_caching, args.dp,
                    args.pp, args.expert_parallel, args.pd_ratios)
    return P.Plan(args.scenario, bounds, space, prices, overrides=list(args.overrides),
                  rate=args.rate, concurrency=args.concurrency, price_overrides=given,
                  budget=args.budget, tolerance=args.tolerance,
                  probe_requests=args.probe_requests or None, finalists=args.finalists,
                  prune=not args.exhaustive)


def main(args) -> int:
    p = build_plan(args)
    trust = None if args.no_validation else T.load(Path(args.trust))  # (bad: before the search)
    validation = (read_validation(args.validation) if args.validation
                  and not args.no_validation else None)  # (bad: before the search)
    for path, what in ((args.output, "-o"), (args.winner, "--winner")):
        if path:
            check_writable(path, what)
    if args.plot:
        plot.check_output(args.plot)
        check_writable(args.plot, "--plot")
    bar = sweep.ProgressBar(sys.stderr, "plan") if args.progress or sys.stderr.isatty() else None
    try:
        with sweep.Runner(args.workers, args.ray) as runner:
            out = P.run_plan(p, runner, journal_path=args.output, progress=bar)
    finally:
        if bar:
            bar.close()
    table = _regimes(out, args, validation)
    figures = None if trust is None or out.winner is None else P.winner_trust(
        out, out.winner, trust)
    if args.json:
        print(json.dumps({**as_json(out, table), "trust": figures}, indent=2))
    else:
        print(report(out, table, args.top, figures))
    if out.winner is None:
        return 1
    toml = P.winner_toml(out, out.winner)
    if args.winner:
        write_atomic(args.winner, toml)
        print(f"winner written to {args.winner} (run it: servesim sim {args.winner})",
              file=sys.stderr)
    elif not args.json:
        print("\nThe winner as a scenario (--winner FILE.toml writes it):\n")
        print(toml, end="")
    if args.plot is not None:
        if args.plot:
            write_front(args.plot, out)
            print(f"plot written to {args.plot}", file=sys.stderr)
        elif not args.json:
            print()
            print(text_front(out))
    return 0


# --- trust ---------------------------------------------------------------------------------------
def _regimes(out: P.Outcome, args, validation: list[dict] | None) -> dict:
    """(figure, gpu, tp) -> Regime, from a validate JSON's rows (`validation`) or the bundled
    points that match the candidates ranked (run here); empty with --no-validation."""
    if args.no_validation:
        return {}
    points = V.load_points(BUNDLED_DIR / "fidelity")
    wanted = {(r.candidate.gpu, r.candidate.tp) for r in out.results if r.status == "ok"}
    if validation is not None:
        return P.regimes(points, validation)
    chosen = []
    for pt in points:
        sc = V.point_scenario(pt)
        if (sc.hardware.preset, sc.model.tensor_parallel) in wanted:
            chosen.append(pt)
    return P.regimes(chosen, [V.run_point(pt) for pt in chosen])


def read_validation(path: str) -> list[dict]:
    """The rows of a `servesim validate --json` output, each with a text `id` and a `ratio`
    that is a finite number or null. Raises PlanError naming the file."""
    where = f"--validation {path}"
    try:
        data = json_loads(read_input_text(path))
    except (OSError, ValueError) as e:  # (ValueError: invalid JSON or UTF-8)
        raise P.PlanError(f"{where}: cannot read as JSON: {reason(e)}") from None
    rows = data.get("points") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise P.PlanError(f"{where}: not the output of servesim validate --json (no points "
                          "list)")
    for i, r in enumerate(rows):
        ratio = r.get("ratio") if isinstance(r, dict) else None
        if not (isinstance(r, dict) and isinstance(r.get("id"), str)
                and (ratio is None or (isinstance(ratio, (int, float))
                                       and not isinstance(ratio, bool) and math.isfinite(ratio)))):
            raise P.PlanError(f"{where}: points[{i}] = {shown(r, 80)}: expected an object with "
                              "a text id and a finite ratio (or null)")
    return rows


def _err(reg) -> str:
    return "?" if reg is None else f"{100 * reg.median:.0f}%"


# --- the report ----------------------------------------------------------------------------------
COLUMNS = ["#", "configuration", "GPUs", "max load", "out tok/s", "TTFT p99 ms",
           "TPOT p99 ms", "$/hour", "$/M tok", "err load/TTFT/TPOT"]


def _row(i, r: P.Result, table: dict) -> list[str]:
    row = r.row or {}
    t = P.trust(r.candidate, table) if table else None
    err = "/".join(_err(t[f]) for f in P.FIGURES) if t else "-"
    mark = "" if r.confirmed or r.status != "ok" else " (probe)"

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)
    return [str(i), r.candidate.label() + mark, str(r.candidate.gpus),
            num(r.max_load, ".3g"), num(r.output_tokens_per_s, ",.0f"),
            num(row.get("ttft_p99_ms"), ",.0f"), num(row.get("tpot_p99_ms"), ",.1f"),
            f"{r.usd_per_hour:,.2f}", num(r.usd_per_m_tokens, ".3f"), err]


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(x.ljust(w) if j == 1 else x.rjust(w)
                       for j, (x, w) in enumerate(zip(line, widths))) for line in [head, *rows]]
    return "\n".join(lines)


def report(out: P.Outcome, table: dict, top: int = 15, figures: dict | None = None) -> str:
    counts = {}
    for r in out.results:
        counts[r.status] = counts.get(r.status, 0) + 1
    sc = out.scenario
    model = (out.raw.get("model") or {}).get("preset", sc.model.preset)  # (as the file names it)
    lines = [f"servesim plan: {sc.name}, {model or 'custom model'}; bounds "
             f"{', '.join(b.text() for b in out.bounds)}; load to serve {out.required:.4g} "
             f"{out.unit}",
             f"{out.candidates} candidates: " + ", ".join(f"{n} {k}" for k, n in counts.items())
             + f"; {out.probes:,} runs" + (f"; {out.resumed} read back from the output file"
                                           if out.resumed else ""), ""]
    w = out.winner
    if w is None:
        lines.append(f"No deployment meets the bounds at {out.required:.4g} {out.unit}. "
                     "What binds: "
                     f"{P.binding(out)}.")
        lines.append("Nearest misses:")
        head = ["#", "configuration", "GPUs", f"max load {out.unit}", "$/hour", "why"]
        rows = [[str(i + 1), r.candidate.label(), str(r.candidate.gpus),
                 "-" if r.max_load is None else f"{r.max_load:.3g}", f"{r.usd_per_hour:,.2f}",
                 r.note] for i, r in enumerate(P.nearest_misses(out))]
        lines.append(_table(head, rows))
        return "\n".join(lines)
    shown_rows = out.feasible[:top]
    head = [f"{c} {out.unit}" if c == "max load" else c for c in COLUMNS]
    lines.append(_table(head, [_row(i + 1, r, table) for i, r in enumerate(shown_rows)]))
    lines += ["", "(probe): figures from the probe slice; the others were confirmed on the "
                  "whole workload. err: median |error| of `servesim validate` on the same GPU "
                  "and TP degree (?: never validated there)."]
    if out.skipped:
        lines.append(f"A closed loop runs on one engine: {out.skipped} candidates with replicas, "
                     "a prefill/decode pair, data-parallel ranks or pipeline stages were left "
                     "out (not modeled).")
    if not out.shares_prefixes:
        lines.append("No two requests share a prompt prefix: prefix caching on and off run "
                     "alike, and the table shows one of the two.")
    lines.append("")
    lines.append(f"Winner: {w.candidate.label()}: {w.max_load:.4g} {out.unit} within the "
                 "bounds on "
                 f"{w.candidate.gpus} GPUs, ${w.usd_per_hour:,.2f}/h, "
                 f"${w.usd_per_m_tokens:.3f} per million output tokens.")
    lines.append("Why not the runner-up: " + P.why_runner_up_lost(out))
    if table is not None:
        lines.append(_trust_text(w, table))
    if figures is not None:
        lines += _figures_text(figures)
    lines += ["", "vLLM:", P.vllm_command(sc, w.candidate), "", "SGLang:",
              P.sglang_command(sc, w.candidate)]
    return "\n".join(lines)


def _trust_text(w: P.Result, table: dict) -> str:
    if not table:
        return "Trust: validation left out (--no-validation)."
    t = P.trust(w.candidate, table)
    names = {"load": "throughput", "ttft": "TTFT", "tpot": "TPOT"}
    missing = [names[f] for f, reg in t.items() if reg is None]
    known = [f"{names[f]} {100 * reg.median:.0f}% median, {100 * reg.worst:.0f}% worst "
             f"({len(reg.errors)} points)" for f, reg in t.items() if reg is not None]
    text = "Trust: " + ("; ".join(known) if known else "no validated figure")
    if missing:
        where = "a disaggregated deployment" if w.candidate.disaggregated else \
            f"{w.candidate.gpu} at TP{w.candidate.tp}"
        text += (f". The winner depends on regimes the model has not been validated in: "
                 f"{', '.join(missing)} on {where} (servesim validate has no measurement there)")
    return text + "."


def _figures_text(figures: dict) -> list[str]:
    """The winner's figures at its highest load, each with the interval of its regime, and a
    warning for each regime with few or no validated points."""
    lines = ["The winner's figures at that load, with the out-of-sample error of their regime:"]
    lines += ["  " + x for x in T.describe(figures)]
    thin = sorted({f["regime"] for f in figures.values() if f["points"] < P.FEW_POINTS})
    if thin:
        lines.append("The winner depends on a regime the model has not been validated in (or "
                     f"barely: fewer than {P.FEW_POINTS} published points): {', '.join(thin)}.")
    return lines


def as_json(out: P.Outcome, table: dict) -> dict:
    def one(r: P.Result) -> dict:
        d = r.to_json()
        d["label"] = r.candidate.label()
        d["gpus"] = r.candidate.gpus
        d["usd_per_m_tokens"] = r.usd_per_m_tokens
        d["output_tokens_per_s"] = r.output_tokens_per_s
        if table:
            d["validation_error"] = {f: None if reg is None else reg.median
                                     for f, reg in P.trust(r.candidate, table).items()}
        return d
    w = out.winner
    return {"required_load": out.required, "load_unit": out.unit, "skipped": out.skipped,
            "prices": {g: {"usd_per_gpu_hour": v.usd_per_gpu_hour, "source": v.source}
                       for g, v in sorted(out.prices.items())},
            "bounds": [b.text() for b in out.bounds],
            "candidates": out.candidates, "runs": out.probes, "resumed": out.resumed,
            "work": out.work,
            "winner": one(w) if w else None,
            "vllm": P.vllm_command(out.scenario, w.candidate) if w else None,
            "sglang": P.sglang_command(out.scenario, w.candidate) if w else None,
            "runner_up": P.why_runner_up_lost(out) if w else None,
            "binding": None if w else P.binding(out),
            "pareto": [r.candidate.label() for r in out.pareto()],
            "results": [one(r) for r in out.results]}


# --- the Pareto front ----------------------------------------------------------------------------
def text_front(out: P.Outcome, width: int = 64, height: int = 14) -> str:
    """Every feasible deployment as '.', the Pareto front as letters (A cheapest), $/hour
    against the highest load meeting the bounds."""
    pts = [(r.max_load, r.usd_per_hour) for r in out.feasible]
    front = out.pareto()
    if not pts:
        return "(no feasible deployment: nothing to plot)"
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(ys), max(ys)
    x_hi, y_hi = (x_hi if x_hi > x_lo else x_lo * 1.1 + 1e-9), (y_hi if y_hi > y_lo else
                                                                  y_lo * 1.1 + 1e-9)
    grid = [[" "] * width for _ in range(height)]

    def cell(x, y):
        col = round((x - x_lo) / (x_hi - x_lo) * (width - 1))
        row = round((y_hi - y) / (y_hi - y_lo) * (height - 1))
        return row, col
    for x, y in pts:
        r, c = cell(x, y)
        grid[r][c] = "."
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    for i, r in enumerate(front):
        rr, cc = cell(r.max_load, r.usd_per_hour)
        grid[rr][cc] = letters[i % len(letters)]
    lines = ["Pareto front: $/hour against the highest load meeting the bounds ({out.unit})"]
    for i, row in enumerate(grid):
        tick = f"{y_hi:9.4g}" if i == 0 else f"{y_lo:9.4g}" if i == height - 1 else " " * 9
        lines.append(f"{tick} |{''.join(row)}")
    lines.append(" " * 9 + " +" + "-" * width)
    lo, hi = f"{x_lo:.4g}", f"{x_hi:.4g}"
    lines.append(" " * 11 + lo + hi.rjust(width - len(lo)))
    lines += [f"  {letters[i % len(letters)]}  {r.candidate.label()}: {r.max_load:.3g} {out.unit}, "
              f"${r.usd_per_hour:,.2f}/h, ${r.usd_per_m_tokens:.3f}/M tok"
              for i, r in enumerate(front)]
    return "\n".join(lines)


def write_front(path: str, out: P.Outcome) -> None:
    """The same picture to an SVG or PNG (matplotlib)."""
    import matplotlib  # (lazy: the optional `plot` extra, only to draw a file)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (lazy: as matplotlib)

    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    f = out.feasible
    ax.scatter([r.max_load for r in f], [r.usd_per_hour for r in f], s=12, color="0.6",
               label="deployments meeting the bounds")
    front = out.pareto()
    ax.plot([r.max_load for r in front], [r.usd_per_hour for r in front], "o-", color="C0",
            label="Pareto front")
    if out.winner is not None:
        ax.plot([out.winner.max_load], [out.winner.usd_per_hour], marker="*", markersize=16,
                color="C1", markeredgecolor="black", linestyle="none",
                label=f"winner: {out.winner.candidate.label()}")
    ax.axvline(out.required, color="red", linestyle=":", label="load to serve")
    ax.set_xlabel("highest load meeting the bounds (requests/s)")
    ax.set_ylabel("US dollars per hour")
    ax.set_title(f"{out.scenario.name}: " + ", ".join(b.text() for b in out.bounds))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
