"""Real compute for a run: the `gpu` executor a scenario's `[compute]` section asks for, built
for the engine (`sim.build(..., make_executor=make_executor)`). The command line, the dashboard,
the server and the benchmarks share it.

`gpu` is imported only when a scenario asks for real compute, so a pure simulation never loads
it (nor CuPy)."""

from __future__ import annotations

from sim.errors import ScenarioError
from sim.limits import check_memory
from sim.model.costmodel import CostModel


def make_executor(scenario):
    """The executor the scenario's `[compute]` asks for, or None for the pure simulation.

    Raises ScenarioError (one line) when the backend is unavailable or the sizes are wrong.
    """
    c = scenario.compute
    if c.backend == "none":
        return None
    from gpu import BackendUnavailable  # (lazy: gpu loads only for real compute)
    from gpu.executor import ModelExecutor  # (lazy: gpu loads only for real compute)

    sizes = {k: getattr(c, k) for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim")
             if getattr(c, k)}
    if c.dtype != "auto":
        sizes["dtype"] = c.dtype
    host = (CostModel(scenario).num_host_blocks()
            if scenario.scheduler.preemption == "swap" else 0)
    _check_kv_memory(scenario, sizes, host)
    try:
        return ModelExecutor.with_defaults(
            scenario.kv.num_blocks, scenario.kv.block_size, backend=c.backend,
            vocab_size=c.vocab_size, mlp=c.mlp, num_experts=c.num_experts,
            experts_per_token=c.experts_per_token, seed=scenario.seed,
            verify_every=c.verify_every, num_host_blocks=host, **sizes)
    except BackendUnavailable as e:
        raise ScenarioError(f"compute.backend = {c.backend!r}: {e}") from None
    except ValueError as e:
        raise ScenarioError(f"[compute]: {e}") from None
    except MemoryError:
        raise ScenarioError(
            f"compute: a pool of kv.num_blocks = {scenario.kv.num_blocks} blocks does not fit in "
            "memory at these compute sizes; lower kv.num_blocks or compute.head_dim") from None


def _check_kv_memory(scenario, sizes: dict, host_blocks: int) -> None:
    """With NumPy, the tiny model's K/V pool (and its host swap slots) lives in this process's
    memory, allocated lazily: check it fits before the run fills it, not when the OOM killer
    comes. (A CUDA pool that does not fit fails at once, as a MemoryError.)"""
    from gpu import BackendUnavailable, get_backend  # (lazy: gpu loads only for real compute)
    from gpu.executor import CPU_MODEL, ModelExecutor  # (lazy: gpu loads only for real compute)

    try:
        name = get_backend(scenario.compute.backend).name
    except (BackendUnavailable, ValueError):
        return  # reported as one line when the executor is built
    if name != "numpy":
        return
    dims = {**CPU_MODEL, **sizes}
    per = ModelExecutor.block_bytes(scenario.kv.block_size, num_layers=dims["num_layers"],
                                    num_kv_heads=dims["num_kv_heads"],
                                    head_dim=dims["head_dim"], dtype=dims["dtype"])
    n = scenario.kv.num_blocks
    check_memory(f"compute.backend = \"numpy\" with kv.num_blocks = {n}", (n + host_blocks) * per,
                 f" for the tiny model's K/V ({per:,} bytes a block)")
