"""How hard the fuzzers try: a few seconds each in CI, as long as you like on demand.

`SERVESIM_FUZZ=N` multiplies every fuzzer's number of examples by N (default 1), e.g.
`SERVESIM_FUZZ=200 .venv/bin/python -m pytest -q -m fuzz --hypothesis-show-statistics`
for a long run that prints how many inputs each fuzzer tried.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = max(1.0, float(os.environ.get("SERVESIM_FUZZ", "1") or 1))


def fuzz_settings(examples: int, **kw) -> settings:
    """Hypothesis settings for a fuzzer that tries `examples` inputs in CI (times SCALE)."""
    return settings(max_examples=int(examples * SCALE), deadline=None,
                    suppress_health_check=list(HealthCheck), **kw)
