"""`servesim bench ...`: benchmarks that print measured figures (never timed assertions), one
module each, with `run(args) -> dict` and `text(result) -> str`:

- `bench sim` (`sim`): the full Azure conversation trace under `chunked`, Llama-3.1-8B on one H100.
- `bench log` (`log`): session-log size per output token, the time to write and to replay-verify it.
- `bench tui` (`dashboard`): the dashboard driven headless; frame times, engine steps per second.
- `bench live-memory` (`live_memory`): the dashboard's memory against simulated time.
- `bench compute` (`compute`): engine steps per wall second with real attention.
- `bench kernel` (`kernel`): NumPy paged decode attention against a dense computation.
- `bench sweep` (`sweep`): a 16-point sweep of `chat` with 1 and with 2 local workers.
- `bench serve` (`serve`): `servesim serve` under many concurrent streams.
- `bench scale` (`scale`): wall time and memory against the number of requests.
- `bench hotpath` (`hotpath`): a profiled run: time and calls per scheduling decision.
- `bench queue` (`queue`): whole runs with 10k and 50k requests queued at once, per policy.
- `bench plan` (`plan`): `servesim plan` for a 70B model on the Azure trace, its scaling with
  workers, and its answer against an exhaustive search.

This module holds their command-line options and runs the one asked for; `common` and `memory`
hold what several share.
"""

from __future__ import annotations

import argparse
import json

from sim import load_scenario
from tui.bench import compute, hotpath, log, plan, queue, scale, serve, sweep
from tui.bench import sim as sim_bench
from tui.bench.common import comma_list, count, seconds, speed

BENCHES = {"sim": sim_bench, "log": log, "compute": compute, "sweep": sweep, "serve": serve,
           "scale": scale, "hotpath": hotpath, "queue": queue, "plan": plan}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmarks as subcommands of `p`, with their options."""
    sub = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    s = sub.add_parser("sim", help="simulate the full Azure conversation trace")
    s.add_argument("--scenario", default="azure-conv")
    s.add_argument("--policy", default="chunked")
    s.add_argument("--repeat", type=count, default=3, help="runs; the best is reported")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("log", help="session log size and write / replay-verify speed")
    s.add_argument("--scenario", default="azure-conv")
    s.add_argument("--repeat", type=count, default=3, help="rounds; the best time of each phase")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("tui", help="the dashboard, headless, on the default scenario")
    s.add_argument("--sim-seconds", type=seconds, default=60.0,
                   help="simulated seconds to run (default 60)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("live-memory", help="the dashboard's memory against simulated time, "
                                           "with real compute and without")
    s.add_argument("--scenario", default="chat")
    s.add_argument("--speed", type=speed, default=4.0, help="dashboard speed (default x4)")
    s.add_argument("--sim-seconds", type=seconds, default=300.0,
                   help="simulated seconds to run (default 300)")
    s.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE",
                   help="scenario overrides (workload.duration_s=3600: arrivals for an hour)")
    s.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="also run with the events in memory and without compute (default; "
                        "--no-compare: the real-compute run with its events on disk only)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("compute", help="engine steps per second with real attention")
    s.add_argument("--scenario", default="chat")
    s.add_argument("--backend", default="numpy", choices=["numpy", "cupy", "auto"])
    s.add_argument("--warmup", type=count, default=600, help="steps before measuring")
    s.add_argument("--steps", type=count, default=600, help="steps measured")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("kernel", help="NumPy paged decode attention vs dense")
    s.add_argument("--json", action="store_true")
    s.add_argument("--repeat", type=count, default=5)
    s.add_argument("--static", action="store_true",
                   help="CUDA kernels without a GPU: registers, spills, occupancy, main-loop SASS "
                        "instructions per 16 B (needs nvcc and cuobjdump)")
    s.add_argument("--before", default="main", help="git ref of the kernels to compare with (--static)")
    s.add_argument("--block-sizes", default="16", help="block sizes to instantiate (--static)")
    s = sub.add_parser("sweep", help="a 16-point sweep with 1 and with 2 local workers")
    s.add_argument("--duration", type=seconds, default=300.0,
                   help="simulated seconds of arrivals per point (default 300)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("serve", help="servesim serve: token send lateness with many streams")
    s.add_argument("--scenario", default="chat")
    s.add_argument("--streams", type=count, default=500, help="concurrent streams (default 500)")
    s.add_argument("--duration", type=seconds, default=30.0,
                   help="wall seconds of load (default 30)")
    s.add_argument("--prompt-tokens", type=count, default=256)
    s.add_argument("--max-tokens", type=count, default=128)
    s.add_argument("--speed", type=speed, default=1.0)
    s.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE",
                   help="scenario overrides (default: scheduler.max_num_seqs=512, so that "
                        "every stream decodes in the batch)")
    s.add_argument("--send-threads", type=int, choices=[1, 2], default=1,
                   help="the server's --send-threads (default 1)")
    s.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="give the server its own CPU and the client the others (default, where "
                        "the process may use 2 or more; --no-pin lets the kernel place both)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("scale", help="wall time and memory against the number of requests")
    s.add_argument("--scenario", default="chat")
    s.add_argument("--requests", type=comma_list(count), default=[10000, 100000, 1000000], metavar="N1,N2,...",
                   help="workload.num_requests of each run (default 10000,100000,1000000)")
    s.add_argument("--with-history", type=count, default=0, metavar="N",
                   help="also run those up to N requests keeping every request (the old way)")
    s.add_argument("--repeat", type=count, default=3, help="Azure trace runs; the best counts")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("hotpath", help="where the time goes per scheduling decision")
    s.add_argument("--scenario", default="azure-conv")
    s.add_argument("--policy", default="chunked")
    s.add_argument("--top", type=count, default=25, help="functions listed (default 25)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("queue", help="runs with 10k and 50k requests queued at once")
    s.add_argument("--queued", type=comma_list(count), default=[10000, 50000],
                   help="queue lengths (comma-separated; default 10000,50000)")
    s.add_argument("--policies", type=comma_list("policy"), default=["chunked", "sjf"],
                   help="policies (comma-separated; default chunked,sjf)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("plan", help="servesim plan: a 70B model on the Azure trace, scaling, "
                                    "and its answer against an exhaustive search")
    s.add_argument("--workers", type=count, help="local workers (default: the CPU count)")
    s.add_argument("--skip-scaling", action="store_true",
                   help="leave out the whole space's run with 1 worker")
    s.add_argument("--exhaustive", action="store_true",
                   help="check the answer against the exhaustive search of the whole space "
                        "(hours), not of a small space around it")
    s.add_argument("-o", "--output", metavar="FILE",
                   help="the exhaustive search's results (JSON lines): run again with the same "
                        "file to resume it")
    s.add_argument("--json", action="store_true")


def _bench(name: str):
    """The module of benchmark `name`."""
    if name == "tui":
        from tui.bench import dashboard  # (lazy: Textual loads only for the dashboard's benches)

        return dashboard
    if name == "live-memory":
        from tui.bench import live_memory  # (lazy: Textual loads only for the dashboard's benches)

        return live_memory
    if name == "kernel":
        from tui.bench import kernel  # (lazy: gpu loads only for bench kernel)

        return kernel
    return BENCHES[name]


def main(args) -> int:
    if getattr(args, "scenario", None) is not None:  # one line now, not a child's traceback later
        load_scenario(args.scenario)
    bench = _bench(args.bench)
    result = bench.run(args)
    print(json.dumps(result, indent=2) if args.json else bench.text(result))
    return 0
