"""The latency-throughput picture of a sweep (`servesim sweep --plot`): TTFT and TPOT (p50 and
p99) against achieved throughput, one curve per configuration, with the SLO bounds as lines and
`--find-max-rate`'s answer marked. Drawn by matplotlib to an SVG or PNG file (the `plot` extra),
or with characters on the terminal.

A configuration is a grid point with its `workload.rate` and seed left out: its runs at
different rates are the points of its curve, and the runs of several seeds at one rate are
averaged into one point. With `--find-max-rate` the curve is every rate the search probed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sim.errors import ScenarioError
from sim.fileio import save_figure

X = "throughput_requests_per_s"
PANELS = [("TTFT", "ttft", "ttft_ms"), ("TPOT", "tpot", "tpot_ms")]  # (title, metric, SLO field)
FORMATS = (".svg", ".png")


@dataclass
class Curve:
    """One configuration: points (throughput, {column: value}) in the order of their offered
    rate (past saturation, achieved throughput may fall back as the rate grows)."""

    label: str
    points: list[tuple[float, dict]] = field(default_factory=list)
    marked: tuple[float, dict] | None = None  # the highest rate that met the SLOs
    max_rate: float | None = None


def curves(table) -> list[Curve]:
    """The curves of a sweep's or a rate search's Table (sim.deploy.sweep)."""
    runs = table.probes if table.probes is not None else table
    config_keys = [k for k in runs.key_columns if k not in ("workload.rate", "seed")]
    groups: dict[tuple, dict] = {}
    for r in runs.rows:
        config = tuple(r.get(k) for k in config_keys)
        groups.setdefault(config, {}).setdefault(r.get("workload.rate"), []).append(r)
    answers = {}
    if table.probes is not None:  # find_max_rate: its answer per configuration
        for r in table.rows:
            answers[tuple(r.get(k) for k in config_keys)] = r.get("max_rate")
    out = []
    for config, by_rate in groups.items():
        label = ", ".join(f"{k}={v}" for k, v in zip(config_keys, config)) or "run"
        c = Curve(label, max_rate=answers.get(config))
        for rate in sorted(by_rate, key=lambda x: (x is None, x)):
            p = _mean_point(by_rate[rate])
            if p is None:
                continue
            c.points.append(p)
            if rate is not None and rate == c.max_rate:
                c.marked = p
        out.append(c)
    return out


def _mean_point(rows: list[dict]) -> tuple[float, dict] | None:
    """The mean over seeds of the throughput and each latency (None: no throughput)."""
    xs = [r[X] for r in rows if r.get(X) is not None]
    if not xs:
        return None
    ys = {}
    for _, metric, _ in PANELS:
        for q in ("p50", "p99"):
            col = f"{metric}_{q}_ms"
            vals = [r[col] for r in rows if r.get(col) is not None]
            ys[col] = sum(vals) / len(vals) if vals else None
    return sum(xs) / len(xs), ys


def slo_bounds(plan) -> dict[str, list[float]]:
    """The distinct SLO bounds (ms) of the plan's points, per SLO field."""
    out: dict[str, list[float]] = {}
    for _, _, name in PANELS:
        vals = sorted({getattr(pt.scenario.slo, name) for pt in plan.points} - {0, 0.0})
        out[name] = vals
    return out


def check_output(path: str) -> None:
    """Fail before the sweep, not after: a wrong suffix or no matplotlib.

    Raises ScenarioError with one line."""
    if not path.lower().endswith(FORMATS):
        raise ScenarioError(f"--plot {path}: the file must end in .svg or .png "
                            "(or give no file to draw on the terminal)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ScenarioError(f"--plot {path}: drawing a file needs matplotlib: "
                            "pip install 'servesim[plot]' (or give no file to draw on the "
                            "terminal)") from None


# --- a file (matplotlib) -------------------------------------------------------------------------
def write_plot(path: str, cs: list[Curve], slos: dict, title: str) -> None:
    """Draw the curves to `path` (.svg or .png)."""
    import matplotlib  # (lazy: the optional `plot` extra, only to draw a file)

    matplotlib.use("Agg")  # no display needed (before pyplot loads)
    import matplotlib.pyplot as plt  # (lazy: as matplotlib)
    import matplotlib.ticker  # (lazy: as matplotlib)

    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 4.8), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, metric, slo_field) in zip(axes, PANELS):
        for i, c in enumerate(cs):
            color = colors[i % len(colors)]
            for q, style, marker in (("p99", "-", "s"), ("p50", "--", "o")):
                pts = [(x, y[f"{metric}_{q}_ms"]) for x, y in c.points
                       if y[f"{metric}_{q}_ms"] is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker,
                            color=color, markersize=4, label=f"{c.label} {q}")
            if c.marked is not None and c.marked[1][f"{metric}_p99_ms"] is not None:
                ax.plot([c.marked[0]], [c.marked[1][f"{metric}_p99_ms"]], marker="*",
                        color=color, markersize=16, markeredgecolor="black", linestyle="none",
                        label=f"{c.label}: max rate {c.max_rate:g} req/s")
        for bound in slos.get(slo_field, []):
            ax.axhline(bound, color="red", linestyle=":", linewidth=1.2)
            ax.annotate(f"SLO {bound:g} ms", (0.01, bound), xycoords=("axes fraction", "data"),
                        color="red", fontsize=8, va="bottom")
        ax.set_yscale("log")
        lo, hi = ax.get_ylim()
        g = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(g)  # 20, 50, 100 rather than 2x10^1
        ax.yaxis.set_minor_formatter(g if hi / lo < 10 else matplotlib.ticker.NullFormatter())
        ax.set_xlabel("achieved throughput (requests/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} p50 (dashed) and p99 (solid)")
        ax.grid(True, which="both", alpha=0.3)
    axes[-1].legend(fontsize=7, loc="best")
    fig.suptitle(title)
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)


