"""The status line: running or paused, the simulated clock, the speed asked for and the speed
achieved, the last action's feedback (while the event log is hidden), the server's URL, the
workload's concurrency or rate, then scenario, policy, compute backend and step; a warning when
compute cannot keep up. The essentials come first, so that a narrow terminal cuts only the
rest."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.widget import Widget

from tui.widgets import fmt


@dataclass(frozen=True)
class HeaderInfo:
    scenario: str
    policy: str
    compute: str          # "numpy on cpu", "none (modeled)"
    now: float            # simulated seconds
    step: int
    speed: float
    paused: bool
    lag_s: float = 0.0    # how far the engine's clock is behind the target (simulated s)
    replay: str | None = None  # the log being played back
    finished: bool = False     # a replay that reached its end
    achieved: float | None = None  # simulated s per wall s actually run, lately
    note: str | None = None    # the last action's feedback
    url: str | None = None     # `servesim serve`'s address
    load: str = ""             # the workload's concurrency or rate ("concurrency 32", "4 req/s")


LAG_WARN_S = 1.0
SLOW_SHARE = 0.9  # an achieved speed under this share of the asked one is shown in red


class StatusHeader(Widget):
    """The line at the top of the screen. (Not a Static: updating one re-lays the screen out.)"""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._shown: HeaderInfo | None = None
        self._text = Text()

    def show(self, info: HeaderInfo) -> None:
        if info != self._shown:
            self._shown = info
            self._text = self.render_info(info)
            self.refresh()

    def render(self) -> Text:
        return self._text

    @staticmethod
    def render_info(h: HeaderInfo) -> Text:
        t = Text(no_wrap=True, overflow="ellipsis")
        lagging = h.lag_s > LAG_WARN_S
        if h.finished:
            t.append(" ENDED ", style="bold reverse #98c379")
        elif lagging:
            t.append(f" LAG {h.lag_s:,.1f} s ", style="bold reverse #ff5f5f")
        elif h.paused:
            t.append(" PAUSED ", style="bold reverse #e5c07b")
        else:
            t.append(" RUNNING ", style="bold reverse #98c379")
        t.append(" t ")
        t.append(f"{h.now:,.3f} s", style="bold #61afef")
        t.append(" · ")
        t.append(fmt.speed(h.speed), style="bold")
        if h.achieved is not None:
            slow = h.achieved < SLOW_SHARE * h.speed
            t.append(f" got {fmt.achieved(h.achieved)}",
                     style="bold #ff5f5f" if slow else "#98c379")
        if h.note:
            t.append(" · ")
            t.append(h.note, style="bold #c678dd")
        if h.url:
            t.append(" · ")
            t.append(h.url, style="bold #61afef")
        if h.load:
            t.append(f" · {h.load}", style="bold #56b6c2")
        t.append(f" · {h.scenario}", style="bold")
        t.append(" · ")
        t.append(h.policy, style="bold #e5c07b")
        t.append(" · ")
        t.append(h.compute, style="bold")
        t.append(f" · step {h.step:,}")
        if h.replay:
            t.append(f" replay {h.replay}", style="italic")
        if lagging:
            t.append(f"  ⚠ {h.lag_s:,.1f} s behind: compute cannot keep up with "
                     f"{fmt.speed(h.speed)}", style="bold #ff5f5f")
        return t
