import os
import threading
import time

import numpy as np
import pytest

from sim.errors import ScenarioError, TraceError
from sim.inputs.scenario import load_scenario
from sim.inputs.workload import build_workload, load_label, read_trace
from sim.inputs.scenario import BUNDLED_DIR

TRACES = BUNDLED_DIR / "traces"


def sc(*o):
    return load_scenario("chat", ["workload.duration_s=0", "workload.num_requests=4000", *o])


def test_seeded_and_identical_for_every_policy():
    a = build_workload(sc())
    b = build_workload(sc("scheduler.policy=\"fcfs\""))
    assert np.array_equal(a.arrival, b.arrival) and np.array_equal(a.prompt, b.prompt)
    c = build_workload(sc("seed=99"))
    assert not np.array_equal(a.arrival, c.arrival)


def test_poisson_rate_and_gamma_burstiness():
    w = build_workload(sc("workload.rate=10"))
    gaps = np.diff(w.arrival)
    assert w.arrival[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)
    g = build_workload(sc("workload.arrival=\"gamma\"", "workload.rate=10", "workload.cv=3"))
    gg = np.diff(g.arrival)
    assert gg.mean() == pytest.approx(0.1, rel=0.25)
    assert gg.std() / gg.mean() == pytest.approx(3.0, rel=0.25)
    c = build_workload(sc("workload.arrival=\"constant\"", "workload.rate=4"))
    assert np.allclose(np.diff(c.arrival), 0.25)


def test_duration_bound():
    w = build_workload(load_scenario("chat", ["workload.duration_s=30", "workload.rate=5"]))
    assert w.arrival.max() < 30 and 100 < len(w) < 200


def test_length_distributions():
    w = build_workload(sc("workload.prompt_tokens={dist=\"uniform\", min=10, max=20}",
                          "workload.output_tokens={dist=\"lognormal\", mean=200, cv=0.5, max=400}"))
    assert w.prompt.min() >= 10 and w.prompt.max() <= 20
    assert set(np.unique(w.prompt)) == set(range(10, 21))
    assert w.output.max() <= 400 and w.output.mean() == pytest.approx(200, rel=0.1)
    f = build_workload(sc("workload.prompt_tokens=77"))
    assert np.all(f.prompt == 77)


def test_empirical_pairs_stay_paired():
    w = build_workload(sc())  # chat: prompt and output from the same ShareGPT file
    t = read_trace(TRACES / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv")
    pairs = set(zip(t.prompt.tolist(), t.output.tolist()))
    assert all((p, o) in pairs for p, o in zip(w.prompt.tolist(), w.output.tolist()))


def test_azure_trace_import_and_time_scale():
    s = load_scenario("azure-conv")
    w = build_workload(s)
    assert len(w) == 19366 and w.total_output_tokens == 4088665
    assert w.arrival[0] == 0.0 and np.all(np.diff(w.arrival) >= 0)
    # first two rows: 18:15:46.6805900 and 18:15:50.9951690
    assert w.arrival[1] == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)
    assert w.prompt[0] == 374 and w.output[0] == 44
    half = build_workload(load_scenario("azure-conv", ["workload.time_scale=0.5",
                                                       "workload.num_requests=100"]))
    assert len(half) == 100
    assert half.arrival[1] == pytest.approx(w.arrival[1] * 0.5)


def test_mooncake_keeps_hash_ids(tmp_path):
    t = read_trace(TRACES / "mooncake_conversation_trace.jsonl")
    assert len(t.prompt) == 12031 and t.hash_ids[0][:3] == (0, 1, 2)
    p = tmp_path / "m.toml"
    p.write_text('name="m"\n[workload]\narrival="trace"\ntrace="%s"\nnum_requests=50\n'
                 % (TRACES / "mooncake_conversation_trace.jsonl"))
    w = build_workload(load_scenario(str(p)))
    assert len(w.hash_ids) == 50 and w.hash_ids[1][0] == 0


def test_cancellations_and_priorities():
    w = build_workload(sc("workload.cancel_fraction=0.25",
                          "workload.cancel_after_s={dist=\"exponential\", mean=2.0}",
                          "workload.priority={dist=\"choice\", values=[0, 1, 2], weights=[1, 1, 2]}"))
    chosen = ~np.isnan(w.cancel_at)
    assert chosen.mean() == pytest.approx(0.25, abs=0.03)
    delay = w.cancel_at[chosen] - w.arrival[chosen]
    assert np.all(delay >= 0) and delay.mean() == pytest.approx(2.0, rel=0.15)
    assert set(np.unique(w.priority)) == {0, 1, 2}
    assert (w.priority == 2).mean() == pytest.approx(0.5, abs=0.04)
    # the other draws do not move when cancellations are switched on
    base = build_workload(sc())
    assert np.array_equal(base.arrival, w.arrival) and np.array_equal(base.prompt, w.prompt)


