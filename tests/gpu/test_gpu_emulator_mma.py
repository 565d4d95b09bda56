"""The emulator's tensor-core shim (mma.sync m16n8k16 / m16n8k8, fp16 / bf16 in, fp32 out)
against a scalar reference, through the very helpers the decode kernel calls (common.cuh).

The fragments are dealt to the 32 lanes here with the PTX ISA's tables ("Matrix Fragments for
mma.m16n8k16 / mma.m16n8k8 with floating point type"), written out independently of the shim;
each lane runs the mma and the result is put back together with the accumulator table. With
fp16 / bf16 inputs every product is exact and so is the float64 sum, so the shim must match
float32(A @ B + C) bit for bit.
"""

import numpy as np
import pytest

from cuda_emu import emulator

pytestmark = pytest.mark.skipif(emulator.unavailable() is not None, reason=emulator.unavailable() or "")

PROBE = r"""
template <typename T>
__global__ void mma_probe(const unsigned* a, const unsigned* b, const float* c, float* d, int k, int lanes) {
    const int lane = threadIdx.x;
    if (lane >= lanes) return;  // a warp that is not whole: the emulator must refuse the mma
    const float cin[4] = {c[4 * lane], c[4 * lane + 1], c[4 * lane + 2], c[4 * lane + 3]};
    float out[4];
    if (k == 16) {
        const unsigned av[4] = {a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3]};
        const unsigned bv[2] = {b[2 * lane], b[2 * lane + 1]};
        T::mma16816(out, av, bv, cin);
    } else {
        const unsigned av[2] = {a[4 * lane], a[4 * lane + 1]};
        const unsigned bv[1] = {b[2 * lane]};
        T::mma1688(out, av, bv, cin);
    }
    for (int i = 0; i < 4; ++i) d[4 * lane + i] = out[i];
}
"""
NAMES = ["mma_probe<F16>", "mma_probe<BF16>"]


def a_position(lane: int, i: int, k: int) -> tuple[int, int]:
    """(row, col) of element a_i held by `lane` (PTX ISA tables)."""
    g, t = lane // 4, lane % 4
    if k == 16:
        row = g if i in (0, 1, 4, 5) else g + 8
        col = t * 2 + (i & 1) + (8 if i >= 4 else 0)
    else:
        row = g if i in (0, 1) else g + 8
        col = t * 2 + (i & 1)
    return row, col


def b_position(lane: int, i: int, k: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    row = t * 2 + (i & 1) + (8 if k == 16 and i >= 2 else 0)
    return row, g


def c_position(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return (g if i < 2 else g + 8), t * 2 + (i & 1)


def to_bits(x: np.ndarray, storage: str) -> np.ndarray:
    if storage == "float16":
        return x.astype(np.float16).view(np.uint16)
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncation: exact bf16 values


def from_bits(bits: np.ndarray, storage: str) -> np.ndarray:
    if storage == "float16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.fixture(scope="module")
def probe():
    from gpu import cupy_backend

    emu = emulator.Emulator()
    fake = emulator.FakeCupy(emu)
    module = emu.module(cupy_backend.kernel_source() + PROBE, NAMES)
    return emu, fake, module


def run_probe(probe, storage: str, a_bits, b_bits, c, k: int, lanes: int = 32):
    emu, fake, module = probe
    name = NAMES[0] if storage == "float16" else NAMES[1]
    a_regs = np.zeros((32, 4), np.uint32)
    b_regs = np.zeros((32, 2), np.uint32)
    c_regs = np.zeros((32, 4), np.float32)
    for lane in range(32):
        for i in range(k // 2):  # two 16-bit elements per register, the lower index in the low half
            r, col = a_position(lane, i, k)
            a_regs[lane, i // 2] |= np.uint32(a_bits[r, col]) << np.uint32(16 * (i & 1))
        for i in range(k // 4):
            r, col = b_position(lane, i, k)
            b_regs[lane, i // 2] |= np.uint32(b_bits[r, col]) << np.uint32(16 * (i & 1))
        for i in range(4):
            c_regs[lane, i] = c[c_position(lane, i)]
    d = fake.zeros((32, 4), np.float32)
    args = (fake.asarray(a_regs), fake.asarray(b_regs), fake.asarray(c_regs), d, np.int32(k), np.int32(lanes))
    emu.launch(module.entries[name], name, 0, (1, 1, 1), (32, 1, 1), args)
    out = np.zeros((16, 8), np.float32)
    for lane in range(32):
        for i in range(4):
            out[c_position(lane, i)] = d[lane, i]
    return out


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
@pytest.mark.parametrize("k", [16, 8])
def test_mma_matches_the_scalar_reference_bit_for_bit(probe, storage, k):
    rng = np.random.default_rng(k + (storage == "bfloat16"))
    for trial in range(3):
        a_bits = to_bits(rng.standard_normal((16, k)) * 4, storage)
        b_bits = to_bits(rng.standard_normal((k, 8)), storage)
        c = rng.standard_normal((16, 8)).astype(np.float32) * (trial != 0)
        expect = (from_bits(a_bits, storage) @ from_bits(b_bits, storage) + c.astype(np.float64)).astype(np.float32)
        got = run_probe(probe, storage, a_bits, b_bits, c, k)
        assert np.array_equal(got.view(np.uint32), expect.view(np.uint32)), (got - expect)


def test_a_swapped_fragment_changes_the_result(probe):
    # The check above is not vacuous: deal A transposed within each 8x8 quarter and it must fail.
    rng = np.random.default_rng(7)
    a_bits = to_bits(rng.standard_normal((16, 16)), "float16")
    b_bits = to_bits(rng.standard_normal((16, 8)), "float16")
    c = np.zeros((16, 8), np.float32)
    swapped = a_bits.copy()
    for r0 in (0, 8):
        for c0 in (0, 8):
            swapped[r0:r0 + 8, c0:c0 + 8] = a_bits[r0:r0 + 8, c0:c0 + 8].T
    expect = (from_bits(a_bits, "float16") @ from_bits(b_bits, "float16")).astype(np.float32)
    assert not np.array_equal(run_probe(probe, "float16", swapped, b_bits, c, 16), expect)


def test_mma_in_a_partial_warp_is_an_error(probe):
    rng = np.random.default_rng(8)
    a_bits = to_bits(rng.standard_normal((16, 16)), "float16")
    b_bits = to_bits(rng.standard_normal((16, 8)), "float16")
    with pytest.raises(emulator.EmulatorError, match="exited"):
        run_probe(probe, "float16", a_bits, b_bits, np.zeros((16, 8), np.float32), 16, lanes=16)
