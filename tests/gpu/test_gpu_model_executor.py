"""The tiny model through ModelExecutor: tokens invariant to batching, chunking, preemption and
block placement; attention matters; block moves and verification work."""

import numpy as np
import pytest

import gpu
from gpu.driver import Driver
from gpu.executor import CPU_MODEL, GPU_MODEL, ModelExecutor
from sim.engine.executor import SeqWork, StepWork

NUM_BLOCKS = 96
BLOCK_SIZE = 8
NEW_TOKENS = 12


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def executor(**kw) -> ModelExecutor:
    kw.setdefault("verify_every", 1)  # every test run doubles as a check against the dense recompute
    return ModelExecutor(NUM_BLOCKS, BLOCK_SIZE, backend="numpy", **kw)


def run(prompt_list, *, chunk_size=None, block_order=None, new_tokens=NEW_TOKENS, **kw) -> list[list[int]]:
    driver = Driver(executor(**kw), block_order)
    for p in prompt_list:
        driver.add(p)
    out = driver.run(new_tokens, chunk_size)
    return [out[i] for i in range(len(prompt_list))]


TARGET = prompts(1, [29])[0]
OTHERS = prompts(2, [3, 50, 17, 8])


def test_generation_is_not_degenerate():
    tokens = run([TARGET], new_tokens=24)[0]
    assert len(set(tokens)) >= 8  # an echoing or collapsed model would make the checks below vacuous


def test_same_tokens_alone_and_batched():
    alone = run([TARGET])[0]
    assert run([*OTHERS[:2], TARGET, *OTHERS[2:]])[2] == alone


def test_same_tokens_chunked_and_whole_prefill():
    whole = run([TARGET, *OTHERS])
    for chunk in (1, 5, 8):
        assert run([TARGET, *OTHERS], chunk_size=chunk) == whole


def test_same_tokens_in_scattered_and_contiguous_blocks():
    order = np.random.default_rng(7).permutation(NUM_BLOCKS).tolist()
    assert run([TARGET, *OTHERS], block_order=order) == run([TARGET, *OTHERS])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_same_tokens_after_recompute_preemption(dtype):
    expected = run([TARGET, OTHERS[1]], dtype=dtype)
    driver = Driver(executor(dtype=dtype))
    target, other = driver.add(TARGET), driver.add(OTHERS[1])
    for _ in range(5):
        driver.step()
    blocks_before = list(driver.requests[target].blocks)
    driver.preempt_recompute(target)
    driver.step(only={other})          # the freed blocks go to the back of the free list ...
    driver.step(chunk_size=6)          # ... so the re-prefill (prompt + generated) lands elsewhere
    assert set(driver.requests[target].blocks).isdisjoint(blocks_before)
    out = driver.run(NEW_TOKENS)
    assert [out[target], out[other]] == expected


def test_swap_out_and_in_gives_identical_continuation():
    expected = run([TARGET, OTHERS[1]])
    driver = Driver(executor(num_host_blocks=16))
    target, other = driver.add(TARGET), driver.add(OTHERS[1])
    for _ in range(4):
        driver.step()
    driver.swap_out(target)
    for _ in range(3):
        driver.step()                  # the other request reuses the freed device blocks
    driver.swap_in(target)
    out = driver.run(NEW_TOKENS)
    assert [out[target], out[other]] == expected


def test_copied_blocks_continue_like_the_original():
    ex = executor()
    driver = Driver(ex)
    source = driver.add(TARGET)
    driver.step()  # prefill: samples the first token
    driver.step()  # first decode: samples the second
    first, second = driver.generated(source)[:2]
    blocks = driver.requests[source].blocks
    copies = list(zip(blocks, range(NUM_BLOCKS - len(blocks), NUM_BLOCKS)))
    # A second request whose prefix K/V are copies (copy-on-write of a shared prefix): it never
    # computed them, yet decoding from them must give the same token as the original.
    clone = SeqWork(req_id=99, token_ids=np.array([first]), start_pos=len(TARGET),
                    block_table=[dst for _, dst in copies], sample=True)
    assert ex.execute(StepWork(step=9, seqs=[clone], copies=copies)) == {99: second}


