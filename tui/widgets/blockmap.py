"""The KV block map: every block of the pool one cell, coloured by the request that owns it.

Free blocks are dim dots, free blocks that still hold a reusable cached prefix are rings, blocks
shared by several requests (reference count > 1) are diamonds, and the selected request's blocks
are bright. A pool larger than the panel is drawn as an overview: each cell stands for a group
of consecutive blocks and shows the most telling one (selected, then shared, then used, then
cached), so where the requests sit stays visible without scrolling through thousands of rows. The grid is a Line API widget: a row's strip is built once with NumPy run-length
segments and cached until a block in that row changes, so a refresh of thousands of blocks costs
the few rows that changed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget

from sim import EngineSnapshot
from tui.widgets.colors import REQUEST_COLORS

FREE, FREE_CACHED, SELECTED = 0, 1, 2
USED, SHARED = 16, 48  # + colour index
NCOLORS = len(REQUEST_COLORS)

GLYPH_USED, GLYPH_SHARED, GLYPH_FREE, GLYPH_CACHED = "█", "◆", "·", "∘"


def block_codes(owner: np.ndarray, refs: np.ndarray, cached: np.ndarray | None,
                highlight: int | None) -> np.ndarray:
    """One drawing code per block (see FREE, USED, ...)."""
    used = owner >= 0
    codes = np.where(used, USED + owner % NCOLORS, FREE).astype(np.int16)
    shared = refs > 1
    if shared.any():
        codes[shared] = SHARED + owner[shared] % NCOLORS
    if cached is not None:
        codes[cached & ~used] = FREE_CACHED
    if highlight is not None:
        codes[owner == highlight] = SELECTED
    return codes


# How telling each code is when several blocks share one cell.
_RANK = np.zeros(SHARED + NCOLORS, dtype=np.int8)
_RANK[FREE_CACHED] = 1
_RANK[USED:USED + NCOLORS] = 2
_RANK[SHARED:SHARED + NCOLORS] = 3
_RANK[SELECTED] = 4


def aggregate(codes: np.ndarray, group: int) -> np.ndarray:
    """One code per `group` consecutive blocks: the most telling block's (first among equals)."""
    if group <= 1:
        return codes
    n = -(-len(codes) // group) * group
    padded = np.full(n, FREE, dtype=codes.dtype)
    padded[:len(codes)] = codes
    cells = padded.reshape(-1, group)
    return cells[np.arange(len(cells)), _RANK[cells].argmax(axis=1)]


def fragmentation(snap: EngineSnapshot) -> int:
    """Allocated token slots that hold no token: used blocks x block size - tokens held."""
    return max(0, snap.used_blocks * snap.block_size - snap.token_slots_used)


class BlockGrid(ScrollView, can_focus=False):
    """The cells of the block map (scrolled with the mouse: the arrow keys move between the
    queues and the event log)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.codes = np.zeros(0, dtype=np.int16)
        self._cols = 0
        self._gutter = 0
        self._strips: dict[int, Strip] = {}
        self._styles: dict[int, tuple[str, Style]] = {}
        self._base: Style | None = None
        self.num_blocks = 0
        self.group = 1  # blocks per cell

    def update_blocks(self, owner: np.ndarray, refs: np.ndarray,
                      cached: np.ndarray | None = None, highlight: int | None = None) -> None:
        self._style_table(self.rich_style)  # once per update; render_line reuses it
        if len(owner) != self.num_blocks:
            self.num_blocks = len(owner)
            self._layout()
        codes = aggregate(block_codes(owner, refs, cached, highlight), self.group)
        if len(codes) != len(self.codes):
            self._strips.clear()
            self.codes = codes
            self._layout()
            self.refresh()
            return
        changed = np.flatnonzero(codes != self.codes)
        self.codes = codes
        if len(changed) and self._cols:
            top = self.scroll_offset.y
            bottom = top + self.scrollable_content_region.height
            for row in np.unique(changed // self._cols).tolist():
                self._strips.pop(row, None)
                if top <= row < bottom:
                    self.refresh_line(row)

    def _layout(self) -> None:
        region = self.scrollable_content_region
        width = region.width
        n = self.num_blocks
        self._gutter = len(str(max(n - 1, 0))) + 1 if width >= 40 else 0
        cols = max(1, width - self._gutter)
        if cols >= 16:
            cols -= cols % 8  # rows start at round block ids
        group = max(1, -(-n // (cols * max(1, region.height))))
        if cols != self._cols or group != self.group:
            self._strips.clear()
            self.codes = np.zeros(0, dtype=np.int16)  # recomputed at the next update
        self._cols = cols
        self.group = group
        self.virtual_size = Size(width, -(-(-(-n // group)) // cols))

    def on_resize(self) -> None:
        self._strips.clear()
        self._layout()

    def _style_table(self, base: Style) -> dict[int, tuple[str, Style]]:
        if base != self._base:
            self._base = base
            self._strips.clear()
            dim = base + Style(color="grey35")
            t = {FREE: (GLYPH_FREE, dim),
                 FREE_CACHED: (GLYPH_CACHED, base + Style(color="#5f87af")),
                 SELECTED: (GLYPH_USED, base + Style(color="bright_white", bold=True))}
            for i, c in enumerate(REQUEST_COLORS):
                t[USED + i] = (GLYPH_USED, base + Style(color=c))
                t[SHARED + i] = (GLYPH_SHARED, base + Style(color=c, bold=True))
            self._styles = t
        return self._styles

    def render_line(self, y: int) -> Strip:
        styles = self._styles or self._style_table(self.rich_style)
        row = self.scroll_offset.y + y
        strip = self._strips.get(row)
        if strip is None:
            strip = self._render_row(row, styles)
            self._strips[row] = strip
        return strip

    def _render_row(self, row: int, styles) -> Strip:
        width = self.scrollable_content_region.width
        cols = self._cols or 1
        a = row * cols
        seg = self.codes[a:a + cols]
        if not len(seg):
            return Strip.blank(width, self._base)
        out = []
        if self._gutter:  # the first block id of the row
            out.append(Segment(f"{a * self.group:>{self._gutter - 1}} ", styles[FREE][1]))
        cuts = (np.flatnonzero(seg[1:] != seg[:-1]) + 1).tolist()
        start = 0
        vals = seg.tolist()
        for end in cuts + [len(vals)]:
            glyph, style = styles[vals[start]]
            out.append(Segment(glyph * (end - start), style))
            start = end
        return Strip(out).adjust_cell_length(width, self._base)


@dataclass(frozen=True)
class KVFigures:
    """What the lines above the grid say."""
    used: int
    total: int
    frag: int       # allocated token slots holding no token
    alloc: int      # allocated token slots
    shared: int
    cached: int
    group: int      # blocks per cell


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole if whole else 0:.1f}%"


@functools.lru_cache(maxsize=16)  # (asked for by the layout and the drawing, each frame)
def stats_lines(f: KVFigures, width: int) -> tuple[Text, ...]:
    """The lines above the grid, as many as `width` needs (2, or 3 when narrow): usage,
    fragmentation, sharing, the scale of a cell and the legend, none of them cut where the
    narrow wording fits."""
    scale = f"1 cell = {f.group} blocks" if f.group > 1 else ""
    usage = Text(no_wrap=True, overflow="ellipsis")
    usage.append(f"{f.used:,}/{f.total:,} ", style="bold")
    usage.append(_pct(f.used, f.total))
    usage.append(" · frag ")
    usage.append(f"{f.frag:,}", style="bold")
    wide = usage.copy()
    wide.append(f" slots {_pct(f.frag, f.alloc)} · shared {f.shared} · cached {f.cached}")
    usage.append(f" ({_pct(f.frag, f.alloc)})")
    sharing = Text(" · ".join(x for x in (scale, f"shared {f.shared} · cached {f.cached}") if x),
                   no_wrap=True, overflow="ellipsis")
    variants = (
        [wide, _legend(scale, LEGEND)],
        [usage, sharing, _legend("", LEGEND)],
        [usage, sharing, _legend("", LEGEND_SHORT)],
    )
    for lines in variants:
        if all(line.cell_len <= width for line in lines):
            return tuple(lines)
    return tuple(variants[-1])


# (glyph, style) pairs and the word, of each entry of the legend: full and short
_USED, _SELECTED = (GLYPH_USED, REQUEST_COLORS[0]), (GLYPH_USED, "bold bright_white")
_SHARED, _FREE = (GLYPH_SHARED, REQUEST_COLORS[1]), (GLYPH_FREE, "grey35")
_CACHED = (GLYPH_CACHED, "#5f87af")
LEGEND = ((_USED, (GLYPH_USED, REQUEST_COLORS[3]), "request"), (_SELECTED, "selected"),
          (_SHARED, "shared"), (_FREE, "free"), (_CACHED, "free, cached"))
LEGEND_SHORT = ((_USED, "req"), (_SELECTED, "sel"), (_SHARED, "shared"), (_FREE, "free"),
                (_CACHED, "cached"))


def _legend(scale: str, entries) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    if scale:
        t.append(scale + " · ", style="bold")
    sep = "  " if entries is LEGEND else " "
    for i, (*glyphs, word) in enumerate(entries):
        for glyph, style in glyphs:
            t.append(glyph, style=style)
        t.append((" " if entries is LEGEND else "") + word + (sep if i < len(entries) - 1 else ""))
    return t


class BlockStats(Widget):
    """Usage, fragmentation, the cell scale and the legend, two or three lines by the width. (Not
    a Static: updating one re-lays the screen out.)"""

    figures: KVFigures | None = None

    def show(self, figures: KVFigures) -> None:
        rows = self._lines_for(self.size.width)
        self.figures = figures
        self.refresh(layout=len(self._lines_for(self.size.width)) != len(rows))

    def _lines_for(self, width: int) -> tuple[Text, ...]:
        return () if self.figures is None else stats_lines(self.figures, width)

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(2, len(self._lines_for(width)))

    def render(self) -> Text:
        return Text("\n").join(self._lines_for(self.size.width))


class BlockMap(Vertical):
    """The KV panel: usage and fragmentation, a legend, and the grid."""

    def compose(self) -> ComposeResult:
        self.stats = BlockStats(id="kv-stats")
        self.grid = BlockGrid(id="kv-grid")
        yield self.stats
        yield self.grid

    def on_mount(self) -> None:
        self.border_title = "KV cache blocks"
        self._stats_key = None

    def show(self, snap: EngineSnapshot, highlight: int | None) -> None:
        """Draw `snap`'s blocks, `highlight`'s (a request id) bright."""
        cached = getattr(snap, "block_cached", None)  # per-block marks, where the engine has them
        self.grid.update_blocks(snap.block_owner, snap.block_refs, cached, highlight)
        shared = int(np.count_nonzero(snap.block_refs > 1))
        key = (snap.used_blocks, snap.num_blocks, snap.token_slots_used, shared,
               snap.free_cached_blocks, self.grid.group)
        if key != self._stats_key:
            self._stats_key = key
            self.stats.show(self.figures(snap, shared, self.grid.group))

    @staticmethod
    def figures(snap: EngineSnapshot, shared: int, group: int = 1) -> KVFigures:
        return KVFigures(snap.used_blocks, snap.num_blocks, fragmentation(snap),
                         snap.used_blocks * snap.block_size, shared, snap.free_cached_blocks,
                         group)
