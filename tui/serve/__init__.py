"""`servesim serve`: vLLM's OpenAI-compatible HTTP server in front of the simulated engine.

`protocol` (request checks, response bodies, error bodies), `frontend` (the engine on the wall
clock, token times from its events, sends), `metrics` (`/metrics` under vLLM's names), `http`
(aiohttp routes and the server), `app` (headless serving), `dashboard` (`--tui`). Its benchmark,
`servesim bench serve`, is `tui.bench.serve`. Imports `sim` only (and `tui` for the dashboard),
never the reverse.
"""
