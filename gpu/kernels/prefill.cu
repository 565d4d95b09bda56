// Paged prefill attention: a variable-length batch of query chunks, causal, over paged K/V.
//
// Sequence s owns query rows cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1 and has seq_lens[s] tokens in
// the cache, the chunk's own K/V included (written before the call). Its query j sits at position
// seq_lens[s] - q_len + j and attends to keys 0 .. that position.
//
// Grid (ceil(max_q_len * group / ROWS), num_kv_heads, num_seqs), PREFILL_THREADS threads. A
// block owns ROWS (query token, head) rows of one kv head's group, flattened row = token * group
// + head_in_group, so any group size tiles evenly. It walks the keys in tiles of BK tokens staged
// in shared memory as float; each warp owns ROWS_PER_WARP rows and for each one computes the
// tile's scores with one key per lane (no shuffles), an online-softmax update, then P.V with one
// head_dim slice per lane. CUDA cores only: this favours clarity over tensor-core speed.
#include "common.cuh"

#define PREFILL_WARPS 4
#define PREFILL_THREADS (PREFILL_WARPS * 32)

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(PREFILL_THREADS) paged_prefill_kernel(
    const typename T::raw* __restrict__ q,        // [total_q_tokens, num_heads, HEAD_DIM]
    const typename T::raw* __restrict__ k_cache,  // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    const typename T::raw* __restrict__ v_cache,  // same as k_cache
    const int* __restrict__ block_tables,         // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ cu_seqlens_q,         // [num_seqs + 1]
    const int* __restrict__ seq_lens,             // [num_seqs]
    typename T::raw* __restrict__ out,            // [total_q_tokens, num_heads, HEAD_DIM]
    int num_heads, int num_kv_heads, int block_size, int max_blocks_per_seq, float scale_log2) {
    // Sized so q, K and V tiles stay within the 48 KiB of static shared memory.
    constexpr int ROWS_PER_WARP = (512 / HEAD_DIM) < 8 ? (512 / HEAD_DIM) : 8;
    constexpr int ROWS = PREFILL_WARPS * ROWS_PER_WARP;
    constexpr int BK = HEAD_DIM <= 128 ? 32 : 16;
    constexpr int DIMS_PER_LANE = HEAD_DIM / 32;
    constexpr int VEC = T::kVec;
    constexpr int VECS_PER_ROW = HEAD_DIM / VEC;
    static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM >= 32 && HEAD_DIM <= 256,
                  "head_dim a multiple of 32 in [32, 256]: one lane per 32nd of the row in P.V");
    static_assert(HEAD_DIM % VEC == 0, "head_dim must be a whole number of 16-byte vectors");

    __shared__ float q_s[ROWS][HEAD_DIM];
    __shared__ float k_s[BK][HEAD_DIM + 1];  // +1: lane j reads row j, so rows must hit other banks
    __shared__ float v_s[BK][HEAD_DIM];
    __shared__ float p_s[PREFILL_WARPS][BK];

    const int seq = blockIdx.z;
    const int kv_head = blockIdx.y;
    const int q_start = cu_seqlens_q[seq];
    const int q_len = cu_seqlens_q[seq + 1] - q_start;
    const int group = num_heads / num_kv_heads;
    const int num_rows = q_len * group;
    const int row0 = blockIdx.x * ROWS;
    if (row0 >= num_rows) return;
    const int ctx = seq_lens[seq] - q_len;  // cached tokens before the chunk
    const int last_row = min(row0 + ROWS, num_rows) - 1;
    const int kv_end = ctx + last_row / group + 1;  // this block reads keys [0, kv_end)
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    for (int idx = threadIdx.x; idx < ROWS * HEAD_DIM; idx += PREFILL_THREADS) {
        const int r = row0 + idx / HEAD_DIM;
        const int d = idx % HEAD_DIM;
        float x = 0.f;
        if (r < num_rows) {
            const long long qrow =
                ((long long)(q_start + r / group) * num_heads + kv_head * group + r % group);
            x = T::to_float(q[qrow * HEAD_DIM + d]) * scale_log2;
        }
        q_s[idx / HEAD_DIM][d] = x;
    }

    float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        m[i] = SERVESIM_NO_SCORE;
        l[i] = 0.f;
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE; ++c) acc[i][c] = 0.f;
    }

    for (int kv0 = 0; kv0 < kv_end; kv0 += BK) {
        __syncthreads();  // q_s is written (first tile) / the previous tile is consumed
        for (int idx = threadIdx.x; idx < BK * VECS_PER_ROW; idx += PREFILL_THREADS) {
            const int j = idx / VECS_PER_ROW;
            const int vi = idx % VECS_PER_ROW;
            const int pos = kv0 + j;
            float kf[VEC], vf[VEC];
            if (pos < kv_end) {
                const long long off =
                    paged_row(table, pos, block_size, num_kv_heads, HEAD_DIM, kv_head) + vi * VEC;
                T::unpack(*reinterpret_cast<const uint4*>(k_cache + off), kf);
                T::unpack(*reinterpret_cast<const uint4*>(v_cache + off), vf);
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) kf[e] = vf[e] = 0.f;
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                k_s[j][vi * VEC + e] = kf[e];
                v_s[j][vi * VEC + e] = vf[e];
            }
        }
        __syncthreads();

#pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; ++i) {
            const int rl = warp * ROWS_PER_WARP + i;
            const int r = row0 + rl;
            // Both conditions are the same for the whole warp, so the shuffles below are safe.
            if (r >= num_rows) continue;
            const int qpos = ctx + r / group;
            if (kv0 > qpos) continue;
            float s = neg_inf();
            if (lane < BK && kv0 + lane <= qpos) {
                float dot = 0.f;
#pragma unroll 8
                for (int d = 0; d < HEAD_DIM; ++d) dot += q_s[rl][d] * k_s[lane][d];
                s = dot;
            }
            const float m_new = fmaxf(m[i], warp_max(s));  // key kv0 <= qpos is always live
            const float corr = exp2f(m[i] - m_new);
            const float p = exp2f(s - m_new);
            l[i] = l[i] * corr + warp_sum(p);
            if (lane < BK) p_s[warp][lane] = p;
            __syncwarp();
#pragma unroll
            for (int c = 0; c < DIMS_PER_LANE; ++c) {
                float a = acc[i][c] * corr;
#pragma unroll 8
                for (int j = 0; j < BK; ++j) a += p_s[warp][j] * v_s[j][lane + 32 * c];
                acc[i][c] = a;
            }
            m[i] = m_new;
            __syncwarp();  // p_s is rewritten for the next row
        }
    }

#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        const int r = row0 + warp * ROWS_PER_WARP + i;
        if (r >= num_rows) continue;
        const long long orow =
            ((long long)(q_start + r / group) * num_heads + kv_head * group + r % group);
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE; ++c)
            out[orow * HEAD_DIM + lane + 32 * c] = T::from_float(acc[i][c] * inv);
    }
}
