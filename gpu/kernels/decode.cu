// Paged decode attention: one query token per sequence against that sequence's paged K/V.
//
// Grid (num_seqs, num_kv_heads * tiles_per_kv_head, num_splits), DECODE_THREADS threads.
// One thread block owns one sequence and HEADS_PER_BLOCK query heads that share one kv head, so
// each K/V row is read from memory once and used by all of those heads (grouped-query attention).
//
// Inside the block a "slot" is LANES_PER_TOKEN lanes that together hold one token's head_dim row,
// 16 bytes each (one vector load). A slot walks its share of the tokens UNROLL at a time with an
// online softmax (running max m, running sum l, unnormalised output acc); slots are then merged
// by warp shuffles and the warps through shared memory.
//
// Split-K: with num_splits > 1 each block covers one partition of partition_size tokens and
// writes (acc, m, l) to part_acc / part_ml; paged_decode_reduce_kernel merges the partitions.
// A sequence's result depends only on its own length and partition_size, never on the rest of
// the batch, because every block runs the same token order whatever the grid.
#include "common.cuh"

#define DECODE_WARPS 4
#define DECODE_THREADS (DECODE_WARPS * 32)

template <typename T, int HEAD_DIM, int HEADS_PER_BLOCK>
__global__ void __launch_bounds__(DECODE_THREADS) paged_decode_kernel(
    const typename T::raw* __restrict__ q,        // [num_seqs, num_heads, HEAD_DIM]
    const typename T::raw* __restrict__ k_cache,  // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    const typename T::raw* __restrict__ v_cache,  // same as k_cache
    const int* __restrict__ block_tables,         // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,             // [num_seqs]
    typename T::raw* __restrict__ out,            // [num_seqs, num_heads, HEAD_DIM] (num_splits == 1)
    float* __restrict__ part_acc,                 // [num_seqs, num_heads, num_splits, HEAD_DIM]
    float* __restrict__ part_ml,                  // [num_seqs, num_heads, num_splits, 2]
    int num_heads, int num_kv_heads, int block_size, int max_blocks_per_seq, int num_splits,
    int partition_size, float scale_log2) {
    constexpr int VEC = T::kVec;
    constexpr int VECS_PER_ROW = HEAD_DIM / VEC;
    constexpr int LANES_PER_TOKEN = VECS_PER_ROW < 32 ? VECS_PER_ROW : 32;
    constexpr int NV = VECS_PER_ROW / LANES_PER_TOKEN;  // vectors per lane per row
    constexpr int ELEMS = NV * VEC;                     // head_dim elements one lane owns
    constexpr int SLOTS_PER_WARP = 32 / LANES_PER_TOKEN;
    constexpr int SLOTS = DECODE_WARPS * SLOTS_PER_WARP;
    constexpr int G = HEADS_PER_BLOCK;
    // Fewer tokens in flight per lane when q and acc already take many registers.
    constexpr int UNROLL = (G * ELEMS >= 64) ? 2 : 4;
    constexpr int TOKENS_PER_ITER = SLOTS * UNROLL;

    const int seq = blockIdx.x;
    const int heads_per_kv = num_heads / num_kv_heads;
    const int tiles_per_kv = heads_per_kv / G;
    const int kv_head = blockIdx.y / tiles_per_kv;
    const int head0 = kv_head * heads_per_kv + (blockIdx.y % tiles_per_kv) * G;
    const int split = blockIdx.z;

    const int seq_len = seq_lens[seq];
    const int start = split * partition_size;
    // An empty partition writes nothing: the reduce kernel reads only ceil(len / partition).
    if (num_splits > 1 && start >= seq_len) return;
    const int end = min(start + partition_size, seq_len);

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int slot_in_warp = lane / LANES_PER_TOKEN;
    const int sub = lane % LANES_PER_TOKEN;
    const int slot = warp * SLOTS_PER_WARP + slot_in_warp;
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;

    // This lane's slice of each query head, pre-scaled so scores come out in log2 units.
    float qr[G][ELEMS];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const long long qrow = ((long long)seq * num_heads + head0 + g) * HEAD_DIM;
#pragma unroll
        for (int j = 0; j < NV; ++j)
#pragma unroll
            for (int e = 0; e < VEC; ++e)
                qr[g][j * VEC + e] =
                    T::to_float(q[qrow + (j * LANES_PER_TOKEN + sub) * VEC + e]) * scale_log2;
    }

    float m[G], l[G], acc[G][ELEMS];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = SERVESIM_NO_SCORE;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) acc[g][e] = 0.f;
    }

    for (int base = start; base < end; base += TOKENS_PER_ITER) {
        // Issue every K and V load of this iteration before using any: more bytes in flight.
        uint4 kvec[UNROLL][NV], vvec[UNROLL][NV];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int pos = base + u * SLOTS + slot;
            valid[u] = pos < end;
            if (valid[u]) {
                const long long row =
                    paged_row(table, pos, block_size, num_kv_heads, HEAD_DIM, kv_head);
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    const long long off = row + (j * LANES_PER_TOKEN + sub) * VEC;
                    kvec[u][j] = *reinterpret_cast<const uint4*>(k_cache + off);
                    vvec[u][j] = *reinterpret_cast<const uint4*>(v_cache + off);
                }
            } else {
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    kvec[u][j] = make_uint4(0u, 0u, 0u, 0u);
                    vvec[u][j] = make_uint4(0u, 0u, 0u, 0u);
                }
            }
        }

        float s[UNROLL][G];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float kf[ELEMS];
