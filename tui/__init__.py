"""servesim's terminal front end: the command line (`tui.cli`), the live Textual dashboard
(`tui.app` and its widgets) and the benchmarks (`tui.bench`). Textual is imported only by the
dashboard modules, so headless commands start fast."""
