"""The request queues: waiting, running and recently done, one `RequestTable` each.

A table draws only its visible rows (Textual's Line API), so a queue of thousands costs what a
screenful costs. The cursor follows its request across refreshes. The user selects the request
under the cursor by moving it or by moving to the table; that request is the target of cancel and
is highlighted in the KV block map. A refresh never selects anything: when the selected request
leaves the table the cursor rests on a neighbour, which is not selected until the user moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from sim import RequestView
from tui import keymap
from tui.widgets import fmt
from tui.widgets.colors import request_color


@dataclass(frozen=True)
class Column:
    title: str
    width: int
    cell: Callable[[RequestView, float], str]
    left: bool = False
    min_width: int | None = None  # a text column that may narrow to this (cut with …)
    optional: bool = False        # a column a narrow panel leaves out


def fit_columns(columns, width: int) -> list[tuple[Column, int]]:
    """The columns a panel `width` cells wide shows, and each one's width: all of them, the
    text columns narrowed as far as needed; when that is not enough, without the optional ones
    (the last first)."""
    cols = list(columns)
    while True:
        widths = [c.width for c in cols]
        over = sum(widths) + len(cols) - 1 - width
        for i in reversed(range(len(cols))):
            if over > 0 and cols[i].min_width is not None:
                cut = min(over, widths[i] - cols[i].min_width)
                widths[i] -= cut
                over -= cut
        optional = [c for c in cols if c.optional]
        if over <= 0 or not optional:
            return list(zip(cols, widths))
        cols.remove(optional[-1])


def _cell(text: str, width: int, left: bool) -> str:
    if len(text) > width:
        return text[:max(0, width - 1)] + "…"
    return text.ljust(width) if left else text.rjust(width)


def _phase(r: RequestView, now: float) -> str:
    if r.state == "transferring":
        return "K/V to decode"
    if r.is_prefill:
        return f"prefill {r.num_computed_tokens}/{r.prompt_len + r.num_output_tokens}"
    return f"decode {r.num_output_tokens}/{r.max_output_tokens}"


def _ttft(r: RequestView, now: float) -> str:
    return "-" if r.first_token_time is None else fmt.dur(r.first_token_time - r.arrival_time)


def _e2e(r: RequestView, now: float) -> str:
    return "-" if r.finish_time is None else fmt.dur(r.finish_time - r.arrival_time)


_ID = Column("id", 6, lambda r, now: str(r.req_id))

COLUMNS = {
    "waiting": (
        _ID,
        Column("prompt", 7, lambda r, now: f"{r.prompt_len:,}"),
        Column("wait", 8, lambda r, now: fmt.dur((now if r.clock is None else r.clock)
                                                 - r.arrival_time)),
        Column("prio", 5, lambda r, now: str(r.priority), optional=True),
    ),
    "running": (
        _ID,
        Column("phase", 18, _phase, left=True, min_width=13),
        Column("blocks", 6, lambda r, now: str(r.num_blocks), optional=True),
        Column("TTFT", 8, _ttft),
    ),
    "recent": (
        _ID,
        Column("state", 9, lambda r, now: r.state, left=True, min_width=6),
        Column("TTFT", 8, _ttft),
        Column("E2E", 8, _e2e, optional=True),
        Column("tokens", 6, lambda r, now: str(r.num_output_tokens)),
    ),
}

TITLES = {"waiting": "Waiting", "running": "Running", "recent": "Finished / cancelled"}


class RequestTable(ScrollView, can_focus=True):
    """One queue of requests with a sticky header row and a cursor."""

    BINDINGS = keymap.TABLE_BINDINGS
    COMPONENT_CLASSES = {"request-table--header", "request-table--cursor",
                         "request-table--cursor-blurred"}

    class Highlighted(Message):
        """The user moved the cursor, or moved to the table: `req_id` is the selected request."""

        def __init__(self, table: "RequestTable", req_id: int | None) -> None:
            super().__init__()
            self.table = table
            self.req_id = req_id

    class WantRows(Message):
        """The table needs more of the queue than its last update brought (`end`): the app
        updates it at once rather than at the next frame."""

    def __init__(self, kind: str, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id or kind, classes=classes)
        self.kind = kind
        self.columns = COLUMNS[kind]
        self.rows: list[RequestView] = []
        self.total = 0  # the queue's length (`rows` may hold only its first part)
        self._to_end = False  # `end` was pressed before the whole queue was here
        self.now = 0.0
        self.cursor = 0
        self._fitted: tuple[int, list[tuple[Column, int]]] | None = None  # (width, columns)
        self._styles: dict[str, Style] = {}
        self._view = None  # what the last repaint showed
        self._tags: list[str] | None = None
        self._quiet_focus = False  # the next focus is the program's, not the user's
        self.border_title = TITLES[kind]

    def set_tags(self, tags: list[str]) -> None:
        """A deployment of several instances: each id is shown after its instance's tag."""
        self._tags = tags
        first = Column("id", max(len(t) for t in tags) + 6, _ID.cell)
        self.columns = (first, *COLUMNS[self.kind][1:])
        self._fitted = None

    def show_clients(self) -> None:
        """`servesim serve`: a last column naming who sent each request (the client's
        address; `-` for the scenario's own workload)."""
        self.columns = (*self.columns, Column("client", 21, lambda r, now: r.tag or "-",
                                              left=True, min_width=15))
        self._fitted = None

    def fitted(self) -> list[tuple[Column, int]]:
        """The columns shown at the panel's width, and their widths."""
        width = self.scrollable_content_region.width
        if self._fitted is None or self._fitted[0] != width:
            self._fitted = (width, fit_columns(self.columns, width))
        return self._fitted[1]

    @property
    def selected_id(self) -> int | None:
        return self.rows[self.cursor].req_id if self.rows else None

    def rows_wanted(self) -> int | None:
        """How many of the queue's first rows the next update needs: those in view or up to
        the cursor, and two pages more for the cursor keys (None: all, for `end`)."""
        if self._to_end:
            return None
        height = max(1, self.scrollable_content_region.height)
        return max(self.scroll_offset.y + height, self.cursor + 1) + 2 * height

    def update_rows(self, rows: list[RequestView], now: float, total: int | None = None) -> None:
        """Show `rows` (a snapshot's list, or its first `rows_wanted()` of `total`) at simulated
        time `now`, keeping the cursor on its request when that request is still listed.
        Repaints only when what is in view changed."""
        before = self.selected_id
        self.rows, self.now = rows, now
        self.total = len(rows) if total is None else total
        if before is not None:
            for i, r in enumerate(rows):
                if r.req_id == before:
                    self.cursor = i
                    break
        self.cursor = max(0, min(self.cursor, len(rows) - 1))
        if self._to_end and len(rows) == self.total:
            self._to_end = False
            self._move_to(len(rows) - 1)
        self.virtual_size = Size(self.scrollable_content_region.width, self.total + 1)
        title = f"{TITLES[self.kind]} ({self.total})"
        if title != self.border_title:
            self.border_title = title
        self._styles.clear()  # resolved again once per refresh, not once per line
        top = self.scroll_offset.y
        view = (top, self.cursor, [self._text(r) for r in
                                   rows[top:top + self.scrollable_content_region.height]])
        if view != self._view:
            self._view = view
            self.refresh()

    # --- cursor -------------------------------------------------------------------------------
    def _move_to(self, i: int) -> None:
        if not self.rows:
            return
        self.cursor = max(0, min(i, len(self.rows) - 1))
        height = self.scrollable_content_region.height
        y = self.scroll_offset.y
        if self.cursor < y:
            y = self.cursor
        elif self.cursor > y + height - 2:
            y = self.cursor - height + 2
        self.scroll_to(y=y, animate=False)
        self.refresh()
        self.post_message(self.Highlighted(self, self.selected_id))

    def action_cursor(self, delta: int) -> None:
        self._move_to(self.cursor + delta)

    def action_page(self, direction: int) -> None:
        self._move_to(self.cursor + direction * max(1, self.scrollable_content_region.height - 1))

    def action_cursor_to(self, index: int) -> None:
        if index < 0 and len(self.rows) < self.total:
            self._to_end = True  # the next update brings the whole queue, then moves there
            self.post_message(self.WantRows())
            return
        self._move_to(index if index >= 0 else len(self.rows) - 1)

    def focus_quietly(self) -> None:
        """Focus the table without selecting its cursor's request (the app's first focus)."""
        self._quiet_focus = True
        self.focus()

    def on_focus(self) -> None:
        self._styles.clear()
        self.refresh()
        if self._quiet_focus:
            self._quiet_focus = False
        else:
            self.post_message(self.Highlighted(self, self.selected_id))

    def on_blur(self) -> None:
        self._styles.clear()
        self.refresh()

    # --- drawing ------------------------------------------------------------------------------
    def _style(self, name: str) -> Style:
        """The base style, or the base plus a component class's (cached until the next
        refresh: resolving CSS styles per line would cost more than drawing the line)."""
        style = self._styles.get(name)
        if style is None:
            base = self._styles.get("")
            if base is None:
                base = self._styles[""] = self.rich_style
            style = base if not name else base + self.get_component_rich_style(name)
            self._styles[name] = style
        return style

    def _text(self, r: RequestView) -> tuple[str, str]:
        """The id cell and the rest of a row."""
        (_, id_width), *rest = self.fitted()
        text = " ".join(_cell(c.cell(r, self.now), w, c.left) for c, w in rest)
        rid = str(r.req_id) if self._tags is None else f"{self._tags[r.replica]}:{r.req_id}"
        return rid.rjust(id_width), " " + text

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        base = self._style("")
        if y == 0:
            head = " ".join(_cell(c.title, w, c.left) for c, w in self.fitted())
            style = self._style("request-table--header")
            return Strip([Segment(head, style)]).adjust_cell_length(width, style)
        i = self.scroll_offset.y + y - 1
        if i >= len(self.rows):
            return Strip.blank(width, base)
        r = self.rows[i]
        id_text, rest = self._text(r)
        if i == self.cursor:
            style = self._style("request-table--cursor" if self.has_focus
                                else "request-table--cursor-blurred")
            id_style = style
        else:
            style = base
            id_style = base + Style(color=request_color(r.req_id), bold=True)
        return Strip([Segment(id_text, id_style), Segment(rest, style)]).adjust_cell_length(
            width, style)
