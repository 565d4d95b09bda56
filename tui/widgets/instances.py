"""The instances of a deployment (replicas, or disaggregated prefill and decode instances) side by
side: one compact row each with its policy, batch, queue, a KV usage bar, output tokens per
second since the previous frame, and the requests routed to it. Hidden for a single engine."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from tui.widgets import fmt

BAR = 8
MAX_ROWS = 8


def instance_tags(instances) -> list[str]:
    """A short tag per instance for the queues and the event log: `P`/`D` (with the instance
    number where there are several of the role), or the replica number."""
    roles = [v.role for v in instances]
    tags = []
    for v in instances:
        tag = {"prefill": "P", "decode": "D"}.get(v.role)
        tags.append(str(v.index) if tag is None
                    else tag if roles.count(v.role) == 1 else f"{tag}{v.index}")
    return tags


def _bar(used: int, total: int) -> str:
    share = used / total if total else 0.0
    n = round(share * BAR)
    if used and not n:
        n = 1
    return "█" * n + "·" * (BAR - n)


class InstanceRows(Widget):
    """A row per instance of a `ClusterSnapshot` (`show`); the instance whose KV blocks the map
    shows is marked."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._text = Text()
        self._lines: list[Text] = []
        self._last: dict[int, tuple[float, int]] = {}  # index -> (clock, output tokens)
        self._rates: dict[int, float] = {}

    def on_mount(self) -> None:
        self.border_title = "Instances"

    def show(self, snap, ttft_ms: dict[int, float | None] | None = None) -> None:
        """Draw `snap.instances` (a ClusterSnapshot's), with each one's rolling TTFT p50 (ms,
        by instance index) where known."""
        for v in snap.instances:
            last = self._last.get(v.index)
            if last is not None and v.now > last[0]:
                self._rates[v.index] = (v.output_tokens - last[1]) / (v.now - last[0])
            if last is None or v.now > last[0]:
                self._last[v.index] = (v.now, v.output_tokens)
        ttft_ms = ttft_ms or {}
        width = self.content_region.width
        for form in ({}, {"counts": False}, {"compact": True}):  # the fullest that fits
            text = self.render_rows(snap, self._rates, ttft_ms, **form)
            if not width or max(map(len, text.plain.split("\n"))) <= width:
                break
        if text.plain != self._text.plain:
            self._text = text
            rows = len(self._lines)
            self._lines = text.split("\n")
            self.refresh(layout=len(self._lines) != rows)
        title = f"Instances ({len(snap.instances)}; {snap.policy})"
        if snap.transferring:
            title += f" · {snap.transferring} handing off"
        if title != self.border_title:
            self.border_title = title

    @staticmethod
    def render_rows(snap, rates: dict[int, float], ttft_ms: dict[int, float | None],
                    counts: bool = True, compact: bool = False) -> Text:
        """A line per instance (the first MAX_ROWS): tag, role (a disaggregated pair's), batch,
        queue, KV usage, TTFT p50, output tokens per second, requests sent to it and finished
        there (unless not `counts`). `compact`, for a narrow panel: a header line over bare
        columns, no usage bar, no request counts."""
        t = Text()
        tags = instance_tags(snap.instances)
        shown = snap.instances[:MAX_ROWS]
        if compact:
            t.append("     run wait  KV   TTFT  tok/s\n", style="bold")
        for v, tag in zip(shown, tags):
            mark = "▶" if v.index == snap.focus else " "
            t.append(f"{mark}{tag:>2} ", style="bold")
            share = v.used_blocks / v.num_blocks if v.num_blocks else 0.0
            ttft = fmt.ms(ttft_ms.get(v.index))
            tokens = fmt.num(rates.get(v.index))
            if compact:
                t.append(f"{v.running:>4} {v.waiting:>4} {share:>4.0%} {ttft:>6} ")
                t.append(f"{tokens:>6}", style="#98c379")
                t.append("\n")
                continue
            if v.role != "replica":
                t.append(f"{v.role:<7} ", style="#e5c07b")
            t.append(f"run {v.running:>3} wait {v.waiting:>3} KV ")
            t.append(_bar(v.used_blocks, v.num_blocks), style="#61afef")
            t.append(f" {share:>4.0%} TTFT {ttft:>6} ")
            t.append(f"{tokens:>6} tok/s", style="#98c379")
            if counts:
                t.append(f" in {v.routed:,} done {v.finished:,}")
            t.append("\n")
        if len(snap.instances) > MAX_ROWS:
            t.append(f"   … {len(snap.instances) - MAX_ROWS} more instances")
        else:
            t.rstrip()
        return t

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(1, len(self._lines))

    def render(self) -> Text:
        # One screen line per instance: cut at the panel's width, never wrapped.
        width = max(1, self.content_region.width)
        return Text("\n").join(_cut(line, width) for line in self._lines)


def _cut(line: Text, width: int) -> Text:
    line = line.copy()
    line.truncate(width, overflow="ellipsis")
    return line
