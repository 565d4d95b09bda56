"""The `servesim` command line: wires the simulation core (`sim`), real compute (`gpu`) and the
dashboard (`tui.app`) together. Textual and the compute backends are imported only by the
commands that need them, so headless commands start fast.

Every error a user can cause ends as one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import signal
import sys
import threading
from pathlib import Path

import numpy as np

from sim import ServesimError, build, load_scenario, summarize
from sim.deploy import sweep
from sim.errors import ScenarioError, one_line, shown
from sim.fileio import check_writable, write_atomic
from sim.inputs.scenario import BUNDLED_DIR, DEPLOYMENT_POLICIES, bundled_scenarios
from sim.inputs.workload import build_workload
from sim.model import profiles as P
from sim.model import validate as V
from sim.model import trust as T
from sim.model.calibrate import calibrate, preset_toml, read_bench_json, validate_bench
from sim.model.presets import ENGINES
from sim.policies import POLICIES
from sim.session import export
from sim.session.log import read_log, write_log
from sim.session.replay import Replayer, verify
from tui import bench, plot
from tui import plan as plan_cli
from tui.compute import make_executor
from tui.driver import check_speed
from tui.progress import RunProgress


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str):  # noqa: D401
        # (a value argparse quotes whole, such as an integer of 5,000 digits, is cut)
        message = _LONG_QUOTE.sub(lambda m: shown(m.group(1)), message)
        self.exit(2, f"servesim: error: {one_line(message)} (see {self.prog} --help)\n")


_LONG_QUOTE = re.compile(r"'([^']{60,})'")


def _add_scenario_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    if optional:
        p.add_argument("scenario", nargs="?", default=None,
                       help="scenario file or bundled name (default: chat)")
    else:
        p.add_argument("scenario", help="scenario file or bundled scenario name")
    p.add_argument("--seed", type=int, default=None, help="override the scenario seed")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override any scenario field (repeatable)")


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress line on stderr (drawn on a terminal after 2 s)")


def _scenario(args) -> "object":
    overrides = list(args.overrides)
    if args.seed is not None:
        overrides.append(f"seed={args.seed}")
    if getattr(args, "policy", None):
        overrides.append(f"scheduler.policy={json.dumps(args.policy)}")
    if getattr(args, "compute", None):
        overrides.append(f"compute.backend={json.dumps(args.compute)}")
    return load_scenario(args.scenario, overrides)


def build_engine(scenario, policy: str | None = None, **kw):
    """What the scenario deploys (`sim.build`: an Engine, or a Cluster of several), each
    instance with the real-compute executor `[compute]` asks for."""
    return build(scenario, policy=policy, make_executor=make_executor, **kw)


def summary_columns(summary: dict, name: str) -> dict[str, dict]:
    """Table columns for one run: the run itself, and each instance of a deployment."""
    out = {name: summary}
    parts = summary.get("replicas", ())
    roles = [r["role"] for r in parts]
    for r in parts:
        # (a disaggregated pair's instances by role, several of a role by role and index;
        # others by index)
        prefix = {"replica": "r", "rank": "rank ", "virtual-engine": "ve "}.get(r["role"])
        label = (f"{prefix}{r['instance']}" if prefix is not None
                 else r["role"] if roles.count(r["role"]) == 1
                 else f"{r['role']} {r['instance']}")
        out[label] = r
    return out


# --- formatting ---------------------------------------------------------------------------------
def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if abs(v) >= 1e5:
            return f"{v:,.0f}"
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


ROWS = [
    ("requests finished", lambda s: s["requests"]["finished"]),
    ("requests cancelled", lambda s: s["requests"]["cancelled"]),
    ("requests rejected", lambda s: s["requests"]["rejected"]),
    ("simulated duration (s)", lambda s: s["duration_s"]),
    ("throughput (req/s)", lambda s: s["throughput"]["requests_per_s"]),
    ("output tokens/s", lambda s: s["throughput"]["output_tokens_per_s"]),
    ("total tokens/s", lambda s: s["throughput"]["total_tokens_per_s"]),
    ("goodput (req/s)", lambda s: s["goodput_requests_per_s"]),
    ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"]),
    ("TTFT p99 (ms)", lambda s: s["ttft_ms"]["p99"]),
    ("ITL p50 (ms)", lambda s: s["itl_ms"]["p50"]),
    ("ITL p99 (ms)", lambda s: s["itl_ms"]["p99"]),
    ("TPOT mean (ms)", lambda s: s["tpot_ms"]["mean"]),
    ("E2E p50 (ms)", lambda s: s["e2e_ms"]["p50"]),
    ("E2E p99 (ms)", lambda s: s["e2e_ms"]["p99"]),
    ("queue wait p99 (ms)", lambda s: s["queue_ms"]["p99"]),
    ("batch size mean", lambda s: s["batch"]["mean"]),
    ("KV usage mean (%)", lambda s: 100 * s["kv"]["mean_usage"]),
    ("KV peak blocks", lambda s: s["kv"]["peak_used_blocks"]),
    ("preemptions", lambda s: s["preemptions"]),
    ("energy (J/token)", lambda s: s["energy_j_per_output_token"]),
    ("wall time (s)", lambda s: s["wall_s"]),
]


# Behind an API server (sim.engine.frontend) the TTFT, ITL, TPOT and E2E rows are the
# client's; these follow them with the engine's (a run without one: "-").
ENGINE_SIDE_ROWS = [
    (f"engine-side {name} (ms)", lambda s, k=key, q=q: s["engine_side"][k][q]
     if "engine_side" in s else None)
    for name, key, q in (("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
                         ("ITL p50", "itl_ms", "p50"), ("TPOT p50", "tpot_ms", "p50"),
                         ("E2E p50", "e2e_ms", "p50"))]


def format_table(summaries: dict[str, dict]) -> str:
    """A text table with one column per run (policy)."""
    names = list(summaries)
    rows = list(ROWS)
    if any("engine_side" in s for s in summaries.values()):
        at = next(i for i, (label, _) in enumerate(rows) if label == "E2E p99 (ms)") + 1
        rows[at:at] = ENGINE_SIDE_ROWS
    width = max(len(r[0]) for r in rows)
    cols = [max(10, len(n)) for n in names]
    head = " " * width + "  " + "  ".join(n.rjust(c) for n, c in zip(names, cols))
    lines = [head]
    for label, get in rows:
        cells = []
        for n, c in zip(names, cols):
            v = get(summaries[n])
            cells.append(_fmt(v, 3 if "J/token" in label else 1).rjust(c))
        lines.append(label.ljust(width) + "  " + "  ".join(cells))
    return "\n".join(lines)


# --- commands -----------------------------------------------------------------------------------
def _is_terminal(stream) -> bool:
    return stream.isatty()


def _progress(args):
    """The progress line of a long headless run (tui.progress): on stderr when it is a
    terminal, unless --quiet, or --json goes to a pipe."""
    quiet = args.quiet or (getattr(args, "json", False) and not _is_terminal(sys.stdout))
    return RunProgress(sys.stderr, enabled=not quiet and _is_terminal(sys.stderr))


def _check_writable(path: str | None, what: str) -> None:
    """Fail before a long run, not after it, when its output cannot be written."""
    if path:
        check_writable(path, what)


def _not_an_input(path: str | None, what: str, inputs) -> None:
    """Refuse an output that is one of the files the command reads (it would replace it)."""
    for inp in inputs:
        try:
            same = bool(path) and os.path.samefile(path, inp)
        except OSError:  # one of them is not there
            same = False
        if same:
            raise ScenarioError(f"{what} {path}: is {inp}, which this command reads; "
                                "writing it would replace it")


def _scenario_inputs(sc) -> list[str]:
    """The files a scenario is read from: its own, its trace and its length files."""
    files = [sc.source]
    w = sc.workload
    if w.trace:
        files.append(str(sc.resolve_path(w.trace)))
    for spec in (w.prompt_tokens, w.output_tokens, w.cancel_after_s, w.priority):
        if isinstance(spec, dict) and spec.get("file"):
            files.append(str(sc.resolve_path(spec["file"])))
    return files


def cmd_sim(args) -> int:
    _check_writable(args.log, "--log")
    sc = _scenario(args)
    _not_an_input(args.log, "--log", _scenario_inputs(sc))
    # (no per-request history: memory stays bounded by what is in flight)
    engine = build_engine(sc, record_events=bool(args.log), keep_history=False)
    with _progress(args) as progress:
        progress.watch(engine, f"sim {sc.name}")
        engine.run()
    summary = summarize(engine)
    if args.log:
        write_log(args.log, engine, summary)
    trust = T.load() if args.trust else None
    figures = T.attach(summary, trust) if trust else None
    cover = T.coverage(sc, trust) if trust else None
    if args.json:
        extra = {"trust": figures, "trust_coverage": cover} if trust else {}
        print(json.dumps({**summary, **extra}, indent=2))
    else:
        print(f"{sc.name}: {sc.description}")
        print(format_table(summary_columns(summary, summary["policy"])))
        if figures:
            print("\n".join(T.describe(figures)))
            if cover:
                print("\n".join(T.describe_coverage(cover)))
    return 0


def cmd_compare(args) -> int:
    sc = _scenario(args)
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    known = [*POLICIES, *DEPLOYMENT_POLICIES]
    if not names:
        raise ScenarioError(f"--policies {shown(args.policies)}: name at least one policy "
                            f"(known: {', '.join(known)})")
    seen = set()
    for n in names:
        if n in seen:
            raise ScenarioError(f"--policies: {shown(n)} is listed twice")
        seen.add(n)
        if n not in known:
            raise ScenarioError(f"--policies: unknown policy {shown(n)} (known: "
                                f"{', '.join(known)})")
    workload = build_workload(sc)  # one trace, every policy
    out = {}
    with _progress(args) as progress:
        for k, n in enumerate(names, start=1):
            # A disaggregated deployment counts its instances in cluster.prefill_instances and
            # decode_instances whatever cluster.replicas says, so that it compares with that
            # many replicas of another.
            run_sc = _one_pair(sc) if n == "disaggregated" else sc
            engine = build_engine(run_sc, policy=n, workload=workload, record_events=False,
                                  keep_history=False)
            progress.watch(engine, f"compare {sc.name}: {n} ({k}/{len(names)})")
            engine.run()
            out[n] = summarize(engine)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{sc.name}: {len(workload)} requests, the same trace under each policy")
        print(format_table(out))
    return 0


def _one_pair(sc):
    sc = copy.deepcopy(sc)
    sc.cluster.replicas = 1
    return sc


def cmd_scenarios(args) -> int:
    rows = bundled_scenarios()
    width = max(len(n) for n, _ in rows)
    for name, desc in rows:
        print(f"{name.ljust(width)}  {desc}")
    return 0


def cmd_run(args) -> int:
    # The dashboard reads keys from stdin and draws on the terminal Textual writes to (stderr):
    # without one it would draw into a file and wait for keys that never come.
    if not (sys.stdin.isatty() and sys.__stderr__.isatty()):
        raise ScenarioError("run: the dashboard needs a terminal (stdin and stderr); "
                            "`servesim sim` runs headless")
    sc = _scenario(args)
    try:
        from tui.app import run_dashboard  # (lazy: Textual loads only for the dashboard)
    except ImportError as e:  # pragma: no cover
        raise ScenarioError(f"the dashboard needs textual: {e}") from None
    return run_dashboard(sc, speed=args.speed, replay=args.replay, make_executor=make_executor)


def cmd_serve(args) -> int:
    from tui.serve.app import build_frontend, serve_headless  # (lazy: aiohttp loads only to serve)
    from tui.serve.http import Limits  # (lazy, as above)

    if not 0 <= args.port <= 65535:
        raise ScenarioError(f"--port {args.port}: must be between 0 and 65535")
    if not args.host.strip():
        raise ScenarioError("--host '': name the address to listen on (0.0.0.0 or :: for every "
                            "address)")
    api_key = args.api_key if args.api_key is not None else os.environ.get("SERVESIM_API_KEY")
    if api_key is not None and not api_key.strip():
        raise ScenarioError("--api-key: empty (leave it out to serve without one)")
    if args.max_waiting is not None and args.max_waiting < 0:
        raise ScenarioError(f"--max-waiting {args.max_waiting}: must be at least 0")
    limits = Limits(keep_alive_s=args.keep_alive_timeout, body_s=args.body_timeout,
                    max_connections=args.max_connections)
    _check_writable(args.log, "--log")
    sc = _scenario(args)
    _not_an_input(args.log, "--log", _scenario_inputs(sc))
    frontend = build_frontend(sc, background=args.background, make_executor=make_executor,
                              speed=args.speed, model_name=args.served_model_name,
                              max_waiting=args.max_waiting, record_timing=args.record_timing,
                              bounded=True, send_threads=args.send_threads,
                              # (under --tui the dashboard spools the events itself)
                              keep_events=bool(args.log) or args.tui)
    if args.tui:
        from tui.serve.dashboard import serve_dashboard  # (lazy: Textual loads only for --tui)

        return serve_dashboard(frontend, args.host, args.port, api_key=api_key, limits=limits,
                               log=args.log)
    return serve_headless(frontend, args.host, args.port, api_key=api_key, limits=limits,
                          log=args.log)


def cmd_replay(args) -> int:
    log = read_log(args.log, check_events=not args.verify)  # (verify checks what differs)
    make = make_executor if log.header["compute"]["backend"] != "none" and args.verify else None
    with _progress(args) as progress:
        if args.verify:
            replayer, div = verify(log, make,
                                   watch=lambda e: progress.watch(e, f"verify {args.log}"))
        else:
            replayer = Replayer(log)
            progress.watch(replayer.engine, f"replay {args.log}")
            replayer.run()
            div = None
    engine = replayer.engine
    # A verified replay regenerated the recorded events exactly, so the recorded summary is its.
    summary = log.footer["summary"] if args.verify else summarize(engine)
    if args.json:
        out = {"log": args.log, "events": len(log.records), "summary": summary}
        if args.verify:
            out["verified"] = div is None
            out["divergence"] = None if div is None else {
                "index": div.index, "expected": div.expected, "got": div.got}
        print(json.dumps(out, indent=2, default=str))
    else:
        if args.verify and div is None:
            print(f"{args.log}: replay verified: {len(log.records):,} events identical")
        elif not args.verify:
            print(format_table(summary_columns(summary, summary["policy"])))
    if div is not None:
        print(f"servesim: replay diverged at {div.describe()}", file=sys.stderr)
        return 1
    return 0


def cmd_export(args) -> int:
    _check_writable(args.output, "-o")
    _not_an_input(args.output, "-o", [args.log])
    log = read_log(args.log)
    if args.format == "jsonl":
        text = export.to_jsonl(log)
    else:
        replayer = Replayer(log)
        with _progress(args) as progress:
            progress.watch(replayer.engine, f"export {args.log}")
            replayer.run()
        text = (export.to_csv(replayer.engine) if args.format == "csv"
                else export.to_chrome(log, replayer.engine))
    if args.output:
        write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_sweep(args) -> int:
    if args.seeds is not None and args.seeds < 1:
        raise ScenarioError(f"--seeds {args.seeds}: must be at least 1")
    if args.seeds is not None and args.seed is not None:
        raise ScenarioError("--seed and --seeds: give one (--seeds K runs seeds 0..K-1)")
    overrides = list(args.overrides) + ([f"seed={args.seed}"] if args.seed is not None else [])
    if args.slo:
        overrides += sweep.slo_overrides(args.slo)
    _check_writable(args.output, "-o")  # before the sweep, not after it
    if args.plot:
        plot.check_output(args.plot)
        _check_writable(args.plot, "--plot")
    seeds = range(args.seeds) if args.seeds is not None else None  # (checked before listed)
    plan = sweep.plan(args.scenario, sweep.parse_grid(args.grid), seeds=seeds,
                      overrides=overrides)
    # Every file a grid point reads (its scenario, trace and length files) stays as it is.
    inputs = list(dict.fromkeys(f for point in plan.points for f in _scenario_inputs(point.scenario)))
    _not_an_input(args.output, "-o", inputs)
    _not_an_input(args.plot, "--plot", inputs)
    bar = sweep.ProgressBar(sys.stderr) if args.progress or sys.stderr.isatty() else None
    try:
        with sweep.Runner(args.workers, args.ray) as runner:
            if args.find_max_rate:
                table = sweep.find_max_rate(plan, runner, target=args.attainment,
                                            tolerance=args.tolerance, progress=bar)
            else:
                table = sweep.run_sweep(plan, runner, progress=bar)
    finally:
        if bar:
            bar.close()
    if args.output:
        write_atomic(args.output, table.to_csv())
    elif args.find_max_rate:
        print(table.to_text())
    else:
        print(table.to_text(table.key_columns + sweep.TEXT_METRICS))
    if args.plot is not None:
        cs, slos = plot.curves(table), plot.slo_bounds(plan)
        if args.plot:
            plot.write_plot(args.plot, cs, slos, title=f"{plan.points[0].scenario.name}: "
                            "latency against achieved throughput")
            print(f"plot written to {args.plot}", file=sys.stderr)
        else:
            print()
            print(plot.text_plot(cs, slos))
    return 0


def cmd_bench(args) -> int:
    return bench.main(args)


def _speed(text: str) -> float:
    """--speed: a number from 1/64 to 4096 (argparse shows the error as one line)."""
    try:
        return check_speed(text)
    except ServesimError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speed ")) from None


def cmd_validate(args) -> int:
    if args.trust:
        if not args.loo:
            raise ScenarioError("--trust: needs --loo (it writes the leave-one-out errors)")
        _check_writable(args.trust, "--trust")
    spec = Path(args.points) if args.points else BUNDLED_DIR / "fidelity"
    if spec.suffix.lower() == ".json":
        results = validate_bench(read_bench_json(spec), _scenario(args))
    else:
        points = V.load_points(spec)
        if args.only is not None:
            wanted = _point_ids(args.only, {p.id for p in points}, spec)
            points = [p for p in points if p.id in wanted]
        if args.fit or args.loo or args.leave_out:
            return _fit_profiles(points, args)
        results = []
        show = not args.json and _is_terminal(sys.stderr)  # (a progress line is for a person)
        for i, p in enumerate(points):
            if show:
                print(f"\r[{i + 1}/{len(points)}] {p.id} ", end="", file=sys.stderr, flush=True)
            try:
                results.append(V.run_point(p, args.engine, args.overrides))
            finally:  # the progress line goes before a result or an error's one line
                if show:
                    print("\r" + " " * 40 + "\r", end="", file=sys.stderr)
    stats = V.summary(results)
    if args.plot:
        _check_writable(args.plot, "--plot")
        V.plot(results, args.plot)
    if args.json:
        print(json.dumps({"points": results, "summary": stats}, indent=2))
    else:
        print(V.format_report(results, stats))
    return 0


def _fit_profiles(points, args) -> int:
    """`validate --fit` / `--loo` / `--leave-out KEY`: fit the engine profiles on the `use =
    fit` points (how the built-in ones were made), and their leave-one-out error or their error
    on each value of KEY held out whole."""
    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rows = P.prepare([p for p in points if p.use == "fit"])
    c = P.fit(rows, log=log)
    profiles = P.profiles(c)
    if not (args.loo or args.leave_out):  # (the derived profiles need the fitted ones)
        profiles = P.fit_ratios({**ENGINES, **profiles}, log=log)
    out = {"coefficients": c, "profiles": profiles}
    if args.loo:
        loo = P.leave_one_out(rows, log=log)
        out["leave_one_out"] = {p.id: ratio for p, ratio in loo}
        out["leave_one_out_error"] = V.error_stats([r for _, r in loo])
        # Out of sample: the fit rows' leave-one-out predictions and the holdout rows' (never
        # fitted), each in the regime its run falls in (run on the shipped profiles).
        log("regimes: each point run once")
        runs = {r["id"]: r for r in (V.run_point(p) for p in points if p.use in ("fit", "holdout"))}
        ratios = {**{p.id: runs[p.id]["ratio"] for p in points if p.use == "holdout"},
                  **out["leave_one_out"]}
        oos = {pid: {"regime": runs[pid]["trust_regime"], "ratio": ratio, **runs[pid]["setup"]}
               for pid, ratio in ratios.items()}
        out["out_of_sample_by_regime"] = T.table(oos)
        if args.trust:
            write_atomic(args.trust, json.dumps({"points": oos}, indent=1, sort_keys=True) + "\n")
    if args.leave_out:
        folds = P.leave_group_out(rows, args.leave_out, log=log)
        out["leave_group_out"] = {
            "key": args.leave_out,
            "groups": {name: {"points": {p.id: ratio for p, ratio in pairs},
                              "error": V.error_stats([r for _, r in pairs])}
                       for name, pairs in folds},
            "error": V.error_stats([r for _, pairs in folds for _, r in pairs])}
    print(json.dumps(out, indent=2))
    return 0


def cmd_calibrate(args) -> int:
    path = Path(args.measurements)
    if not path.is_file():
        raise ScenarioError(f"{path}: no such measurement file")
    sc = _scenario(args)
    _check_writable(args.output, "-o")
    _not_an_input(args.output, "-o", [str(path), *_scenario_inputs(sc)])
    fit = calibrate(path, sc)
    text = preset_toml(fit, sc, path)
    err = fit.errors()
    if args.json:
        print(json.dumps({"coefficients": fit.coeffs, "residuals": fit.residuals,
                          "median_abs_error": float(np.median(err)),
                          "worst_abs_error": float(err.max())}, indent=2))
    else:
        for r in fit.residuals[:40]:
            print(f"{r['what']:<48} measured {r['measured'] * 1e3:>10.4g} ms  fitted "
                  f"{r['fitted'] * 1e3:>10.4g} ms  {r['error']:+.3f}")
        if len(fit.residuals) > 40:
            print(f"... {len(fit.residuals) - 40} more")
        print(f"residuals: median |fitted / measured - 1| = {np.median(err):.3f}, "
              f"worst {err.max():.3f} over {len(err)} measurements")
    if args.output:
        write_atomic(args.output, text)
        if not args.json:
            print(f"wrote {args.output}: use it with [engine] preset = \"{args.output}\"")
    elif not args.json:
        print(text, end="")
    return 0


def _file(text: str) -> str:
    """An output file name: not empty (an empty one wrote nothing, or wrote to stdout)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: an empty file name")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="servesim", description="A live simulator of an LLM serving engine.")
    p.add_argument("--version", action="version", version="servesim 0.1.0")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("run", help="open the live dashboard on a scenario")
    _add_scenario_args(s, optional=True)
    s.add_argument("--policy", choices=[*POLICIES, *DEPLOYMENT_POLICIES],
                   help="override scheduler.policy")
    s.add_argument("--speed", type=_speed, default=1.0,
                   help="simulated seconds per wall second, 1/64 to 4096 (default 1)")
    s.add_argument("--compute", choices=["none", "numpy", "cupy", "auto"], default="auto",
                   help="real attention each step (default auto: CuPy on a GPU, else NumPy)")
    s.add_argument("--replay", metavar="LOG", help="play a session log back")
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("serve", help="serve the OpenAI API (vLLM's) from the simulated engine")
    _add_scenario_args(s, optional=True)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    s.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes, as vLLM's --api-key "
                        "(default: $SERVESIM_API_KEY, else none)")
    s.add_argument("--policy", choices=list(POLICIES), help="override scheduler.policy")
    s.add_argument("--speed", type=float, default=1.0,
                   help="simulated seconds per wall second (default 1: real time)")
    s.add_argument("--compute", choices=["none", "numpy", "cupy", "auto"],
                   help="override compute.backend (real compute: the tiny model's tokens)")
    s.add_argument("--tui", action="store_true", help="serve under the live dashboard")
    s.add_argument("--background", action="store_true",
                   help="keep the scenario's own workload as background load")
    s.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients send (default: the scenario's model preset)")
    s.add_argument("--max-waiting", type=int, metavar="N",
                   help="answer 503 while N requests are waiting (default: no bound)")
    s.add_argument("--record-timing", action="store_true",
                   help="keep each token's send lateness, served at /servesim/timing")
    s.add_argument("--send-threads", type=int, choices=[1, 2], default=1,
                   help="threads that write a step's tokens to the sockets (default 1)")
    s.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                   help="close a connection with no whole request header for S seconds: idle "
                        "between requests, or sending half a header (default 5, as vLLM)")
    s.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                   help="answer 408 and close when a request body takes over S seconds "
                        "(default 60)")
    s.add_argument("--max-connections", type=int, metavar="N",
                   help="refuse (503) new connections while N are open (default: half the "
                        "open-file limit, which serve raises to 65535 where it may)")
    s.add_argument("--log", type=_file, metavar="FILE",
                   help="write the session log (msgpack) at exit, for servesim replay")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("sim", help="run a scenario headless and print its metrics")
    _add_scenario_args(s)
    s.add_argument("--policy", choices=[*POLICIES, *DEPLOYMENT_POLICIES],
                   help="override scheduler.policy")
    s.add_argument("--compute", choices=["none", "numpy", "cupy", "auto"],
                   help="override compute.backend")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--log", type=_file, metavar="FILE", help="write the session log (msgpack)")
    s.add_argument("--trust", action="store_true",
                   help="qualify the headline figures with the validated error of their regime")
    _add_quiet(s)
    s.set_defaults(func=cmd_sim)

    s = sub.add_parser("compare", help="run one trace under several policies, side by side")
    _add_scenario_args(s)
    s.add_argument("--policies", required=True, help="comma-separated policy names")
    s.add_argument("--json", action="store_true", help="print one JSON object keyed by policy")
    _add_quiet(s)
    s.set_defaults(func=cmd_compare)

    s = sub.add_parser("replay", help="re-run a session log (and check it matches)")
    s.add_argument("log", help="a session log (msgpack)")
    s.add_argument("--verify", action="store_true",
                   help="exit 1 naming the first event that differs from the recording")
    s.add_argument("--json", action="store_true")
    _add_quiet(s)
    s.set_defaults(func=cmd_replay)

    s = sub.add_parser("export", help="convert a session log for other tools")
    s.add_argument("log", help="a session log (msgpack)")
    s.add_argument("--format", required=True, choices=["chrome", "csv", "jsonl"],
                   help="chrome: trace events for Perfetto; csv: a row per request; jsonl: events")
    s.add_argument("-o", "--output", type=_file, metavar="FILE", help="write here (default: stdout)")
    _add_quiet(s)
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("scenarios", help="list the bundled scenarios")
    s.set_defaults(func=cmd_scenarios)

    s = sub.add_parser("sweep", help="run a scenario over a grid of overrides and seeds")
    _add_scenario_args(s)
    s.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="a grid axis: a scenario field (as --set names it) and its values "
                        "(repeatable; the grid is their product)")
    s.add_argument("--seeds", type=int, metavar="K", help="run seeds 0..K-1 at every point")
    s.add_argument("--slo", metavar="ttft_ms=..,tpot_ms=..,e2e_ms=..",
                   help="replace the [slo] section at every point")
    s.add_argument("-o", "--output", type=_file, metavar="FILE", help="write a CSV row per point and seed")
    s.add_argument("--workers", type=int, metavar="N",
                   help="local worker processes (default: the CPU count)")
    s.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="run on Ray: a local instance, or the cluster at ADDRESS")
    s.add_argument("--find-max-rate", action="store_true",
                   help="per point, the highest workload.rate meeting the SLOs")
    s.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet the SLOs (default 0.9)")
    s.add_argument("--tolerance", type=float, default=0.05,
                   help="relative precision of the rate search (default 0.05)")
    s.add_argument("--progress", action="store_true",
                   help="draw the progress bar even when stderr is not a terminal")
    s.add_argument("--plot", nargs="?", const="", metavar="FILE",
                   help="TTFT and TPOT (p50, p99) against achieved throughput per configuration:"
                        " to FILE.svg or FILE.png (needs servesim[plot]), or on the terminal")
    s.set_defaults(func=cmd_sweep)

    s = sub.add_parser("plan", help="the cheapest deployment that meets latency bounds")
    plan_cli.add_arguments(s)
    s.set_defaults(func=plan_cli.main)

    s = sub.add_parser("validate", help="predicted against published measurements")
    s.add_argument("points", nargs="?", default=None,
                   help="a points CSV (or a folder holding published.csv and scenarios/), or a "
                        "vllm bench serve result JSON (default: the bundled points)")
    s.add_argument("--scenario", dest="scenario", default="chat",
                   help="for a bench JSON: the deployment it ran on (default: chat)")
    s.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a field of every scenario")
    s.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    s.add_argument("--engine", help="run every point on this engine profile")
    s.add_argument("--only", metavar="ID,ID", help="only these points")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot", metavar="FILE.png|svg",
                   help="write predicted against published, log-log (needs servesim[plot])")
    s.add_argument("--fit", action="store_true",
                   help="fit the engine profiles on the use = fit points (prints JSON)")
    s.add_argument("--loo", action="store_true", help="with the fit, its leave-one-out error")
    s.add_argument("--trust", type=_file, metavar="FILE.json",
                   help="with --fit --loo: write each point's regime and out-of-sample ratio "
                        "(what `sim --trust` reads; the bundled one is "
                        "scenarios/fidelity/trust.json)")
    s.add_argument("--leave-out", choices=sorted(T.GROUPS),
                   help="with the fit, its error on each model, GPU, data type, tensor-parallel "
                        "degree or engine held out whole")
    s.set_defaults(func=cmd_validate)

    s = sub.add_parser("calibrate", help="fit an engine profile to measurements")
    s.add_argument("measurements", help="a kernel-timing CSV or a vllm bench serve result JSON")
    s.add_argument("--scenario", dest="scenario", default="chat",
                   help="the measured deployment: model, hardware, engine to start from "
                        "(default: chat)")
    s.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override any scenario field")
    s.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    s.add_argument("-o", "--output", type=_file, metavar="FILE.toml", help="write the engine profile here")
    s.add_argument("--json", action="store_true", help="print the fit as one JSON object")
    s.set_defaults(func=cmd_calibrate)

    s = sub.add_parser("bench", help="benchmarks that print figures")
    bench.add_arguments(s)
    s.set_defaults(func=cmd_bench)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP), raised where the program is, as Ctrl-C raises KeyboardInterrupt:
    the same clean-up runs (temporary files removed, sweep workers stopped), the exit is quiet
    and its code is 128 + the signal's number."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signum = signum