#pragma unroll
            for (int j = 0; j < NV; ++j) T::unpack(kvec[u][j], kf + j * VEC);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int e = 0; e < ELEMS; ++e) dot += qr[g][e] * kf[e];
                // All 32 lanes reach here (invalid tokens carry zeros), as the shuffle needs.
#pragma unroll
                for (int off = LANES_PER_TOKEN / 2; off > 0; off >>= 1)
                    dot += __shfl_xor_sync(SERVESIM_FULL_MASK, dot, off);
                s[u][g] = valid[u] ? dot : neg_inf();
            }
        }

#pragma unroll
        for (int g = 0; g < G; ++g) {
            float m_new = m[g];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) m_new = fmaxf(m_new, s[u][g]);
            const float corr = exp2f(m[g] - m_new);
            m[g] = m_new;
            l[g] *= corr;
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) acc[g][e] *= corr;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float vf[ELEMS];
#pragma unroll
            for (int j = 0; j < NV; ++j) T::unpack(vvec[u][j], vf + j * VEC);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float p = exp2f(s[u][g] - m[g]);  // 0 for invalid tokens (s = -inf)
                l[g] += p;
#pragma unroll
                for (int e = 0; e < ELEMS; ++e) acc[g][e] += p * vf[e];
            }
        }
    }

    // Merge the slots of each warp: after this every slot holds the warp's state.
#pragma unroll
    for (int off = LANES_PER_TOKEN; off < 32; off <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m_o = __shfl_xor_sync(SERVESIM_FULL_MASK, m[g], off);
            const float l_o = __shfl_xor_sync(SERVESIM_FULL_MASK, l[g], off);
            const float m_new = fmaxf(m[g], m_o);
            const float a = exp2f(m[g] - m_new);
            const float b = exp2f(m_o - m_new);
            l[g] = l[g] * a + l_o * b;
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) {
                const float acc_o = __shfl_xor_sync(SERVESIM_FULL_MASK, acc[g][e], off);
                acc[g][e] = acc[g][e] * a + acc_o * b;
            }
            m[g] = m_new;
        }
    }

    __shared__ float sm_acc[DECODE_WARPS][G][HEAD_DIM];
    __shared__ float sm_m[DECODE_WARPS][G];
    __shared__ float sm_l[DECODE_WARPS][G];
    if (slot_in_warp == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
                for (int e = 0; e < VEC; ++e)
                    sm_acc[warp][g][(j * LANES_PER_TOKEN + sub) * VEC + e] = acc[g][j * VEC + e];
            if (sub == 0) {
                sm_m[warp][g] = m[g];
                sm_l[warp][g] = l[g];
            }
        }
    }
    __syncthreads();

    for (int idx = threadIdx.x; idx < G * HEAD_DIM; idx += DECODE_THREADS) {
        const int g = idx / HEAD_DIM;
        const int d = idx % HEAD_DIM;
        float m_all = sm_m[0][g];
#pragma unroll
        for (int w = 1; w < DECODE_WARPS; ++w) m_all = fmaxf(m_all, sm_m[w][g]);
        float l_all = 0.f, a_all = 0.f;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) {
            const float c = exp2f(sm_m[w][g] - m_all);
            l_all += sm_l[w][g] * c;
            a_all += sm_acc[w][g][d] * c;
        }
        const long long head_row = (long long)seq * num_heads + head0 + g;
        if (num_splits == 1) {
            out[head_row * HEAD_DIM + d] = T::from_float(l_all > 0.f ? a_all / l_all : 0.f);
        } else {
            const long long part = head_row * num_splits + split;
            part_acc[part * HEAD_DIM + d] = a_all;
            if (d == 0) {
                part_ml[2 * part] = m_all;
                part_ml[2 * part + 1] = l_all;
            }
        }
    }
}

// Merges the split-K partitions of paged_decode_kernel.
// Grid (num_seqs, num_heads), head_dim threads (any count works; threads stride over head_dim).
template <typename T>
__global__ void paged_decode_reduce_kernel(const float* __restrict__ part_acc,
                                           const float* __restrict__ part_ml,
                                           const int* __restrict__ seq_lens,
                                           typename T::raw* __restrict__ out, int num_heads,
                                           int head_dim, int num_splits, int partition_size) {
    const int seq = blockIdx.x;
    const int head = blockIdx.y;
    const int n = (seq_lens[seq] + partition_size - 1) / partition_size;
    const long long first = ((long long)seq * num_heads + head) * num_splits;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float r = 0.f;
        if (n == 1) {
            // Exactly the unsplit kernel's a / l, so short sequences do not depend on whether
            // a longer neighbour switched the batch to split-K.
            const float l1 = part_ml[2 * first + 1];
            r = l1 > 0.f ? part_acc[first * head_dim + d] / l1 : 0.f;
        } else if (n > 1) {
            float m_all = part_ml[2 * first];
            for (int i = 1; i < n; ++i) m_all = fmaxf(m_all, part_ml[2 * (first + i)]);
            float l_all = 0.f, a_all = 0.f;
            for (int i = 0; i < n; ++i) {
                const float c = exp2f(part_ml[2 * (first + i)] - m_all);
                l_all += part_ml[2 * (first + i) + 1] * c;
                a_all += part_acc[(first + i) * head_dim + d] * c;
            }
            r = l_all > 0.f ? a_all / l_all : 0.f;
        }
        out[((long long)seq * num_heads + head) * head_dim + d] = T::from_float(r);
    }
}
