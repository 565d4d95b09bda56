"""The help screen: every key of the dashboard, from the keymap."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from tui import keymap


class HelpScreen(ModalScreen[None]):
    BINDINGS = keymap.CLOSE_BINDINGS

    def compose(self) -> ComposeResult:
        rows = keymap.help_rows()
        key_w = max(len(key) for _, key, _ in rows)
        text = Text(no_wrap=True, overflow="ellipsis")
        section = None
        for sec, key, line in rows:
            if sec != section:
                text.append(("" if section is None else "\n") + sec + "\n", style="bold underline")
                section = sec
            text.append(f"  {key:<{key_w}}  ", style="bold #e5c07b")
            text.append(line + "\n")
        text.rstrip()
        with VerticalScroll(id="help-box"):
            yield Static(text, id="help-keys")
            yield Static("esc, ? or q closes this screen", id="help-close")

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = "Keys"

    def action_close(self) -> None:
        self.dismiss(None)
