"""Mutation check of the emulator cases: plants one known bug at a time in a copy of
gpu/kernels, runs a suite against it (`run.py --kernel-dir`), and reports whether the cases
noticed (a failing case, an emulator error, a fault, or a UBSan report).

`python tests/gpu/cuda_emu/mutate.py [NAME ...]`; exit 1 when a planted bug went unnoticed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNELS = HERE.parents[2] / "gpu" / "kernels"

# name: (file, text that must occur exactly once, replacement, run.py arguments)
MUTATIONS = {
    # (The CUDA-core kernel's copies of text the tensor-core kernel repeats: targets must be unique.)
    "decode_no_syncthreads": ("decode.cu", "sm_l[warp][g] = l[g];\n            }\n        }\n    }\n    __syncthreads();\n",
                              "sm_l[warp][g] = l[g];\n            }\n        }\n    }\n", ["--suite", "ci"]),
    "decode_mask_off_by_one": ("decode.cu", "if (pos < start || pos >= end)\n", "if (pos < start || pos > end)\n",
                               ["--suite", "ci"]),
    "decode_second_buffer_ignored": ("decode.cu", "        compute_tile(t1, kb, vb);", "        compute_tile(t1, ka, va);",
                                     ["--suite", "ci"]),
    "decode_tile_block_lookup_wrong": ("decode.cu", "block_base = (long long)table[first >> LOG2_BS] << LOG2_BS;",
                                       "block_base = (long long)table[start >> LOG2_BS] << LOG2_BS;",
                                       ["--suite", "ci"]),
    "decode_last_partition_not_extended": (
        "decode.cu", "        end = split == ds.n - 1 ? seq_len : min(start + ds.part, seq_len);\n",
        "        end = min(start + ds.part, seq_len);\n",
        ["--suite", "misuse"]),
    "split_count_not_clamped": ("decode.cu", "        n = n < num_splits ? n : num_splits;\n", "",
                                ["--suite", "misuse"]),
    "split_depends_on_batch": ("decode.cu", "        active = split < ds.n;\n",
                               "        active = split < num_splits;\n", ["--suite", "ci"]),
    "prefill_no_syncwarp_before_pv": ("prefill.cu", "            if (lane < BK) p_s[warp][lane] = p;\n            __syncwarp();\n",
                                      "            if (lane < BK) p_s[warp][lane] = p;\n", ["--suite", "ci"]),
    "prefill_no_top_syncthreads": ("prefill.cu",
                                   "        __syncthreads();  // q_s is written (first tile) / the previous tile is consumed\n",
                                   "", ["--suite", "ci"]),
    "prefill_divergent_shuffle": ("prefill.cu", "const float m_new = fmaxf(m[i], warp_max(s));",
                                  "const float m_new = fmaxf(m[i], lane < BK ? warp_max(s) : s);", ["--suite", "ci"]),
    "prefill_causal_off_by_one": ("prefill.cu", "if (lane < BK && kv0 + lane <= qpos) {",
                                  "if (lane < BK && kv0 + lane <= qpos + 1) {", ["--suite", "ci"]),
    # The tensor-core decode kernel (fp16 / bf16).
    "mma_v_pair_swapped": ("decode.cu", "            const unsigned a[2] = {__byte_perm(vw[0][c][w], vw[1][c][w], 0x5410u),",
                           "            const unsigned a[2] = {__byte_perm(vw[1][c][w], vw[0][c][w], 0x5410u),",
                           ["--suite", "ci"]),
    "mma_correction_of_own_head": ("decode.cu", "const float corr_lo = __shfl_sync(SERVESIM_FULL_MASK, corr, 8 * (t & COL_T_MASK));",
                                   "const float corr_lo = corr;", ["--suite", "ci"]),
    "mma_edge_tile_skipped": ("decode.cu", "if (start % TOK != 0 || (head == tail && end % TOK != 0)) {",
                              "if (start % TOK != 0) {", ["--suite", "ci"]),
    "mma_last_full_tile_dropped": ("decode.cu", "    const int full_hi = end / TOK;\n",
                                   "    const int full_hi = end / TOK - (end >= 2 * TOK);\n", ["--suite", "ci"]),
    "mma_output_odd_dim_from_even": ("decode.cu", "sm_acc[warp][2 * t + h][dim + 1] = acc[j][2 + h];",
                                     "sm_acc[warp][2 * t + h][dim + 1] = acc[j][h];", ["--suite", "ci"]),
    "mma_q_of_lane_zero": ("decode.cu", "const uint4 qv = sm_q[ks][lane];", "const uint4 qv = sm_q[ks][lane & ~3];",
                           ["--suite", "ci"]),
    # 16-token tiles over 8-token blocks: one lookup per group of 8 rows, K's kept for V's.
    "mma_groups_v_reads_first_group": ("decode.cu", "grp_at(v_lane[x & 1], x >> 1,",
                                       "grp_at(v_lane[x & 1], 0,", ["--suite", "ci"]),
    # 16-token tiles over 1-4-token blocks: a lookup per row, at fixed offsets from a lane's
    # table pointer; V's rows 2t, 2t + 1 share one (taken if either row is in the partition).
    "mma_rows_k_second_ntile_from_first": ("decode.cu", "row_at(k_row_lane, kt[(8 * nt) >> LOG2_BS])",
                                           "row_at(k_row_lane, kt[0])", ["--suite", "ci"]),
    "mma_rows_v_pair_lookup_when_first_masked": (
        "decode.cu", "const bool need = live || (BLOCK_SIZE >= 2 && pos + 1 >= start && pos + 1 < end);",
        "const bool need = live;", ["--suite", "ci"]),
    "mma_rows_v_pair_lookup_when_first_masked_bs4": (
        "decode.cu", "const bool need = live || (BLOCK_SIZE >= 2 && pos + 1 >= start && pos + 1 < end);",
        "const bool need = live || (BLOCK_SIZE == 2 && pos + 1 >= start && pos + 1 < end);",
        ["--suite", "ci"]),
    # (A lookup for a masked row reads the table past the sequence's last block: the guard page
    # after the table faults. g++ -O2 sinks the load into the `live` branch, so the UBSan build.)
    "mma_rows_lookup_masked_rows_bs1": (
        "decode.cu", "const bool need = live ||", "const bool need = BLOCK_SIZE == 1 ||",
        ["--suite", "ci", "--variant", "ubsan"]),
    "mma_rows_tile_pointer_assumes_16_token_tiles": (
        "decode.cu", "return lane_tab + (unsigned)tile * (unsigned)(TOK >> LOG2_BS);",
        "return lane_tab + (unsigned)tile * (unsigned)(16 >> LOG2_BS);", ["--suite", "ci"]),
    # fp32 on tensor cores (3xTF32): each dropped or misplaced piece must cost more accuracy
    # than the fp32 bound of cases.FP32_ACCURACY allows.
    "tf32x3_k_lo_dropped": ("decode.cu", "        F32::mma1688(acc[0], a, b_lo, acc[0]);\n", "", ["--suite", "ci"]),
    "tf32x3_v_lo_dropped": ("decode.cu", "            F32::mma1688(acc, a_lo, b_hi, acc);\n", "", ["--suite", "ci"]),
    "tf32x3_p_lo_dropped": ("decode.cu", "            if (!kFold) F32::mma1688(acc, a_hi, b_lo, acc);\n", "", ["--suite", "ci"]),
    "tf32x3_folded_p_lo_dropped": ("decode.cu", "if (lane >= 16) p.hi[nt][e] = lo_of_head_below;",
                                   "if (lane >= 16) p.hi[nt][e] = 0u;", ["--suite", "ci"]),
    "tf32x3_q_lo_rows_dropped": ("decode.cu", "s[e] = acc[1][e] + (acc[0][e] + (acc[1][2 + e] + acc[0][2 + e]));",
                                 "s[e] = acc[1][e] + acc[0][e];", ["--suite", "ci"]),
    "tf32x3_split_keeps_12_bits": ("common.cuh", "hi = __float_as_uint(x) & 0xffffe000u;",
                                   "hi = __float_as_uint(x) & 0xfffff000u;", ["--suite", "ci"]),
    "tf32x3_v_tokens_swapped": ("decode.cu", "const unsigned v[4] = {vw[2 * nt][c][0], vw[2 * nt][c][1], vw[2 * nt + 1][c][0], vw[2 * nt + 1][c][1]};",
                                "const unsigned v[4] = {vw[2 * nt + 1][c][0], vw[2 * nt + 1][c][1], vw[2 * nt][c][0], vw[2 * nt][c][1]};",
                                ["--suite", "ci"]),
    "tf32x3_fold_columns_not_added": ("decode.cu", "acc[j][e] += __shfl_xor_sync(SERVESIM_FULL_MASK, acc[j][e], 2);",
                                      "acc[j][e] += 0.f;", ["--suite", "ci"]),
    "tf32x3_fold_corrections_of_padding_heads": ("decode.cu", "static const int kColTMask = kFold ? 1 : 3;",
                                                 "static const int kColTMask = 3;", ["--suite", "ci"]),
    "fp32_cuda_core_load_clamp_past_end": ("decode.cu", "start), end - 1);", "start), end);",
                                           ["--suite", "ci"]),
    "write_kv_writes_slot_minus1": ("write_kv.cu", "if (slot < 0) return;", "if (slot < -1) return;",
                                    ["--suite", "write_kv", "--guard", "1"]),
}


def run(name: str, workdir: Path) -> dict:
    """Plants mutation `name`, runs its suite, returns what happened."""
    file, old, new, args = MUTATIONS[name]
    kdir = workdir / name
    shutil.copytree(KERNELS, kdir)
    text = (kdir / file).read_text()
    if text.count(old) != 1:
        return {"name": name, "detected": False, "how": f"target text not found exactly once in {file}"}
    (kdir / file).write_text(text.replace(old, new))
    t0 = time.time()
    r = subprocess.run([sys.executable, str(HERE / "run.py"), "--kernel-dir", str(kdir), "--quiet", *args],
                       capture_output=True, text=True, timeout=1800)
    out = r.stdout + r.stderr
    how = [line for line in out.splitlines() if line.startswith(("FAIL", "[emu]")) or "runtime error:" in line][:3]
    if r.returncode and not how:
        how = [out.strip().splitlines()[-1] if out.strip() else f"exit {r.returncode}"]
    return {"name": name, "detected": r.returncode != 0, "exit": r.returncode, "how": how,
            "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(MUTATIONS)
    with tempfile.TemporaryDirectory(prefix="servesim-mutants-") as tmp:
        results = [run(n, Path(tmp)) for n in names]
    for r in results:
        print(json.dumps(r)[:600], flush=True)
    missed = [r["name"] for r in results if not r["detected"]]
    print(f"mutations: {len(results) - len(missed)} detected, {len(missed)} missed {missed}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
