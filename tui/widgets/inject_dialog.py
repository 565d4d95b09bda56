"""The inject dialog: prompt tokens (or a typed prompt, whose bytes are its tokens), output
tokens, priority and count. A bad value is shown inline and the dialog stays open; so is an
error from the engine, which the dialog gets back from the `submit` callback it was given.
In a short terminal (under 24 rows) its fields and buttons drop their borders, one row each, so
the whole dialog fits in 12 rows; what still does not fit scrolls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from textual.app import ComposeResult
from textual import events
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from sim.limits import MAX_TOKENS, PRIORITY_RANGE
from tui import keymap

MAX_COUNT = 10_000
SHORT_ROWS = 24  # below this many rows the dialog is compact


@dataclass(frozen=True)
class InjectSpec:
    prompt_len: int | None      # None: the length of `prompt_text` in bytes
    prompt_text: str | None
    max_output_tokens: int
    priority: int = 0
    count: int = 1


class BadValue(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _int(field: str, label: str, text: str, lo: int | None = None, hi: int | None = None) -> int:
    try:
        v = int(text.strip().replace(",", "").replace("_", ""))
    except ValueError:
        raise BadValue(field, f"{label}: {text.strip()!r} is not a whole number") from None
    shown = str(v) if len(str(v)) <= 20 else f"{str(v)[:17]}..."
    if lo is not None and v < lo:
        raise BadValue(field, f"{label}: {shown} is less than {lo:,}")
    if hi is not None and v > hi:
        raise BadValue(field, f"{label}: {shown} is more than {hi:,}")
    return v


def parse_inject(values: dict[str, str]) -> InjectSpec:
    """The dialog's fields as an InjectSpec. Raises BadValue naming the first bad field."""
    text = values.get("prompt-text", "")
    tokens = values.get("prompt-tokens", "").strip()
    if not tokens and not text:
        raise BadValue("prompt-tokens", "prompt tokens: give a positive number or type a prompt")
    prompt_len = _int("prompt-tokens", "prompt tokens", tokens, 1, MAX_TOKENS) if tokens else None
    return InjectSpec(
        prompt_len=prompt_len,
        prompt_text=text or None,
        max_output_tokens=_int("output-tokens", "output tokens",
                               values.get("output-tokens", ""), 1, MAX_TOKENS),
        priority=_int("priority", "priority", values.get("priority", "0") or "0",
                      *PRIORITY_RANGE),
        count=_int("count", "count", values.get("count", "1") or "1", 1, MAX_COUNT),
    )


FIELDS = (
    ("prompt-tokens", "prompt tokens", "a positive number (empty: the typed prompt's length)"),
    ("prompt-text", "prompt text", "optional; its bytes are its tokens"),
    ("output-tokens", "output tokens", "a positive number"),
    ("priority", "priority", "lower is more urgent"),
    ("count", "count", f"1 to {MAX_COUNT:,}"),
)


class InjectDialog(ModalScreen[InjectSpec | None]):
    BINDINGS = keymap.DIALOG_BINDINGS

    def __init__(self, submit: Callable[[InjectSpec], str | None], defaults: InjectSpec) -> None:
        super().__init__()
        self.submit = submit
        self.defaults = defaults

    def compose(self) -> ComposeResult:
        d = self.defaults
        initial = {"prompt-tokens": "" if d.prompt_len is None else str(d.prompt_len),
                   "prompt-text": d.prompt_text or "", "output-tokens": str(d.max_output_tokens),
                   "priority": str(d.priority), "count": str(d.count)}
        with VerticalScroll(id="inject-box", can_focus=False):  # the keys go to the fields
            for fid, label, hint in FIELDS:
                with Horizontal(classes="inject-row"):
                    yield Label(label, classes="inject-label")
                    yield Input(initial[fid], placeholder=hint, id=fid)
            yield Static("", id="inject-error")
            with Horizontal(id="inject-buttons"):
                yield Button("Inject", variant="primary", id="inject-ok")
                yield Button("Cancel", id="inject-cancel")

    def on_mount(self) -> None:
        self.query_one("#inject-box").border_title = "Inject requests"
        self._fit(self.app.size.height)

    def on_resize(self, event: events.Resize) -> None:
        self._fit(event.size.height)

    def _fit(self, height: int) -> None:
        compact = height < SHORT_ROWS
        self.query_one("#inject-box").set_class(compact, "-compact")
        for w in (*self.query(Input), *self.query(Button)):
            w.compact = compact

    def values(self) -> dict[str, str]:
        return {fid: self.query_one(f"#{fid}", Input).value for fid, _, _ in FIELDS}

    def show_error(self, message: str, field: str | None = None) -> None:
        self.query_one("#inject-error", Static).update(message)
        for fid, _, _ in FIELDS:
            self.query_one(f"#{fid}", Input).set_class(fid == field, "-bad")
        if field:
            self.query_one(f"#{field}", Input).focus()

    def try_submit(self) -> None:
        try:
            spec = parse_inject(self.values())
        except BadValue as e:
            self.show_error(str(e), e.field)
            return
        error = self.submit(spec)
        if error:
            self.show_error(error)
            return
        self.dismiss(spec)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.try_submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "inject-ok":
            self.try_submit()
        else:
            self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)
