"""servesim against vLLM's own V1 scheduler, step by step, on the golden traces in `traces/`.

Each trace holds a request stream, vLLM's settings and, for every step vLLM's scheduler took,
the requests it scheduled with their token counts (in batch order), its preemptions, the
requests whose last token the step computed, and the blocks in use (see `generate.py`). The
stream is replayed through servesim's engine and policy with the same settings; every step must
be identical. On a mismatch the first divergent step is printed with both sides.
"""

from pathlib import Path

import pytest

from sim.inputs.scenario import KVConfig, SchedulerConfig
from tests.parity.compare import describe, first_divergence, load, provenance, replay
from tests.parity.generate import NEWEST_KNOWN, release, version_behaviours

TRACES = sorted((Path(__file__).parent / "traces").glob("*.json.gz"))


def test_the_traces_are_there():
    assert len(TRACES) >= 20
    kinds = {load(p)["stream"]["kind"] for p in TRACES}
    assert {"burst", "shared", "staggered", "aborts", "abort-storm", "priority", "mixed"} <= kinds


@pytest.mark.parametrize("path", TRACES, ids=[p.name.removesuffix(".json.gz") for p in TRACES])
def test_identical_to_vllm_step_by_step(path):
    doc = load(path)
    sim_steps = replay(doc)
    k = first_divergence(doc["steps"], sim_steps)
    assert k is None, (f"{path.name} (vLLM {doc['vllm_version']}, {doc['config']}): "
                       f"first divergent step {k} of {len(doc['steps'])}\n"
                       + describe(k, doc["steps"], sim_steps))


def test_traces_exercise_what_they_are_meant_to():
    """A trace that never preempts, hits the cache or aborts would prove little."""
    seen = {}
    for p in TRACES:
        doc = load(p)
        cfg, steps = doc["config"], doc["steps"]
        seen.setdefault("preempt", 0)
        seen["preempt"] += sum(len(s[1]) for s in steps)
        if cfg["prefix_caching"]:
            # a finished request never preempted computed fewer than its prompt plus outputs
            # (minus the last, never fed back) only if its prompt hit the cache
            total, preempted = {}, set()
            for s in steps:
                preempted.update(s[1])
                for rid, n in s[0]:
                    total[rid] = total.get(rid, 0) + n
            done = {rid for s in steps for rid in s[2]}
            seen["hit"] = seen.get("hit", 0) + sum(
                1 for r in doc["stream"]["requests"] if r[0] in done - preempted
                and total[r[0]] < r[2] + r[3] - 1)
        if any(r[6] is not None for r in doc["stream"]["requests"]):
            done = {rid for s in steps for rid in s[2]}
            seen["abort"] = seen.get("abort", 0) + sum(
                1 for r in doc["stream"]["requests"] if r[0] not in done)
    assert seen["preempt"] > 100 and seen["hit"] > 100 and seen["abort"] > 20


def test_servesim_defaults_are_the_newest_vllm_of_the_traces():
    """The switches' defaults model the newest vLLM release the traces come from; a trace
    from an older release names its behaviours as that release has them."""
    docs = [load(p) for p in TRACES]
    versions = {d["vllm_version"] for d in docs}
    assert max(versions, key=release) == NEWEST_KNOWN == "0.33.0"
    assert {"0.32.0", "0.23.0"} <= versions
    for d in docs:  # every stored trace has its own release's behaviours, none assumed
        assert provenance(d) is None, (d["name"], provenance(d))
    s, kv = SchedulerConfig(), KVConfig()
    assert s.reserve_full_sequence and s.async_scheduling and s.watermark == 0.0
    assert s.continue_after_self_preemption and not s.preempt_for_waiting
    assert kv.register_at_allocation and kv.free_uncached_first and kv.duplicate_cached_blocks


@pytest.mark.parametrize("override", [
    "scheduler.reserve_full_sequence=false", "scheduler.async_scheduling=false",
    "scheduler.watermark=0.02", "kv.register_at_allocation=false",
    "kv.free_uncached_first=false", "kv.duplicate_cached_blocks=false",
    "scheduler.continue_after_self_preemption=false"])
def test_each_behaviour_shows_in_the_traces(override):
    """The older value of any switch makes a trace diverge: the traces would catch a
    behaviour that stopped matching vLLM's."""
    doc = load(Path(__file__).parent / "traces" / "0.33.0-mixed-2048-s1.json.gz")
    assert first_divergence(doc["steps"], replay(doc, [override])) is not None


def test_a_release_whose_behaviours_are_unknown_is_refused_or_flagged():
    """The generator records only releases whose behaviours were read from their code (or says
    whose it assumed), and a trace that names behaviours its release lacks is flagged."""
    assert release("0.34.0rc1") == (0, 34, 0) and release("0.6.4.post1") == (0, 6, 4)
    with pytest.raises(ValueError, match="0.34.0.*known only for releases 0.23.0 to 0.33.0"):
        version_behaviours("0.34.0")
    with pytest.raises(ValueError, match="not of the form"):
        release("main")
    assert version_behaviours("0.23.0")["free_uncached_first"] is False
    assert version_behaviours("0.24.0")["free_uncached_first"] is True
    assert version_behaviours("0.32.0")["continue_after_self_preemption"] is False
    doc = load(TRACES[0])
    assumed = {**doc, "vllm_version": "0.34.0", "behaviours_of": "0.33.0"}
    assert "outside 0.23.0..0.33.0" in provenance(assumed)
    assert "0.33.0's behaviours, assumed" in provenance(assumed)
    wrong = {**doc, "config": {**doc["config"],
                               "free_uncached_first": not doc["config"]["free_uncached_first"]}}
    assert "free_uncached_first" in provenance(wrong)


def test_the_generator_refuses_an_unknown_release_before_writing(tmp_path, monkeypatch, capsys):
    from tests.parity import generate

    monkeypatch.setattr(generate, "vllm_version", lambda: "0.34.0")
    assert generate.main(["--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vLLM 0.34.0" in err and "--behaviours-of" in err
    assert not (tmp_path / "t").exists()
    assert generate.main(["--only", "nosuch"]) == 2
    assert "--only nosuch: no such configuration" in capsys.readouterr().err