def test_repeat_plays_a_trace_again_at_its_own_rate(tmp_path):
    one = build_workload(load_scenario("azure-conv"))
    three = build_workload(load_scenario("azure-conv", ["workload.repeat=3"]))
    n = len(one)
    span = one.arrival[-1] - one.arrival[0]
    period = span + span / (n - 1)
    assert len(three) == 3 * n and np.all(np.diff(three.arrival) > 0)
    for k in range(3):
        assert np.array_equal(three.prompt[k * n:(k + 1) * n], one.prompt)
        assert np.array_equal(three.output[k * n:(k + 1) * n], one.output)
        assert np.allclose(three.arrival[k * n:(k + 1) * n], one.arrival + k * period)
    # the seam keeps the trace's mean gap; duration and num_requests cut the repeated trace
    assert three.arrival[n] - three.arrival[n - 1] == pytest.approx(span / (n - 1))
    day = build_workload(load_scenario("azure-conv", ["workload.repeat=30",
                                                      "workload.duration_s=86400"]))
    assert day.arrival[-1] < 86400 < day.arrival[-1] + 60 and len(day) > 24 * n
    first = build_workload(load_scenario("azure-conv", ["workload.repeat=2",
                                                        f"workload.num_requests={n + 5}"]))
    assert len(first) == n + 5
    p = tmp_path / "m.toml"
    p.write_text('name="m"\n[workload]\narrival="trace"\ntrace="%s"\nnum_requests=40\n'
                 'repeat=2\n' % (TRACES / "mooncake_conversation_trace.jsonl"))
    w = build_workload(load_scenario(str(p)))  # (num_requests cuts after the repeat)
    assert len(w) == 40 and len(w.hash_ids) == 40
AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
MOONCAKE_OK = '{"timestamp": 0, "input_length": 5, "output_length": 2}\n'


