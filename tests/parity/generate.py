"""Golden traces from vLLM's own V1 scheduler, for `test_parity.py` (run by hand, not in CI).

Drives `vllm.v1.core.sched.scheduler.Scheduler` (or `AsyncScheduler`) and its `KVCacheManager`
on the CPU with no model, as vLLM's `tests/v1/core/utils.py` does: a local model config, and a
fabricated `ModelRunnerOutput` for every step (one sampled token for each request whose step
reaches the end of its known tokens). For each request stream and configuration below it
stores, per scheduler step, the requests scheduled with their token counts (in batch order),
the preemptions, the requests whose last token that step computed, and the blocks in use, with
the stream itself and the vLLM version, as gzip JSON.

Needs vLLM in a virtualenv of its own, outside the repository (about 3 GB with the CPU torch):

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0          # the CPU build
    /work/vllm-venv/bin/pip install --no-deps vllm==0.33.0 # then its import-time dependencies
    VLLM_TARGET_DEVICE=cpu /work/vllm-venv/bin/python tests/parity/generate.py

`--out DIR --seeds 7 8 --requests 500` (and `--blocks`, `--block-size`, `--max-num-seqs`,
`--budget`) writes extra traces elsewhere, for checks that are not stored; `python -m
tests.parity.compare DIR` replays any directory of traces through servesim. An older release
installed with `pip install --no-deps --target DIR vllm==X` runs with `PYTHONPATH=DIR`.

The clock, shared with the replay: every step that computes tokens takes 1.0; a request arrives
before the first step that starts at or after its arrival time, and a client abort takes effect
at the same boundary (after the arrivals, in (time, id) order); with nothing to run, the clock
jumps to the next arrival. Arrival and abort times are real numbers, so none falls exactly on a
step boundary. With async scheduling the engine core's batch queue (depth 2) is
followed exactly as `EngineCore.step_with_batch_queue` runs it: step k+1 is scheduled before
step k's output is processed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import sys
import tempfile
from collections import deque
from pathlib import Path

MAX_MODEL_LEN = 16384
OUT_TOKEN_BASE = 200_000  # output tokens: one value per request, so output blocks never match
PROMPT_TOKEN_BASE = 100_000  # a request's own prompt tokens: one value per request
HERE = Path(__file__).resolve().parent


# --- request streams -----------------------------------------------------------------------------
def make_stream(kind: str, seed: int, n: int) -> dict:
    """A request stream: each request's arrival time, prompt length, output length, priority,
    shared-prefix group (-1: none) and client abort time (None: never)."""
    rng = random.Random(f"{kind}-{seed}")
    prefix = 256 if kind in ("shared", "mixed") else 0
    groups = 3
    reqs = []
    t = 0.0
    for i in range(n):
        if kind in ("staggered", "mixed", "aborts", "abort-storm") and rng.random() > 0.25:
            # real-valued times never meet the clock's step ends (integers from the last
            # idle jump), so nothing hangs on which side of a step boundary an arrival falls
            t += rng.uniform(0.0, 12.0 if kind == "abort-storm" else 3.0)
        if rng.random() < 0.6:
            prompt = rng.randint(20, 600)
        else:
            prompt = rng.randint(600, 3000)
        output = rng.randint(1, 40) if rng.random() < 0.3 else rng.randint(1, 500)
        if kind == "abort-storm":  # short outputs, most aborted: aborts meet every state
            prompt, output = rng.randint(20, 1200), rng.randint(1, 60)
        group = -1
        if prefix and rng.random() < 0.8:
            group = rng.randrange(groups)
            # some prompts are the system prompt alone, so whole prompts repeat exactly
            prompt = prefix if rng.random() < 0.15 else prefix + rng.randint(1, 1500)
        prio = rng.randrange(4) if kind in ("priority", "mixed") else 0
        cancel = None
        if kind in ("aborts", "mixed") and rng.random() < 0.25:
            cancel = t + rng.choice([0.0, rng.uniform(0, 3), rng.uniform(3, 50),
                                     rng.uniform(50, 500)])
        if kind == "abort-storm" and rng.random() < 0.7:
            # near the step computing the last token: aborts of requests just finishing
            cancel = t + max(0.0, output + prompt // 512 + rng.uniform(-3.0, 2.0))
        reqs.append([i, t, prompt, output, prio, group, cancel])
    return {"kind": kind, "seed": seed, "prefix_tokens": prefix, "requests": reqs}


def prompt_tokens(req: list, prefix: int) -> list[int]:
    i, _, prompt, _, _, group, _ = req
    shared = min(prefix, prompt) if group >= 0 else 0
    head = [1 + (group * 1009 + 7 * j) % 30000 for j in range(shared)]
    return head + [PROMPT_TOKEN_BASE + i] * (prompt - shared)


# --- configurations ------------------------------------------------------------------------------
# `reserve_full_isl`, `watermark` and `async_scheduling` are vLLM's own settings; vLLM 0.33.0's
# defaults are True, 0.0 and (on GPUs) True.
DEFAULTS = dict(block_size=16, num_blocks=400, max_num_seqs=64, max_num_batched_tokens=512,
                prefix_caching=False, async_scheduling=True, policy="fcfs",
                reserve_full_isl=True, watermark=0.0)
CONFIGS: dict[str, tuple[str, dict]] = {
    # name: (stream kind, settings other than DEFAULTS)
    "burst-512": ("burst", {}),
    "burst-2048": ("burst", {"max_num_batched_tokens": 2048}),
    "burst-2048-roomy": ("burst", {"max_num_batched_tokens": 2048, "num_blocks": 2000}),
    "shared-512": ("shared", {"prefix_caching": True}),
    "shared-2048-roomy": ("shared", {"prefix_caching": True, "max_num_batched_tokens": 2048,
                                     "num_blocks": 2000}),
    "staggered-512": ("staggered", {"prefix_caching": True}),
    "aborts-2048": ("aborts", {"max_num_batched_tokens": 2048}),
    "abort-storm-512": ("abort-storm", {"prefix_caching": True, "num_blocks": 300}),
    "priority-512": ("priority", {"policy": "priority"}),
    "mixed-2048": ("mixed", {"prefix_caching": True, "max_num_batched_tokens": 2048,
                             "policy": "priority"}),
    "watermark-512": ("staggered", {"watermark": 0.02}),
    # One step at a time (vLLM without async scheduling, as on CPUs or with it turned off).
    "sync-shared-512": ("shared", {"prefix_caching": True, "async_scheduling": False}),
    "sync-mixed-2048": ("mixed", {"prefix_caching": True, "max_num_batched_tokens": 2048,
                                  "policy": "priority", "async_scheduling": False}),
    # The admission gate off: a waiting request needs blocks for its first chunk only.
    "chunk-gate-burst-512": ("burst", {"reserve_full_isl": False, "async_scheduling": False}),
    "chunk-gate-shared-2048": ("shared", {"reserve_full_isl": False, "prefix_caching": True,
                                          "max_num_batched_tokens": 2048}),
}
STORED_SEEDS = (1, 2)
STORED_REQUESTS = 300


# --- driving vLLM's scheduler --------------------------------------------------------------------
def use_cpu_platform() -> None:
    """Older releases (0.23.0 among them) find the CPU platform only in a CPU build of vLLM:
    name it for them."""
    import vllm.platforms as platforms

    if getattr(platforms, "_current_platform", None) is None:
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()


def build_scheduler(cfg: dict):
    use_cpu_platform()
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager
    import torch

    model_dir = Path(tempfile.mkdtemp(prefix="parity-model-"))
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 300_000, "max_position_embeddings": MAX_MODEL_LEN,
        "torch_dtype": "float16", "rms_norm_eps": 1e-5}))
    knobs = dict(scheduler_reserve_full_isl=cfg["reserve_full_isl"], watermark=cfg["watermark"])
    fields = SchedulerConfig.__dataclass_fields__
    for k, v in list(knobs.items()):  # settings an older vLLM lacks must be what it did
        if k not in fields:
            assert not v, f"vLLM {vllm_version()} has no {k}"
            del knobs[k]
    sc = SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True, is_encoder_decoder=False,
        async_scheduling=cfg["async_scheduling"], policy=cfg["policy"], **knobs)
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", seed=0,
                     max_model_len=MAX_MODEL_LEN)
    bs = cfg["block_size"]
    cc = CacheConfig(block_size=bs, enable_prefix_caching=cfg["prefix_caching"])
    vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc)
    # vLLM's block 0 is its null block: `num_blocks` usable blocks need one more.
    num_gpu_blocks = cfg["num_blocks"] + 1
    kvc = KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=bs, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    cc.num_gpu_blocks = num_gpu_blocks
    cls = AsyncScheduler if cfg["async_scheduling"] else Scheduler
    s = cls(vllm_config=vc, kv_cache_config=kvc, log_stats=False,
            structured_output_manager=StructuredOutputManager(vc), block_size=bs)
    # What the scheduler took from the settings (a platform may override some).
    assert s.block_size == bs
    assert s.max_num_scheduled_tokens == cfg["max_num_batched_tokens"]
    assert getattr(s, "scheduler_reserve_full_isl", False) == cfg["reserve_full_isl"]
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == cfg["num_blocks"]
    return s


def run(stream: dict, cfg: dict) -> list:
    """Drive vLLM's scheduler over `stream`. Returns the steps: [scheduled [[id, tokens]...],
    preempted ids, ids whose last token this step computed, blocks in use after scheduling]."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    s = build_scheduler(cfg)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(cfg["block_size"], sha256)
    pool = s.kv_cache_manager.block_pool
    reqs = stream["requests"]
    prefix = stream["prefix_tokens"]
    rid = {r[0]: f"{r[0]:06d}" for r in reqs}  # zero-padded: string order is numeric order
    max_tokens = {f"{r[0]:06d}": r[3] for r in reqs}
    arrivals = deque(sorted(reqs, key=lambda r: (r[1], r[0])))
    cancels = sorted((r[6], r[0]) for r in reqs if r[6] is not None)
    live = {}  # id -> vLLM Request, from arrival to finish or abort
    steps: list = []
    step_of: dict = {}  # id(SchedulerOutput) -> its index in `steps` (None: not recorded)

    def inputs(t: float) -> None:
        while arrivals and arrivals[0][1] <= t:
            r = arrivals.popleft()
            sp = SamplingParams(max_tokens=r[3], ignore_eos=True)
            req = Request(request_id=rid[r[0]], prompt_token_ids=prompt_tokens(r, prefix),
                          sampling_params=sp, pooling_params=None, arrival_time=r[1],
                          priority=r[4], block_hasher=hasher)
            live[req.request_id] = req
            s.add_request(req)
        while cancels and cancels[0][0] <= t:
            _, i = cancels.pop(0)
            req = live.pop(rid[i], None)
            if req is None or req.is_finished():
                continue  # it has finished already
            # A request whose last token is computing now (async scheduling) has computed
            # all it will: count it as finished by that step, as servesim does.
            if (req.status == RequestStatus.RUNNING and req.num_output_placeholders > 0
                    and req.num_output_tokens + req.num_output_placeholders
                    >= max_tokens[req.request_id]):
                last = next(o for o, _ in in_flight if req.request_id in o.num_scheduled_tokens)
                steps[step_of[id(last)]][2].append(int(req.request_id))
            s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)

    def schedule():
        out = s.schedule()
        executed = out.total_num_scheduled_tokens > 0
        preempted = sorted(int(x) for x in out.preempted_req_ids)
        order = [int(x) for x in out.num_scheduled_tokens]
        step_of[id(out)] = None
        if executed or preempted:
            step_of[id(out)] = len(steps)
            steps.append([[[i, out.num_scheduled_tokens[rid[i]]] for i in order], preempted, [],
                          pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()])
        # The fabricated model output: a token for each request that reached its known end.
        ids = list(out.num_scheduled_tokens)
        sampled = [[OUT_TOKEN_BASE + int(i)] if not s.requests[i].is_prefill_chunk else []
                   for i in ids]
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={i: k for k, i in enumerate(ids)},
                                sampled_token_ids=sampled)
        return out, mro, executed

    def update(out, mro) -> None:
        res = s.update_from_output(out, mro)
        for eco in res.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    live.pop(o.request_id, None)
                    steps[step_of[id(out)]][2].append(int(o.request_id))

    t = 0.0
    in_flight: deque = deque()  # (SchedulerOutput, ModelRunnerOutput), newest first
    while True:
        inputs(t)
        if not s.has_requests() and not in_flight:
            if not arrivals:
                break
            t = max(t, arrivals[0][1])
            continue
        if not cfg["async_scheduling"]:
            out, mro, executed = schedule()
            update(out, mro)
            t += 1.0 if executed else 0.0
            continue
        # EngineCore.step_with_batch_queue with a queue of two
        if s.has_requests():
            out, mro, executed = schedule()
            in_flight.appendleft((out, mro))
            t += 1.0 if executed else 0.0
            if len(in_flight) < 2 and (executed or s.has_requests()):
                continue
        out, mro = in_flight.pop()
        update(out, mro)
    assert not live, f"requests left: {sorted(live)[:5]}"
    for st in steps:
        st[2].sort()
    return steps


