"""The event log: request state transitions from the engine's event stream and the user's
actions, newest last, bounded. Engine-step events are not listed (the charts show them).
It follows the newest line until the user scrolls up (keys once focused, or the mouse wheel);
scrolled up, the lines in view stay put as new ones arrive; `end` follows again."""

from __future__ import annotations

from collections import deque

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tui import keymap

MAX_LINES = 1000
MAX_PER_UPDATE = 200  # at high speed, list only the newest of a refresh's events

TAG_COLORS = {
    "arrival": "#61afef", "admit": "#98c379", "first_token": "#56b6c2", "finish": "#7ec699",
    "cancel": "#e5c07b", "preempt": "#e06c75", "reject": "#ff5f5f", "action": "#c678dd",
    "note": "#a0a1ff", "route": "#d19a66", "handoff": "#ff79c6",
}


def _action_text(action: str, a: dict) -> str:
    if action == "inject":
        n = a.get("count", 1)
        text = f"inject {n} x prompt {a.get('prompt_len')} output {a.get('max_output_tokens')}"
        if a.get("priority"):
            text += f" priority {a['priority']}"
        return text + (" (typed prompt)" if a.get("prompt_text") is not None else "")
    if action == "cancel":
        return f"cancel #{a.get('req_id')}"
    if action == "cancel_waiting":
        return "cancel every waiting request"
    if action == "switch_policy":
        return f"policy {a.get('previous')} -> {a.get('policy')}"
    return f"{action} {a}"


def _arrival(e) -> str:
    text = f"#{e.req_id} arrives: prompt {e.prompt_len:,}, output {e.max_output_tokens:,}"
    if e.priority:
        text += f", priority {e.priority}"
    return text + (" (injected)" if e.injected else "")


def _handoff(e) -> str:
    if e.phase == "ready":
        return f"#{e.req_id} first token: leaves prefill, waits for decode room ({e.blocks} blocks)"
    if e.phase == "start":
        return (f"#{e.req_id} K/V transfer of {e.blocks} blocks, "
                f"{(e.end - e.t) * 1e3:,.2f} ms")
    if e.phase == "sent":
        return f"#{e.req_id} transfer done: prefill frees {e.blocks} blocks"
    return f"#{e.req_id} joined the decode batch"


DESCRIBE = {
    "arrival": _arrival,
    "reject": lambda e: f"#{e.req_id} rejected: {e.reason}",
    "admit": lambda e: f"#{e.req_id} {'resumed' if e.resumed else 'admitted'}",
    "first_token": lambda e: f"#{e.req_id} first token",
    "preempt": lambda e: f"#{e.req_id} preempted ({e.mode})",
    "finish": lambda e: f"#{e.req_id} finished",
    "cancel": lambda e: f"#{e.req_id} cancelled while {e.state} (by {e.by})",
    "action": lambda e: f"{_action_text(e.action, e.args)} (step {e.step})",
    "route": lambda e: f"#{e.req_id} -> instance {e.instance} ({e.why})",
    "handoff": _handoff,
}


def describe(e) -> str | None:
    """One line for an engine event (None for the events the log does not list)."""
    fn = DESCRIBE.get(e.kind)
    return None if fn is None else fn(e)


class EventLog(ScrollView, can_focus=True):
    """A bounded, tail-following list of timestamped lines."""

    BINDINGS = keymap.LOG_BINDINGS

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.lines: deque[tuple[float, str, str]] = deque(maxlen=MAX_LINES)
        self._styles: dict[str, tuple[Style, Style, Style]] | None = None

    def on_mount(self) -> None:
        self.border_title = "Events"

    def add_events(self, events) -> None:
        """List the new engine events (any number; the newest MAX_PER_UPDATE are kept)."""
        rows = []
        for e in events:
            text = describe(e)
            if text is not None:
                rows.append((e.t, e.kind, text))
        self.add_rows(rows)

    def add_rows(self, rows) -> None:
        """(time, kind, text) lines; the newest MAX_PER_UPDATE are kept."""
        if len(rows) > MAX_PER_UPDATE:
            skipped = len(rows) - MAX_PER_UPDATE
            rows = rows[-MAX_PER_UPDATE:]
            rows.insert(0, (rows[0][0], "note", f"... {skipped:,} earlier events not listed"))
        self._extend(rows)

    def add_tagged(self, pairs, tags: list[str]) -> None:
        """List the new events of a deployment: (instance, event) pairs, instance -1 being the
        deployment's own (its routing and the user's actions), each line tagged with where it
        happened, in time order."""
        rows = []
        for i, e in sorted(pairs, key=lambda p: p[1].t):
            if i >= 0 and e.kind == "action":
                continue  # the deployment's own line says it once
            text = describe(e)
            if text is not None:
                rows.append((e.t, e.kind, f"{tags[i]} {text}" if i >= 0 else text))
        self.add_rows(rows)

    def add_note(self, t: float, text: str) -> None:
        """A line of the dashboard's own (pause, speed, export)."""
        self._extend([(t, "note", text)])

    def _extend(self, rows) -> None:
        if not rows:
            return
        self._styles = None  # resolved again once per update, not once per line
        y = self.scroll_offset.y
        follow = y >= self.max_scroll_y
        dropped = max(0, len(self.lines) + len(rows) - MAX_LINES)  # off the top
        self.lines.extend(rows)
        self.virtual_size = Size(self.scrollable_content_region.width, len(self.lines))
        if follow:
            y = len(self.lines) - self.scrollable_content_region.height
        else:
            y -= dropped  # the lines in view stay in view
        self.scroll_to(y=max(0, y), animate=False, force=True)
        self.refresh()

    def _scroll_y(self, y: int) -> None:
        top = max(0, len(self.lines) - self.scrollable_content_region.height)
        self.scroll_to(y=max(0, min(y, top)), animate=False, force=True)

    def action_scroll_by(self, lines: int) -> None:
        self._scroll_y(self.scroll_offset.y + lines)

    def action_page(self, direction: int) -> None:
        self.action_scroll_by(direction * max(1, self.scrollable_content_region.height - 1))

    def action_scroll_to(self, where: int) -> None:
        """0: the oldest line; -1: the newest (following it again)."""
        self._scroll_y(0 if where == 0 else len(self.lines))

    def _kind_styles(self, kind: str) -> tuple[Style, Style, Style]:
        """(time, tag, text) styles of a line of this kind."""
        if self._styles is None:
            self._styles = {"": self.rich_style}
        styles = self._styles.get(kind)
        if styles is None:
            base = self._styles[""]
            styles = self._styles[kind] = (
                base + Style(dim=True), base + Style(color=TAG_COLORS.get(kind), bold=True),
                base + Style(color=TAG_COLORS["note"]) if kind == "note" else base)
        return styles

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        i = self.scroll_offset.y + y
        if i >= len(self.lines):
            return Strip.blank(width, self._kind_styles("note")[2])
        t, kind, text = self.lines[i]
        tag = "user" if kind == "action" else ("" if kind == "note" else kind.replace("_", " "))
        time_style, tag_style, text_style = self._kind_styles(kind)
        return Strip([
            Segment(f"{t:10.3f}s ", time_style),
            Segment(f"{tag:<12}", tag_style),
            Segment(text, text_style),
        ]).adjust_cell_length(width, text_style)
