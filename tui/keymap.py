"""Every key of the dashboard in one place: the app's bindings, the queue tables', the dialogs',
and the rows of the help screen, all derived from the same table."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class Key:
    key: str          # Textual key name(s), comma-separated
    action: str
    label: str        # short, for the footer
    help: str         # one line, for the help screen
    display: str = ""  # how the key is written on screen
    show: bool = True  # shown in the footer

    def binding(self) -> Binding:
        return Binding(self.key, self.action, self.label, show=self.show,
                       key_display=self.display or None)


APP_KEYS = (
    Key("question_mark", "help", "Help", "this screen: every key", "?"),
    Key("space", "pause", "Pause", "pause / resume the simulated clock", "space"),
    Key("n", "step", "Step", "run exactly one engine step (pauses first if running)"),
    Key("plus,equals_sign", "faster", "Faster", "double the speed (simulated s per wall s)", "+"),
    Key("minus", "slower", "Slower", "halve the speed", "-"),
    Key("i", "inject", "Inject",
        "inject one request, lengths drawn from the scenario's workload"),
    Key("I", "inject_dialog", "Inject…", "inject dialog: prompt tokens or text, output, priority, "
        "count", "I"),
    Key("b", "burst", "Burst", "inject a burst of 32 requests arriving now"),
    Key("c", "cancel", "Cancel", "cancel the selected request (waiting or running)"),
    Key("C", "cancel_waiting", "Cancel queue", "cancel every waiting request", "C"),
    Key("p", "cycle_policy", "Policy", "switch to the next scheduling policy (from the next step)"),
    Key("r", "next_instance", "Instance",
        "several instances: show the next one's KV blocks in the block map", show=False),
    Key("e", "export", "Export",
        "export the session log (msgpack); `servesim run --replay LOG` plays it back"),
    Key("q", "quit", "Quit", "quit"),
)

# (the queues and the event log move between panels alike)
FOCUS_KEYS = (
    Key("left", "app.focus_previous", "Prev panel", "previous panel: queue or event log (also "
        "shift+tab)", "←", show=False),
    Key("right", "app.focus_next", "Next panel", "next panel (also tab)", "→", show=False),
)

TABLE_KEYS = (
    Key("up", "cursor(-1)", "Up", "move the selection up", "↑", show=False),
    Key("down", "cursor(1)", "Down", "move the selection down", "↓", show=False),
    Key("pageup", "page(-1)", "Page up", "move the selection a page up", "PgUp", show=False),
    Key("pagedown", "page(1)", "Page down", "move the selection a page down", "PgDn", show=False),
    Key("home", "cursor_to(0)", "First", "select the first request", "Home", show=False),
    Key("end", "cursor_to(-1)", "Last", "select the last request", "End", show=False),
)

LOG_KEYS = (
    Key("up", "scroll_by(-1)", "Up", "scroll up a line (the log stops following)", "↑",
        show=False),
    Key("down", "scroll_by(1)", "Down", "scroll down a line", "↓", show=False),
    Key("pageup", "page(-1)", "Page up", "scroll a page up", "PgUp", show=False),
    Key("pagedown", "page(1)", "Page down", "scroll a page down", "PgDn", show=False),
    Key("home", "scroll_to(0)", "Oldest", "the oldest line", "Home", show=False),
    Key("end", "scroll_to(-1)", "Newest", "the newest line, following again", "End", show=False),
)

CLOSE_KEYS = (
    Key("escape,question_mark,q", "close", "Close", "close this screen", "esc"),
)

DIALOG_KEYS = (
    Key("escape", "close", "Cancel", "close the dialog without injecting", "esc"),
)

APP_BINDINGS = [k.binding() for k in APP_KEYS]
TABLE_BINDINGS = [k.binding() for k in TABLE_KEYS + FOCUS_KEYS]
LOG_BINDINGS = [k.binding() for k in LOG_KEYS + FOCUS_KEYS]
CLOSE_BINDINGS = [k.binding() for k in CLOSE_KEYS]
DIALOG_BINDINGS = [k.binding() for k in DIALOG_KEYS]

BURST_SIZE = 32


def help_rows() -> list[tuple[str, str, str]]:
    """(section, key as displayed, what it does) for every key of the dashboard."""
    rows = [("dashboard", k.display or k.key, k.help) for k in APP_KEYS]
    rows += [("queues", k.display or k.key, k.help) for k in TABLE_KEYS + FOCUS_KEYS]
    rows += [("event log", k.display or k.key, k.help) for k in LOG_KEYS]
    rows += [("dialogs", "esc", "close a dialog or this screen"),
             ("dialogs", "enter", "submit the inject dialog")]
    return rows