@pytest.mark.parametrize("name, body, where, message", [
    ("inf.csv", AZURE_HEAD + "2023-11-16 18:15:47.00,inf,10\n", 3, "ContextTokens = 'inf' is not a finite number"),
    ("nan.csv", AZURE_HEAD + "2023-11-16 18:15:47.00,5,nan\n", 3, "GeneratedTokens = 'nan' is not a finite"),
    ("big.csv", AZURE_HEAD + "2023-11-16 18:15:47.00,1e30,10\n", 3, "ContextTokens = '1e30' is more than"),
    ("neg.csv", AZURE_HEAD + "2023-11-16 18:15:47.00,-5,10\n", 3, "ContextTokens = '-5' is negative"),
    ("sec.csv", AZURE_HEAD + "2023-11-16 18:15:inf,5,10\n", 3, "TIMESTAMP = '2023-11-16 18:15:inf'"),
    ("years.csv", AZURE_HEAD + "9999-11-16 18:15:47.00,5,10\n", 3, "TIMESTAMP lies 2.52e+11 s"),
    ("pairs.csv", "num_prefill_tokens,num_decode_tokens\n5,6\n7,1e400\n", 3, "'1e400' is not a finite"),
    ("ts.jsonl", MOONCAKE_OK + '{"timestamp": Infinity, "input_length": 5, "output_length": 2}\n', 2,
     "timestamp = inf is not a time"),
    ("tsnan.jsonl", MOONCAKE_OK + '{"timestamp": NaN, "input_length": 5, "output_length": 2}\n', 2,
     "timestamp = nan is not a time"),
    ("ts30.jsonl", MOONCAKE_OK + '{"timestamp": 1e30, "input_length": 5, "output_length": 2}\n', 2,
     "timestamp = 1e+30 is not a time"),
    ("len.jsonl", MOONCAKE_OK + '{"timestamp": 1, "input_length": 1e30, "output_length": 2}\n', 2,
     "input_length = 1e+30 is more than"),
    ("huge.jsonl", MOONCAKE_OK + '{"timestamp": 1, "input_length": 1%s, "output_length": 2}\n'
     % ("0" * 400), 2, "input_length = '1000"),
    ("bool.jsonl", MOONCAKE_OK + '{"timestamp": 1, "input_length": true, "output_length": 2}\n', 2,
     "input_length = True is not a number"),
    ("hash.jsonl", MOONCAKE_OK + '{"timestamp": 1, "input_length": 5, "output_length": 2, '
     '"hash_ids": [1, 99999999999999999999999]}\n', 2, "hash_ids must be a list of 64-bit"),
    ("hashf.jsonl", MOONCAKE_OK + '{"timestamp": 1, "input_length": 5, "output_length": 2, '
     '"hash_ids": [1.5]}\n', 2, "hash_ids must be a list of 64-bit"),
    ("list.jsonl", MOONCAKE_OK + "[1, 2, 3]\n", 2, "expected a JSON object"),
    ("deep.jsonl", MOONCAKE_OK + "[" * 100000 + "\n", 2, "not JSON"),
    ("nul.csv", AZURE_HEAD + "2023-11-16 18:15:47.00,5,\x0010\n", 3, "a NUL byte: a binary file"),
    ("latin.csv", AZURE_HEAD.encode() + "2023-11-16 18:15:47.00,5,10 caf\xe9\n".encode("latin-1"), 3,
     "not UTF-8 text"),
    ("png.csv", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", 3, "a NUL byte: a binary file"),
])
def test_malformed_traces_are_one_line_naming_file_and_line(tmp_path, name, body, where, message):
    from sim.errors import TraceError

    p = tmp_path / name
    p.write_bytes(body if isinstance(body, bytes) else body.encode())
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert f"{p}:{where}: " in str(e.value) and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_directory_or_a_device_is_not_a_trace(tmp_path):
    from sim.errors import TraceError

    with pytest.raises(TraceError, match="is a directory, not a trace file"):
        read_trace(tmp_path)
    with pytest.raises(TraceError, match="/dev/zero: not a regular file"):
        read_trace(__import__("pathlib").Path("/dev/zero"))
    t = tmp_path / "t.toml"
    t.write_text('name="t"\n[workload]\narrival="trace"\ntrace="."\n')
    with pytest.raises(TraceError, match="is a directory"):
        build_workload(load_scenario(str(t)))


def test_repeat_makes_only_the_copies_that_the_cut_keeps():
    # repeat = 100,000 of a 19k-request trace would be ~2 billion rows made before the cut
    # (minutes, then the OOM killer); only the copies num_requests / duration_s keep are made.
    many = build_workload(load_scenario("azure-conv", ["workload.repeat=100000", "workload.num_requests=50"]))
    few = build_workload(load_scenario("azure-conv", ["workload.repeat=2", "workload.num_requests=50"]))
    assert len(many) == 50 and np.array_equal(many.arrival, few.arrival) and np.array_equal(many.prompt, few.prompt)
    hour = build_workload(load_scenario("azure-conv", ["workload.repeat=100000", "workload.duration_s=7200"]))
    two = build_workload(load_scenario("azure-conv", ["workload.repeat=3", "workload.duration_s=7200"]))
    assert np.array_equal(hour.arrival, two.arrival) and len(hour) > len(build_workload(load_scenario("azure-conv")))
    with pytest.raises(ScenarioError, match=r"workload.repeat = 100,000: needs about .* GB of memory"):
        build_workload(load_scenario("azure-conv", ["workload.repeat=100000"]))


def test_a_trace_from_a_fifo_is_read_and_a_silent_fifo_refused(tmp_path, monkeypatch):
    from sim import fileio

    fifo = tmp_path / "trace.csv"
    os.mkfifo(fifo)
    p = tmp_path / "m.toml"
    p.write_text('name="m"\n[workload]\narrival="trace"\ntrace="trace.csv"\n')
    monkeypatch.setattr(fileio, "FIFO_WAIT_S", 0.3)
    with pytest.raises(TraceError, match="trace.csv: cannot read: a FIFO that nothing wrote to for 0.3 s"):
        build_workload(load_scenario(str(p)))
    # A writer that comes a little later, within the wait: however late a loaded machine runs
    # its thread, not past 60 s.
    monkeypatch.setattr(fileio, "FIFO_WAIT_S", 60.0)
    writer = threading.Thread(target=lambda: (time.sleep(0.1), fifo.write_text(AZURE_HEAD)))
    writer.start()
    w = build_workload(load_scenario(str(p)))  # a writer that comes a little later
    writer.join()
    assert len(w) == 1 and w.prompt[0] == 374


def test_a_trace_reaching_past_the_clock_names_the_trace(tmp_path):
    # A request at 1e12 ms arrived at the clock's last second: the run then stopped past it
    # with a message blaming [hardware] and [model].
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 100, "output_length": 10}\n'
                     '{"timestamp": 1e12, "input_length": 100, "output_length": 10}\n')
    p = tmp_path / "m.toml"
    p.write_text('name="m"\n[workload]\narrival="trace"\ntrace="t.jsonl"\n')
    with pytest.raises(ScenarioError, match=r"workload.trace = 't.jsonl' x time_scale = 1: the last request "
                                            r"would arrive at t = 1e\+09 s, past 5e\+08 s"):
        build_workload(load_scenario(str(p)))


