"""servesim's terminal front end: the command line (`tui.cli`), the live Textual dashboard
(`tui.app` and its widgets, driven by `tui.driver`), real compute (`tui.compute`), the benchmarks
(`tui.bench`) and the HTTP server (`tui.serve`). Textual is imported only by the dashboard
modules, so headless commands start fast."""

import os

# One OpenBLAS thread unless the user says otherwise (read when NumPy loads, hence here, before
# any import of it). The NumPy attention multiplies many small matrices per step; OpenBLAS
# threads woken for each cost more than they give (`servesim bench compute` shows it).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