# --- the terminal --------------------------------------------------------------------------------
def text_plot(cs: list[Curve], slos: dict, width: int = 64, height: int = 14) -> str:
    """The curves drawn with characters: per panel, each configuration's p99 as its letter
    (A, B, ...) and p50 in lower case joined by dots, '*' at the max-rate answer, a row of '-'
    at the SLO; a logarithmic latency axis and a linear throughput axis."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    xs = [x for c in cs for x, _ in c.points]
    if not xs:
        return "(no run finished a request: nothing to plot)"
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo * 0.9, x_hi * 1.1 + 1e-9
    blocks = []
    for name, metric, slo_field in PANELS:
        vals = [y[f"{metric}_{q}_ms"] for c in cs for _, y in c.points for q in ("p50", "p99")]
        vals = [v for v in vals if v is not None and v > 0]
        bounds = slos.get(slo_field, [])
        if not vals:
            blocks.append(f"{name}: no values")
            continue
        y_lo, y_hi = min(vals + bounds), max(vals + bounds)
        if y_hi <= y_lo * 1.0001:
            y_lo, y_hi = y_lo / 1.5, y_hi * 1.5
        ly_lo, ly_hi = math.log10(y_lo), math.log10(y_hi)
        grid = [[" "] * width for _ in range(height)]

        def cell(x, y):
            col = round((x - x_lo) / (x_hi - x_lo) * (width - 1))
            row = round((ly_hi - math.log10(y)) / (ly_hi - ly_lo) * (height - 1))
            return min(max(row, 0), height - 1), min(max(col, 0), width - 1)

        for b in bounds:
            r, _ = cell(x_lo, b)
            grid[r] = ["-" if ch == " " else ch for ch in grid[r]]
        for c in cs:  # the curves' segments first, as dots under the points
            for q in ("p50", "p99"):
                pts = [cell(x, y[f"{metric}_{q}_ms"]) for x, y in c.points
                       if y[f"{metric}_{q}_ms"] is not None and y[f"{metric}_{q}_ms"] > 0]
                for (r0, k0), (r1, k1) in zip(pts, pts[1:]):
                    n = max(abs(r1 - r0), abs(k1 - k0), 1)
                    for j in range(1, n):
                        r, k = round(r0 + (r1 - r0) * j / n), round(k0 + (k1 - k0) * j / n)
                        if grid[r][k] in " -":
                            grid[r][k] = "."
        for i, c in enumerate(cs):
            letter = letters[i % len(letters)]
            for q, ch in (("p50", letter.lower()), ("p99", letter)):
                for x, y in c.points:
                    v = y[f"{metric}_{q}_ms"]
                    if v is not None and v > 0:
                        r, k = cell(x, v)
                        grid[r][k] = ch
            if c.marked is not None and (v := c.marked[1][f"{metric}_p99_ms"]):
                r, k = cell(c.marked[0], v)
                grid[r][k] = "*"
        labels = {0: y_hi, height - 1: y_lo, (height - 1) // 2: 10 ** ((ly_hi + ly_lo) / 2)}
        lines = [f"{name} (ms, log scale; p99 upper case, p50 lower case"
                 + (", '-' SLO " + ", ".join(f"{b:g}" for b in bounds) if bounds else "") + ")"]
        for r, row in enumerate(grid):
            tick = f"{labels[r]:9.4g}" if r in labels else " " * 9
            lines.append(f"{tick} |{''.join(row)}")
        lines.append(" " * 9 + " +" + "-" * width)
        lo_text, hi_text = f"{x_lo:.4g}", f"{x_hi:.4g}"
        lines.append(" " * 11 + lo_text + hi_text.rjust(width - len(lo_text))
                     + "  achieved throughput (req/s)")
        blocks.append("\n".join(lines))
    legend = [f"  {letters[i % len(letters)]}/{letters[i % len(letters)].lower()}  {c.label}"
              + (f"  (* max rate {c.max_rate:g} req/s)" if c.marked is not None else "")
              for i, c in enumerate(cs)]
    return "\n\n".join(blocks) + "\n" + "\n".join(legend)