@pytest.mark.parametrize("value, ratio", [(1024, 0.5), (100, 0.0), (7, 0.3), (128, 0.99)])
def test_random_lengths_stay_within_vllms_range_ratio_bounds(value, ratio):
    # vllm bench serve --dataset-name random: floor(v (1 - r)) to ceil(v (1 + r)), both included
    w = build_workload(sc(f'workload.prompt_tokens={{dist="random", value={value}, '
                          f'range_ratio={ratio}}}'))
    lo, hi = int(np.floor(value * (1 - ratio))), int(np.ceil(value * (1 + ratio)))
    assert max(lo, 1) <= w.prompt.min() and w.prompt.max() <= hi
    if hi - lo < 20:  # every length of the range is drawn
        assert set(np.unique(w.prompt)) == set(range(max(lo, 1), hi + 1))
    else:  # and both ends are reached
        assert w.prompt.min() - lo < (hi - lo) / 50 and hi - w.prompt.max() < (hi - lo) / 50


def test_a_closed_loop_workload_is_rows_whose_cancellations_are_delays():
    w = build_workload(sc("workload.concurrency=4", "workload.cancel_fraction=0.5",
                          "workload.cancel_after_s=2.5"))
    assert len(w) == 4000 and (w.arrival == 0).all()
    c = w.cancel_at[~np.isnan(w.cancel_at)]
    assert len(c) and (c == 2.5).all()


def test_a_malformed_length_file_of_a_closed_loop_names_file_and_line(tmp_path):
    bad = tmp_path / "lengths.csv"
    bad.write_text("num_prefill_tokens,num_decode_tokens\n12,40\n30,x\n")
    with pytest.raises(TraceError, match=r"lengths.csv:3: num_decode_tokens = 'x' is not a number"):
        build_workload(sc("workload.concurrency=4", f'workload.output_tokens={{dist="empirical", '
                          f'file="{bad}"}}'))


def test_the_load_label_names_what_drives_the_arrivals():
    assert load_label(sc().workload) == "4 req/s"
    assert load_label(sc("workload.concurrency=8").workload) == "concurrency 8"


def test_balanced_system_prompts_go_to_equal_shares_in_shuffled_order():
    # vllm bench serve's prefix_repetition dataset: num_prompts // num_prefixes each, shuffled
    w = build_workload(sc("workload.shared_prefix_tokens=256", "workload.shared_prefix_groups=10",
                          "workload.shared_prefix_balanced=true", "workload.num_requests=1000"))
    assert (np.bincount(w.prefix_group) == 100).all()
    assert not (np.diff(w.prefix_group) >= 0).all()  # (not one prefix after another)
    drawn = build_workload(sc("workload.shared_prefix_tokens=256",
                              "workload.shared_prefix_groups=10", "workload.num_requests=1000"))
    assert not (np.bincount(drawn.prefix_group) == 100).all()


def test_sharegpt_rows_filtered_as_vllm_bench_serve_filters_them():
    f = ('file="traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", min_len=4, '
         'max_prompt_len=1024, max_total_len=2048')
    w = build_workload(sc(f'workload.prompt_tokens={{dist="empirical", {f}}}',
                          f'workload.output_tokens={{dist="empirical", {f}}}'))
    assert (w.prompt >= 4).all() and (w.output >= 4).all() and (w.prompt <= 1024).all()
    assert (w.prompt + w.output <= 2048).all()
    rows = read_trace(TRACES / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv")
    pairs = set(zip(rows.prompt.tolist(), rows.output.tolist()))
    assert set(zip(w.prompt.tolist(), w.output.tolist())) <= pairs  # (still paired)
    unfiltered = build_workload(sc())
    assert (unfiltered.prompt + unfiltered.output > 2048).any()


def test_a_trace_error_names_the_line_the_record_ends_on(tmp_path):
    # a quoted field may span lines: the bad row is the file's fourth line, not the third record
    p = tmp_path / "lengths.csv"
    p.write_text('num_prefill_tokens,num_decode_tokens\n"5\n",2\nx,3\n')
    with pytest.raises(TraceError, match=r"lengths\.csv:4: "):
        read_trace(p)
