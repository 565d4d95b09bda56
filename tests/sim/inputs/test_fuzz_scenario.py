"""Scenario fuzzing over the schema: every field, every type, extreme and non-finite values,
distribution tables, `--set` overrides and random TOML. Every input either loads and runs a
short simulation, or is refused with a ServesimError of one line naming the file; never any other
exception (a traceback). `SERVESIM_FUZZ=N` tries N times as many inputs (tests/fuzz.py)."""

import dataclasses
import json
import math

import pytest
from hypothesis import assume, event, given, strategies as st

import sim.limits
from sim import build, summarize
from sim.errors import ServesimError
from sim.inputs.scenario import DIST_KEYS, SECTIONS, load_scenario
from tests.fuzz import fuzz_settings

pytestmark = pytest.mark.fuzz

BASE = {
    "name": "fuzz", "seed": 1,
    "kv": {"num_blocks": 400},
    "workload": {"arrival": "poisson", "rate": 4.0, "num_requests": 12,
                 "prompt_tokens": {"dist": "uniform", "min": 8, "max": 300},
                 "output_tokens": {"dist": "uniform", "min": 1, "max": 40}},
}
EXTREME_INTS = [0, 1, -1, 2, 3, 16, 64, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
                -2**63, -2**63 - 1, 10**30]
EXTREME_FLOATS = [0.0, -0.0, 1e-300, 5e-324, 1e-9, 0.5, 1.0, 1e9, 1e15, 1e300, 1.7e308, -1.0,
                  math.inf, -math.inf, math.nan]

ints = st.one_of(st.integers(-3, 3000), st.sampled_from(EXTREME_INTS))
floats = st.one_of(st.floats(-1e3, 1e4), st.sampled_from(EXTREME_FLOATS),
                   st.floats(allow_nan=True, allow_infinity=True))
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)  # writable as UTF-8
plain = st.one_of(ints, floats, st.booleans(), TEXT,
                  st.sampled_from(["", "none", "chunked", "trace", "uniform"]))
anything = st.recursive(plain, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(TEXT,
                                                                        inner, max_size=4)),
                        max_leaves=8)


def dist_table():
    @st.composite
    def table(draw):
        dist = draw(st.sampled_from([*DIST_KEYS, "zipf", "", 3]))
        keys = sorted(DIST_KEYS.get(dist, set()) | {"min", "max"})
        out = {"dist": dist}
        for k in draw(st.lists(st.sampled_from([*keys, "bogus"]), max_size=4, unique=True)):
            if k in ("values", "weights"):
                out[k] = draw(st.one_of(st.lists(st.one_of(ints, floats), max_size=4), anything))
            elif k == "file":
                out[k] = draw(st.sampled_from(
                    ["traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "", ".",
                     "/dev/zero", "nope.csv", "traces"]))
            elif k == "column":
                out[k] = draw(st.sampled_from(["num_prefill_tokens", "GeneratedTokens", "x", 4]))
            else:
                out[k] = draw(st.one_of(ints, floats, anything))
        return out
    return table()