def vllm_version() -> str:
    import vllm

    return vllm.__version__


# The releases whose `vllm/v1/core` `version_behaviours` was written from: traces were recorded
# and replayed with 0.23.0, 0.32.0 and 0.33.0, and the changes between them were read in vLLM's
# history. Outside this range a release may behave in ways servesim has no switch for.
OLDEST_KNOWN, NEWEST_KNOWN = "0.23.0", "0.33.0"


def release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a vLLM version string ("0.33.0", "0.34.0rc1", "0.6.4.post1").

    Raises ValueError if it does not start with three numbers."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)  # a suffix (rc1, .post1, +cpu) is ignored
    if m is None:
        raise ValueError(f"vLLM version {version!r}: not of the form X.Y.Z")
    return tuple(int(g) for g in m.groups())


def is_known(version: str) -> bool:
    """Whether `version_behaviours` was written from this release's code (see OLDEST_KNOWN)."""
    return release(OLDEST_KNOWN) <= release(version) <= release(NEWEST_KNOWN)


def version_behaviours(version: str) -> dict:
    """The behaviours that have no setting in vLLM, as the given release has them (found by
    reading each release's `vllm/v1/core`): freed blocks without a cached prefix go to the head
    of the free queue from 0.24.0 on (all to the tail before); a priority-scheduled request that
    preempts itself lets later ones try from 0.33.0 on (the pass ended before). Blocks have
    been cached at allocation, with duplicate holders, since V1's prefix caching (0.6.4).

    Raises ValueError for a release outside OLDEST_KNOWN..NEWEST_KNOWN: its behaviours are not
    known, and a trace recorded under a guess would test the guess."""
    if not is_known(version):
        raise ValueError(
            f"vLLM {version}: its scheduler's behaviours are known only for releases "
            f"{OLDEST_KNOWN} to {NEWEST_KNOWN}; read its vllm/v1/core (block_pool.py, "
            f"kv_cache_manager.py, sched/scheduler.py) against {NEWEST_KNOWN}'s, extend "
            f"version_behaviours, or record with --behaviours-of X.Y.Z to assume a known one's")
    v = release(version)[:2]
    return {"free_uncached_first": v >= (0, 24), "continue_after_self_preemption": v >= (0, 33),
            "register_at_allocation": True, "duplicate_cached_blocks": True}


