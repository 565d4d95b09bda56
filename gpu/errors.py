"""The exception families of the `gpu` package, one per kind of failure."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """An exception's message as one line (its first), or its type's name when it has none:
    CuPy's and NVRTC's errors run to many lines (a compile log)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe(exc: BaseException) -> str:
    """An exception as a report shows it: its type's name and the first line of its message."""
    return f"{type(exc).__name__}: {first_line(exc)}"


class BackendUnavailable(RuntimeError):
    """A compute backend was asked for by name but cannot run here (no CuPy, no CUDA device).

    The message is one line naming the backend and the reason, fit for a CLI's stderr.
    """


class KernelError(RuntimeError):
    """A CUDA kernel failed to compile or launch, or faulted while running.

    The message names the kernel, its launch configuration and the CUDA error.
    """


class VerifyError(AssertionError):
    """The paged cache or a sampled token disagrees with a dense recomputation of a request.

    Attributes name the request and where the first disagreement is: `req_id`, `layer`,
    `position`, `logical_block` and `physical_block` (the last four are None for a token mismatch).
    """

    def __init__(self, message: str, *, req_id: int, layer: int | None = None,
                 position: int | None = None, logical_block: int | None = None,
                 physical_block: int | None = None) -> None:
        super().__init__(message)
        self.req_id = req_id
        self.layer = layer
        self.position = position
        self.logical_block = logical_block
        self.physical_block = physical_block
