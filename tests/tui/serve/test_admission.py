"""`serve` answers a request refused by admission control (`[admission]`) with 429."""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import pytest

from sim import load_scenario
from tui.serve.app import build_frontend
from tui.serve.protocol import APIError, parse_generate


def test_a_request_over_the_rate_limit_is_a_429():
    async def main():
        fe = build_frontend(load_scenario("chat", ["admission.rate=0.001"]))
        fe.clock.set(0.0, paused=True)
        calls = [fe.submit(parse_generate({"prompt": "a", "max_tokens": 2}, chat=False), "t",
                           0.0) for _ in range(2)]
        fe.turn()
        assert calls[0].accepted.result() is True
        with pytest.raises(APIError) as err:
            calls[1].accepted.result()
        assert err.value.status == HTTPStatus.TOO_MANY_REQUESTS
        assert "admission.rate" in err.value.message
    asyncio.run(main())