def test_a_wrong_block_table_changes_the_tokens():
    batch = prompts(3, [40] * 6)
    ex = executor(verify_every=0)
    driver = Driver(ex)
    ids = [driver.add(p) for p in batch]
    driver.step()
    right = driver.step()  # one decode step each, with the right tables
    wrong = ModelExecutor(NUM_BLOCKS, BLOCK_SIZE, backend="numpy")
    wrong_driver = Driver(wrong)
    for p in batch:
        wrong_driver.add(p)
    wrong_driver.step()
    # Same step, but each request reads its neighbour's blocks for its context.
    first = [wrong_driver.requests[i].generated[0] for i in ids]
    assert first == [driver.requests[i].generated[0] for i in ids]
    tables = [wrong_driver.requests[i].blocks for i in ids]
    seqs = [SeqWork(req_id=i, token_ids=np.array([first[i]]), start_pos=40,
                    block_table=tables[(i + 1) % len(ids)] + [NUM_BLOCKS - 1 - i], sample=True) for i in ids]
    swapped = wrong.execute(StepWork(step=1, seqs=seqs))
    assert sum(swapped[i] != right[i] for i in ids) >= 4


def test_verify_names_the_request_and_block_of_a_corrupted_cache():
    ex = executor(verify_every=1)
    driver = Driver(ex)
    req = driver.add(TARGET)
    driver.step()
    driver.step()
    victim = driver.requests[req].blocks[2]
    ex.cache.v[1, victim, 3] += 0.5  # one token of one layer's V
    with pytest.raises(gpu.VerifyError) as caught:
        driver.step()
    err = caught.value
    assert (err.req_id, err.layer, err.logical_block, err.physical_block) == (req, 1, 2, victim)
    assert err.position == 2 * BLOCK_SIZE + 3
    assert f"request {req}" in str(err) and f"physical block {victim}" in str(err)


def test_freed_requests_are_forgotten_and_prefix_hits_are_not_verified():
    ex = executor()
    out = ex.execute(StepWork(step=0, seqs=[SeqWork(1, np.array(TARGET), 0, [0, 1, 2, 3], True)]))
    ex.verify_request(1, [0, 1, 2, 3], out[1])
    ex.execute(StepWork(step=1, seqs=[], freed=[1]))
    with pytest.raises(KeyError):
        ex.verify_request(1, [0, 1, 2, 3])
    # Starting past position 0 (a prefix-cache hit on blocks 0-3): runs, but cannot be verified.
    hit = SeqWork(2, np.array([5, 6]), len(TARGET), [0, 1, 2, 3, 4], True)
    assert set(ex.execute(StepWork(step=2, seqs=[hit]))) == {2}
    with pytest.raises(ValueError, match="unknown"):
        ex.verify_request(2, [0, 1, 2, 3, 4])


def test_bad_work_is_refused_with_the_request_named():
    ex = executor()
    with pytest.raises(ValueError, match="request 4"):
        ex.execute(StepWork(step=0, seqs=[SeqWork(4, np.arange(20), 0, [0, 1], True)]))
    with pytest.raises(ValueError, match="host slot"):
        ex.execute(StepWork(step=0, seqs=[], swap_out=[(0, 3)]))


def test_sizes_and_description():
    ex = executor()
    assert ex.name == "numpy" and ex.device == "cpu (numpy)"
    assert ex.bytes_per_block == 2 * 2 * BLOCK_SIZE * 2 * 32 * 4
    assert ModelExecutor.block_bytes(16, num_layers=2, num_kv_heads=2, head_dim=32) == 16 * 1024
    gpu_sizes = {k: v for k, v in GPU_MODEL.items() if k in ("num_layers", "num_kv_heads", "head_dim", "dtype")}
    assert ModelExecutor.block_bytes(16, **gpu_sizes) == 64 * 1024
    assert "2 layers" in ex.describe() and "float32" in ex.describe()
    assert ModelExecutor.with_defaults(8, 16, backend="numpy").config.head_dim == CPU_MODEL["head_dim"]
    with pytest.raises(ValueError, match="bfloat16"):
        ModelExecutor(8, 16, backend="numpy", dtype="bfloat16")
