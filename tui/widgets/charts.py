"""Charts over time: rolling TTFT and ITL (p50, p99), output tokens/s, batch size, the queue
lengths (waiting, running), preemptions per second and KV usage, as vLLM's Grafana dashboard
charts its scheduler state and preemptions.

The app samples `sim.rolling` on its chart tick, with the engine's preemption count, and hands
each sample here; the panel keeps its own bounded history and draws one bar sparkline per series
(eighth blocks, several rows tall when there is room; when there are fewer rows than series, the
most telling series, in PRIORITY order). Strips are rebuilt only when a sample arrives or the
size changes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from tui.widgets import fmt

BARS = " ▁▂▃▄▅▆▇█"
LABEL_WIDTH = 19
HISTORY = 600


@dataclass(frozen=True)
class Series:
    key: str                       # field of `sim.rolling`'s dict
    label: str
    show: Callable[[float | None], str]
    color: str
    top: float | None = None       # fixed scale; None = the largest value shown


def _pct(x):
    return "-" if x is None or x != x else f"{100 * x:.1f}%"


SERIES = (
    Series("ttft_p50_ms", "TTFT p50", fmt.ms, "#61afef"),
    Series("ttft_p99_ms", "TTFT p99", fmt.ms, "#c678dd"),
    Series("itl_p50_ms", "ITL p50", fmt.ms, "#56b6c2"),
    Series("itl_p99_ms", "ITL p99", fmt.ms, "#e06c75"),
    Series("output_tokens_per_s", "tokens/s", lambda x: fmt.num(x), "#98c379"),
    Series("batch_mean", "batch", lambda x: fmt.num(x, 1), "#e5c07b"),
    Series("waiting", "waiting", lambda x: fmt.num(x), "#e5c07b"),
    Series("running", "running", lambda x: fmt.num(x), "#98c379"),
    Series("preemptions_per_s", "preempt/s", lambda x: fmt.num(x, 1), "#e06c75"),
    Series("kv_usage", "KV usage", _pct, "#d19a66", top=1.0),
)
# Which series a short panel keeps, most telling first (they are drawn in SERIES order).
PRIORITY = ("ttft_p99_ms", "itl_p99_ms", "output_tokens_per_s", "waiting", "running",
            "preemptions_per_s", "kv_usage", "ttft_p50_ms", "itl_p50_ms", "batch_mean")


def shown_series(rows: int) -> list[Series]:
    """The series a panel of `rows` rows draws, in drawing order."""
    keep = set(PRIORITY[:max(1, rows)])
    return [s for s in SERIES if s.key in keep]


def _levels(values: list[float], top: float, steps: int) -> list[int]:
    out = []
    for v in values:
        if v != v:
            out.append(-1)
        else:
            lv = int(round(v / top * steps)) if top > 0 else 0
            out.append(max(1 if v > 0 else 0, min(steps, lv)))
    return out


class Charts(Widget):
    """Sparklines of the rolling figures, newest on the right."""

    def __init__(self, window_s: float, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.window_s = window_s
        self.history = {s.key: deque(maxlen=HISTORY) for s in SERIES}
        self.latest: dict = {}
        self._lines: list[Strip] = []
        self._built_for = None
        self._preempted: tuple[float, int] | None = None  # the last sample's (t, count)

    def add_sample(self, sample: dict, preemptions: int | None = None) -> None:
        """Append one `sim.rolling(...)` result, with the engine's preemption count so far
        (charted as preemptions per simulated second since the previous sample)."""
        if preemptions is not None:
            t, last = sample["t"], self._preempted
            rate = None
            if last is not None:
                rate = (preemptions - last[1]) / (t - last[0]) if t > last[0] else 0.0
            self._preempted = (t, preemptions)
            sample = {**sample, "preemptions_per_s": rate}
        for s in SERIES:
            v = sample.get(s.key)
            self.history[s.key].append(math.nan if v is None else float(v))
        self.latest = sample
        self._built_for = None
        self.refresh()

    def _build(self, width: int, height: int) -> list[Strip]:
        base = self.rich_style
        dim = base + Style(dim=True)
        series = shown_series(height)
        hidden = len(SERIES) - len(series)
        titles = (f"Rolling {self.window_s:g} s (simulated)",
                  f"+{hidden} series when taller" if hidden else "")
        if titles != (self.border_title, self.border_subtitle):
            self.border_title, self.border_subtitle = titles
        rows = max(1, height // len(series))
        spark_w = max(0, width - LABEL_WIDTH)
        lines = []
        for s in series:
            values = list(self.history[s.key])[-spark_w:] if spark_w else []
            finite = [v for v in values if v == v]
            top = s.top if s.top is not None else (max(finite) if finite else 1.0)
            levels = _levels(values, top, rows * 8)
            color = base + Style(color=s.color)
            for k in range(rows):
                floor = (rows - 1 - k) * 8
                if k == 0:
                    head = f"{s.label:<9}{s.show(self.latest.get(s.key)):>9} "
                    head_style = base + Style(bold=True)
                elif k == 1 and s.top is None:
                    head, head_style = f"{'max':>9}{s.show(top if finite else None):>9} ", dim
                else:
                    head, head_style = " " * LABEL_WIDTH, base
                bars = "".join(" " if lv < 0 else BARS[max(0, min(8, lv - floor))]
                               for lv in levels)
                strip = Strip([Segment(head[:width], head_style), Segment(bars, color)])
                lines.append(strip.adjust_cell_length(width, base))
        return lines

    def render_line(self, y: int) -> Strip:
        width, height = self.size
        if self._built_for != (width, height):
            self._lines = self._build(width, height)
            self._built_for = (width, height)
        if y < len(self._lines):
            return self._lines[y]
        return Strip.blank(width, self.rich_style)
