"""The emulator's tensor-core shim (mma.sync m16n8k16 / m16n8k8, fp16 / bf16 / tf32 in, fp32 out)
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

# slow: the kernel emulator's suites compile with g++ (left out of the plain `pytest -q`).
pytestmark = [pytest.mark.skipif(emulator.unavailable() is not None, reason=emulator.unavailable() or ""),
              pytest.mark.slow]

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


def build_probe(source: str, names: list[str]):
    """(emulator, fake CuPy, module) of the kernels' source plus a probe's."""
    from gpu import cupy_backend

    emu = emulator.Emulator()
    return emu, emulator.FakeCupy(emu), emu.module(cupy_backend.kernel_source() + source, names)


@pytest.fixture(scope="module")
def probe():
    return build_probe(PROBE, NAMES)


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


# -- .tf32 (fp32 storage's 3xTF32 decode) -------------------------------------------------------
# mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, PTX ISA "Matrix Fragments for mma.m16n8k8"
# (.tf32): one element per register; a_i: row g (+8 for i = 1, 3), col t (+4 for i = 2, 3);
# b_i: row t (+4 for i = 1), col g; C / D as for f16. A .tf32 operand is an .f32 pattern whose
# low 13 mantissa bits the mma ignores.
TF32_PROBE = r"""
__global__ void mma_probe_tf32(const unsigned* a, const unsigned* b, const float* c, float* d) {
    const int lane = threadIdx.x;
    const float cin[4] = {c[4 * lane], c[4 * lane + 1], c[4 * lane + 2], c[4 * lane + 3]};
    const unsigned av[4] = {a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3]};
    const unsigned bv[2] = {b[2 * lane], b[2 * lane + 1]};
    float out[4];
    F32::mma1688(out, av, bv, cin);
    for (int i = 0; i < 4; ++i) d[4 * lane + i] = out[i];
}
__global__ void split_probe(const float* x, unsigned* hi, unsigned* lo, int n) {
    const int i = threadIdx.x;
    if (i < n) F32::split_tf32(x[i], hi[i], lo[i]);
}
"""
TF32_NAMES = ["mma_probe_tf32", "split_probe"]


def tf32_a_position(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return g + 8 * (i & 1), t + 4 * (i >> 1)


def tf32_b_position(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return t + 4 * i, g


def tf32(x: np.ndarray) -> np.ndarray:
    """The value an .f32 pattern has as a .tf32 operand: its low 13 mantissa bits dropped."""
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


@pytest.fixture(scope="module")
def tf32_probe():
    return build_probe(TF32_PROBE, TF32_NAMES)


def run_tf32(probe, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """D = A B + C through F32::mma1688, A [16 x 8] and B [8 x 8] float32 dealt by the PTX tables."""
    emu, fake, module = probe
    a_regs = np.zeros((32, 4), np.uint32)
    b_regs = np.zeros((32, 2), np.uint32)
    c_regs = np.zeros((32, 4), np.float32)
    bits_a, bits_b = a.astype(np.float32).view(np.uint32), b.astype(np.float32).view(np.uint32)
    for lane in range(32):
        for i in range(4):
            a_regs[lane, i] = bits_a[tf32_a_position(lane, i)]
            c_regs[lane, i] = c[c_position(lane, i)]
        for i in range(2):
            b_regs[lane, i] = bits_b[tf32_b_position(lane, i)]
    d = fake.zeros((32, 4), np.float32)
    emu.launch(module.entries["mma_probe_tf32"], "mma_probe_tf32", 0, (1, 1, 1), (32, 1, 1),
               (fake.asarray(a_regs), fake.asarray(b_regs), fake.asarray(c_regs), d))
    out = np.zeros((16, 8), np.float32)
    for lane in range(32):
        for i in range(4):
            out[c_position(lane, i)] = d[lane, i]
    return out


def test_tf32_mma_ignores_the_low_13_bits_and_matches_the_reference_bit_for_bit(tf32_probe):
    # Full 23-bit mantissas: a shim that rounded, or kept 12 or 14 bits, or used fp32 as is,
    # gives other bits (the products of two 11-bit significands are exact in float64).
    rng = np.random.default_rng(11)
    for trial in range(3):
        a = (rng.standard_normal((16, 8)) * 3).astype(np.float32)
        b = rng.standard_normal((8, 8)).astype(np.float32)
        c = rng.standard_normal((16, 8)).astype(np.float32) * (trial != 0)
        expect = (tf32(a) @ tf32(b) + c.astype(np.float64)).astype(np.float32)
        got = run_tf32(tf32_probe, a, b, c)
        assert np.array_equal(got.view(np.uint32), expect.view(np.uint32)), got - expect
        exact = (a.astype(np.float64) @ b.astype(np.float64) + c).astype(np.float32)
        assert not np.array_equal(got, exact)  # the inputs did have bits below tf32's


def test_tf32_bit_13_counts_and_bit_12_does_not(tf32_probe):
    one = np.zeros((16, 8), np.float32)
    one[3, 5] = 1.0
    b = np.zeros((8, 8), np.float32)
    b[5, 2] = 1.0
    c = np.zeros((16, 8), np.float32)
    for bit, counts in ((12, False), (13, True)):
        a = one.copy()
        a.view(np.uint32)[3, 5] |= np.uint32(1 << bit)
        got = run_tf32(tf32_probe, a, b, c)
        assert (got[3, 2] != 1.0) == counts, (bit, got[3, 2])


def test_tf32_fragments_follow_the_ptx_tables(tf32_probe):
    # A one-hot A and B find each element where the tables put it: dealing A with the f16
    # layout (col 2t + (i & 1)) or B transposed moves the product to another element of D.
    for row, col in ((0, 0), (9, 3), (6, 4), (15, 7)):
        a = np.zeros((16, 8), np.float32)
        a[row, col] = 2.0
        b = np.zeros((8, 8), np.float32)
        b[col, (row + 3) % 8] = 3.0
        got = run_tf32(tf32_probe, a, b, np.zeros((16, 8), np.float32))
        expect = np.zeros((16, 8), np.float32)
        expect[row, (row + 3) % 8] = 6.0
        assert np.array_equal(got, expect), (row, col)


def test_split_tf32_is_exact_and_its_low_part_carries_the_rest(tf32_probe):
    emu, fake, module = tf32_probe
    rng = np.random.default_rng(12)
    x = np.concatenate([rng.standard_normal(28) * 10.0 ** rng.integers(-6, 6, 28),
                        [0.0, -0.0, 1.0, -3.0000002]]).astype(np.float32)
    hi, lo = fake.zeros(32, np.uint32), fake.zeros(32, np.uint32)
    emu.launch(module.entries["split_probe"], "split_probe", 0, (1, 1, 1), (32, 1, 1),
               (fake.asarray(x), hi, lo, np.int32(32)))
    hi, lo = np.array(hi), np.array(lo)
    assert np.all(hi & 0x1FFF == 0)  # hi is exactly a tf32 value
    assert np.array_equal(hi.view(np.float32).astype(np.float64) + lo.view(np.float32), x.astype(np.float64))
    # What the mma sees of hi + lo is within 2^-20 of x; hi alone (plain tf32) is not.
    seen = tf32(hi.view(np.float32)) + tf32(lo.view(np.float32))
    rel = np.abs(seen - x) / np.maximum(np.abs(x), 1e-30)
    assert rel.max() <= 2.0 ** -20
    assert (np.abs(tf32(x) - x) / np.maximum(np.abs(x), 1e-30)).max() > 2.0 ** -14
