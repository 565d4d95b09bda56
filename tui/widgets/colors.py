"""Colours shared by the panels: one per request id, so a request's row in the queues and its
blocks in the KV map have the same colour."""

from __future__ import annotations

REQUEST_COLORS = (
    "#e06c75", "#98c379", "#e5c07b", "#61afef", "#c678dd", "#56b6c2",
    "#d19a66", "#ff79c6", "#7ec699", "#f08d49", "#a0a1ff", "#b8bb26",
)


def request_color(req_id: int) -> str:
    return REQUEST_COLORS[req_id % len(REQUEST_COLORS)]
