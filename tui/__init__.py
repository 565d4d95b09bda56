"""servesim's terminal front end: the command line (`tui.cli`), the live Textual dashboard
(`tui.app` and its widgets) and the benchmarks (`tui.bench`). Textual is imported only by the
dashboard modules, so headless commands start fast."""

import os

# One OpenBLAS thread unless the user says otherwise (read when NumPy loads, hence here, before
# any import of it). The NumPy attention multiplies many small matrices per step; OpenBLAS
# threads woken for each cost more than they give: measured side by side on the 2-core machine,
# `bench compute` ran 3-4x slower in wall time with them (12-15 s vs 45-63 s for 200 steps).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