def trace_name(version: str, name: str, seed: int) -> str:
    return f"{version}-{name}-s{seed}.json.gz"


def main(argv=None) -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "traces")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(STORED_SEEDS))
    ap.add_argument("--requests", type=int, default=STORED_REQUESTS)
    ap.add_argument("--blocks", type=int, nargs="+", default=None,
                    help="pool sizes to use instead of each configuration's own")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens")
    ap.add_argument("--only", nargs="+", default=None, help="configuration names")
    ap.add_argument("--behaviours-of", default=None, metavar="X.Y.Z",
                    help=f"record a release outside {OLDEST_KNOWN}..{NEWEST_KNOWN} with this "
                    "known release's behaviours (the traces then test that assumption)")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.only or ()) - set(CONFIGS))
    if unknown:
        print(f"generate.py: --only {' '.join(unknown)}: no such configuration (there are "
              f"{', '.join(CONFIGS)})", file=sys.stderr)
        return 2
    try:
        version = vllm_version()
    except ImportError as e:
        print(f"generate.py: vLLM cannot be imported by {sys.executable} ({e}); run this in "
              f"the vLLM virtualenv (see the module docstring)", file=sys.stderr)
        return 2
    try:  # a release whose behaviours are not known is refused before any trace is written
        behaviours = version_behaviours(a.behaviours_of or version)
    except ValueError as e:
        print(f"generate.py: {e}", file=sys.stderr)
        return 2
    if a.behaviours_of:
        print(f"generate.py: recording vLLM {version}'s traces with {a.behaviours_of}'s "
              f"behaviours (assumed, not read from its code)", file=sys.stderr)
    a.out.mkdir(parents=True, exist_ok=True)
    use_cpu_platform()
    from vllm.config import SchedulerConfig

    has_watermark = "watermark" in SchedulerConfig.__dataclass_fields__  # from 0.24.0 on
    for name, (kind, over) in CONFIGS.items():
        if a.only and name not in a.only:
            continue
        if over.get("watermark") and not has_watermark:
            continue
        for seed in a.seeds:
            for blocks in a.blocks or [None]:
                cfg = {**DEFAULTS, **over, **behaviours}
                label = name
                if blocks is not None:
                    cfg["num_blocks"] = blocks
                    label = f"{label}-kv{blocks}"
                if a.block_size:
                    cfg["block_size"] = a.block_size
                    label = f"{label}-bs{a.block_size}"
                if a.max_num_seqs:
                    cfg["max_num_seqs"] = a.max_num_seqs
                    label = f"{label}-seqs{a.max_num_seqs}"
                if a.budget:
                    cfg["max_num_batched_tokens"] = a.budget
                    label = f"{label}-tok{a.budget}"
                stream = make_stream(kind, seed, a.requests)
                steps = run(stream, cfg)
                doc = {"vllm_version": version, "config": cfg, "name": label,
                       "block_size": cfg["block_size"], "stream": stream, "steps": steps}
                if a.behaviours_of:
                    doc["behaviours_of"] = a.behaviours_of
                path = a.out / trace_name(version, label, seed)
                with gzip.open(path, "wt", compresslevel=9) as f:
                    json.dump(doc, f, separators=(",", ":"))
                npre = sum(len(st[1]) for st in steps)
                print(f"{path.name}: {len(steps)} steps, {npre} preemptions, "
                      f"{path.stat().st_size // 1024} KiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