def field_value(f: dataclasses.Field):
    """Values for one schema field: mostly of its type and near its bounds, some of any type."""
    m = f.metadata
    if m.get("kind") == "dist":
        typed = st.one_of(dist_table(), ints, floats)
    elif m.get("kind") == "clients":  # a client mix: tables of a name, a share and the rest
        client = st.fixed_dictionaries(
            {"name": st.sampled_from(["a", "b", "", " "]),
             "share": st.one_of(st.sampled_from([0.25, 0.5, 0.75, 1.0]), floats)},
            optional={"prompt_tokens": st.one_of(dist_table(), ints),
                      "output_tokens": st.one_of(dist_table(), ints),
                      "priority": ints, "ttft_ms": floats, "tpot_ms": floats,
                      "e2e_ms": floats, "bogus": ints})
        typed = st.lists(client, max_size=3)
    elif m.get("choices") or m.get("kind") == "policy":
        from sim.policies import POLICIES
        typed = st.sampled_from(list(m.get("choices") or [*POLICIES, "disaggregated", "fifo"]))
    elif f.type == "bool":
        typed = st.booleans()
    elif f.type == "int":
        bounds = [b for b in (m.get("min"), m.get("max"), m.get("gt")) if b is not None]
        typed = st.one_of(ints, st.sampled_from([int(b) + d for b in bounds for d in (-1, 0, 1)]
                                                or [0]))
    elif f.type == "float":
        bounds = [b for b in (m.get("min"), m.get("max"), m.get("gt")) if b is not None]
        typed = st.one_of(floats, st.sampled_from([b * k for b in bounds for k in (0.5, 1, 2)]
                                                  or [0.0]))
    else:
        typed = st.one_of(TEXT, st.sampled_from(
            ["traces/AzureLLMInferenceTrace_conv.csv", "traces/mooncake_synthetic_trace.jsonl",
             "traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "/dev/zero", ".", ""]))
    return st.one_of(typed, typed, typed, anything)


ALL_FIELDS = [(name, f) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


@st.composite
def scenarios(draw):
    raw = json.loads(json.dumps(BASE))
    for name, f in draw(st.lists(st.sampled_from(ALL_FIELDS), min_size=1, max_size=4,
                                 unique_by=lambda x: (x[0], x[1].name))):
        raw.setdefault(name, {})[f.name] = draw(field_value(f), label=f"{name}.{f.name}")
    if draw(st.integers(0, 9)) == 0:  # a key that is not in the schema, named anyhow
        raw.setdefault(draw(st.sampled_from([*SECTIONS, "bogus"])), {})[draw(TEXT)] = 1
    if draw(st.integers(0, 9)) == 0:  # the top level and the shape itself
        key = draw(st.sampled_from(["seed", "name", "model", "kv", "bogus", "workload"]))
        raw[key] = draw(anything)
    return raw


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == math.inf else "-inf" if v == -math.inf
                                     else repr(v))
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string (the fuzzer's text has no \u escapes issue)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"


def to_toml(raw: dict) -> str:
    lines = [f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in raw.items()
             if not isinstance(v, dict)]
    for k, v in raw.items():
        if isinstance(v, dict):
            lines.append(f"[{json.dumps(str(k))}]")
            lines += [f"{json.dumps(str(kk))} = {toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def runs_or_one_line(path, overrides=()) -> str:
    """Load and run a short simulation. Returns "ran" or "refused" (a one-line error naming
    the file); anything else propagates as a test failure."""
    try:
        sc = load_scenario(str(path), list(overrides))
    except ServesimError as e:
        msg = str(e)
        assert "\n" not in msg and msg.strip(), msg
        assert str(path) in msg or msg.startswith("--set"), msg
        return "refused"
    try:
        engine = build(sc, record_events=True)
        engine.run(max_steps=3000)
        summary = summarize(engine)
    except ServesimError as e:  # found while running (a trace read late, a clock outrun)
        assert "\n" not in str(e), str(e)
        return "refused at run time"
    json.dumps(summary)  # plain data, even with extreme inputs
    return "ran"


@pytest.fixture(autouse=True)
def small_machine(monkeypatch):
    # Whatever the fuzzer draws, the memory check bounds what a run may allocate: 2 GB here.
    monkeypatch.setattr(sim.limits, "available_memory", lambda: 2e9)


@fuzz_settings(60)
@given(raw=scenarios())
def test_schema_fuzz_runs_or_refuses_with_one_line(tmp_path_factory, raw):
    d = tmp_path_factory.mktemp("fuzz")
    (d / "traces").symlink_to(sim.inputs.scenario.BUNDLED_DIR / "traces")
    path = d / "s.toml"
    try:
        path.write_text(to_toml(raw))
    except (UnicodeEncodeError, ValueError):
        assume(False)  # (surrogates in drawn text cannot be written as UTF-8)
    event(runs_or_one_line(path))


@fuzz_settings(40)
@given(sets=st.lists(st.tuples(
    st.sampled_from([f"{s}.{f.name}" for s, c in SECTIONS.items() for f in dataclasses.fields(c)]
                    + ["workload.prompt_tokens.dist", "workload.prompt_tokens.max", "seed",
                       "kv", "nosuch.key", "workload.output_tokens.values"]),
    st.one_of(st.sampled_from(["1", "-1", "0", "1e308", "inf", "nan", "-inf", "\"x\"", "[1,2]",
                               "{dist=\"uniform\"}", "99999999999999999999999", "true", "",
                               "{dist=\"choice\", values=[1, inf]}", "\"uniform\"", "=", "[[["]),
              st.text(max_size=10))), max_size=4))
def test_set_overrides_fuzz(tmp_path_factory, sets):
    d = tmp_path_factory.mktemp("fuzz")
    path = d / "s.toml"
    path.write_text(to_toml(BASE))
    event(runs_or_one_line(path, [f"{k}={v}" for k, v in sets]))


@fuzz_settings(40)
@given(text=st.one_of(
    st.text(alphabet=st.sampled_from(list("[]{}=\"'.,#\n abcdefkvseed0123456789-+e_inf")),
            max_size=120),
    st.binary(max_size=60).map(lambda b: b.decode("latin-1"))))
def test_random_toml_text(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "s.toml"
    path.write_text(to_toml(BASE) + text, encoding="utf-8", errors="surrogateescape")
    event(runs_or_one_line(path))