def _terminate(signum, frame):
    raise Terminated(signum)


class _Output:
    """Standard output that turns a failed write (a full disk, `> /dev/full`) into one line."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise ServesimError(f"standard output: cannot write: {e.strerror or e}") from None

    def flush(self) -> None:
        self.write("")
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise ServesimError(f"standard output: cannot write: {e.strerror or e}") from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what could not be
    written does not print a second error."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.__stdout__.fileno())
        os.close(fd)
    except (OSError, AttributeError, ValueError):
        pass


def _point_ids(only: str, known: set[str], spec) -> set[str]:
    """`--only`'s ids: a comma-separated list of ids and ranges (`Q1-Q50`: the points of one
    letter prefix numbered 1 to 50). ValidationError naming the first that names no point."""
    out: set[str] = set()
    for item in (x.strip() for x in only.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"([A-Za-z]+)(\d+)-\1(\d+)", item)
        if m:
            ids = {f"{m[1]}{i}" for i in range(int(m[2]), int(m[3]) + 1)} & known
        else:
            ids = {item} & known
        if not ids:
            raise V.ValidationError(f"--only {only!r}: {item!r} names no point in {spec}")
        out |= ids
    if not out:
        raise V.ValidationError(f"--only {only!r}: no such point in {spec}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:  # (not one ignored, as under nohup)
                previous[sig] = signal.signal(sig, _terminate)
    real = sys.stdout
    if args.func is not cmd_run:  # (the dashboard draws on the terminal itself)
        sys.stdout = _Output(real)
    try:
        code = args.func(args)
        sys.stdout.flush()
        return code
    except ServesimError as e:
        if str(e).startswith("standard output:"):
            _drop_stdout()
        print(f"servesim: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except Terminated as t:
        return 128 + t.signum
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _drop_stdout()
        return 0
    finally:
        sys.stdout = real
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
