// Paged decode attention: one query token per sequence against that sequence's paged K/V.
//
// Grid (num_seqs, num_kv_heads * tiles_per_kv_head, num_splits), DECODE_THREADS threads.
// One thread block owns one sequence, one partition of its tokens and HEADS_PER_BLOCK (G) query
// heads that share one kv head, so each K/V row is read once and used by all G heads.
//
// Inside a warp a "slot" is LANES_PER_TOKEN lanes that together hold one token's head_dim row,
// NV 16-byte vectors each (NV grows as G shrinks, see below). A warp works on tiles of TILE = slots x UNROLL consecutive
// tokens, aligned to TILE in the sequence; the block's warps take tiles in turn. The loads of a
// warp's next tile are issued before the math of its current one (two register buffers, used
// alternately), so a warp always has a tile's K and V in flight. BLOCK_SIZE is a compile-time
// power of two: a position's block and offset are a shift and a mask, and a tile that fits in
// one KV block looks its block up once. Scores use an online softmax (running max m, running
// sum l, unnormalised output acc); the slots, then the warps, are merged at the end.
//
// Split-K, sized per sequence: a sequence of len tokens is cut into n = ceil(len / part)
// partitions of part = max(min_partition, round_up(ceil(len / target_splits), granule))
// tokens, so n <= target_splits. target_splits comes from the SM count (enough blocks for one
// sequence to fill the GPU); nothing in the rule looks at the rest of the batch, so a sequence's
// result is the same bits alone or in any batch. With n == 1 the block writes `out` itself;
// otherwise it writes (acc, m, l) to part_acc / part_ml and paged_decode_reduce_kernel merges.
// The grid's num_splits must be at least every sequence's n (the host derives it from
// max_seq_len); should it be smaller (a max_seq_len below the real maximum), the last partition
// of the grid runs to the sequence's end, so no token is dropped and nothing is read or
// written past part_ml.
#include "common.cuh"

#define DECODE_WARPS 4
#define DECODE_THREADS (DECODE_WARPS * 32)

// Tokens per partition and the partition count of a sequence of `len` tokens (see above).
struct DecodeSplit {
    int part, n;
    __device__ __forceinline__ DecodeSplit(int len, int target_splits, int min_partition, int granule,
                                           int num_splits) {
        int p = len / target_splits + (len % target_splits != 0);
        p = (p + granule - 1) / granule * granule;
        part = p > min_partition ? p : min_partition;
        n = len / part + (len % part != 0);
        n = n < num_splits ? n : num_splits;
        n = n > 1 ? n : 1;  // len 0: one (empty) partition that writes zeros
    }
};

template <typename T, int HEAD_DIM, int G, int BLOCK_SIZE>
__global__ void __launch_bounds__(DECODE_THREADS) paged_decode_kernel(
    const typename T::raw* __restrict__ q,        // [num_seqs, num_heads, HEAD_DIM]
    const typename T::raw* __restrict__ k_cache,  // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    const typename T::raw* __restrict__ v_cache,  // same as k_cache
    const int* __restrict__ block_tables,         // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,             // [num_seqs]
    typename T::raw* __restrict__ out,            // [num_seqs, num_heads, HEAD_DIM]
    float* __restrict__ part_acc,                 // [num_seqs, num_heads, num_splits, HEAD_DIM]
    float* __restrict__ part_ml,                  // [num_seqs, num_heads, num_splits, 2]
    int num_heads, int num_kv_heads, int max_blocks_per_seq, int num_splits, int target_splits,
    int min_partition, int granule, float scale_log2) {
    constexpr int VEC = T::kVec;
    static_assert(HEAD_DIM % VEC == 0, "head_dim must be a whole number of 16-byte vectors");
    constexpr int VECS_PER_ROW = HEAD_DIM / VEC;
    static_assert((VECS_PER_ROW & (VECS_PER_ROW - 1)) == 0,
                  "head_dim / vector width must be a power of two (lanes per token divide the warp)");
    static_assert(VECS_PER_ROW <= 32 || VECS_PER_ROW % 32 == 0, "rows longer than a warp: whole warps");
    static_assert(HEAD_DIM >= 32 && HEAD_DIM <= 256, "head_dim in [32, 256]");
    static_assert(G >= 1 && G <= 8, "heads per block in [1, 8]");
    static_assert(BLOCK_SIZE >= 1 && (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0, "block_size a power of two");
    // Vectors per lane per row: as many as keep q and acc (G x ELEMS floats each) near 32
    // registers. More elements per lane means fewer lanes per token, hence fewer shuffle
    // rounds per score and the per-token softmax work shared by more bytes.
    constexpr int NV_RAW = (32 / G) / VEC > 1 ? (32 / G) / VEC : 1;
    constexpr int NV_WANT = NV_RAW < 4 ? NV_RAW : 4;  // K/V buffers stay <= 64 registers
    constexpr int NV_MIN = VECS_PER_ROW > 32 ? VECS_PER_ROW / 32 : 1;
    constexpr int NV_FIT = NV_WANT < VECS_PER_ROW ? NV_WANT : VECS_PER_ROW;
    constexpr int NV = NV_FIT > NV_MIN ? NV_FIT : NV_MIN;
    constexpr int LANES_PER_TOKEN = VECS_PER_ROW / NV;
    constexpr int ELEMS = NV * VEC;                     // head_dim elements one lane owns
    constexpr int SLOTS_PER_WARP = 32 / LANES_PER_TOKEN;
    // Tokens per slot per tile: two register buffers of UNROLL x NV vectors each for K and V;
    // fewer when q and acc already take many registers (G * ELEMS floats each).
    constexpr int UNROLL_WANTED = (G * ELEMS >= 64) ? 2 : 4;
    constexpr int UNROLL = UNROLL_WANTED / NV > 0 ? UNROLL_WANTED / NV : 1;
    constexpr int TILE = SLOTS_PER_WARP * UNROLL;
    constexpr int LOG2_BS = Log2<BLOCK_SIZE>::value;
    typedef typename T::raw raw;

    const int seq = blockIdx.x;
    const int heads_per_kv = num_heads / num_kv_heads;
    const int tiles_per_kv = heads_per_kv / G;
    const int kv_head = blockIdx.y / tiles_per_kv;
    const int head0 = kv_head * heads_per_kv + (blockIdx.y % tiles_per_kv) * G;
    const int split = blockIdx.z;

    const int seq_len = seq_lens[seq];
    const DecodeSplit ds(seq_len, target_splits, min_partition, granule, num_splits);
    if (split >= ds.n) return;  // this sequence needs fewer partitions than the grid has
    const int start = split * ds.part;
    const int end = split == ds.n - 1 ? seq_len : min(start + ds.part, seq_len);

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int slot_in_warp = lane / LANES_PER_TOKEN;
    const int sub = lane % LANES_PER_TOKEN;
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    // Elements between consecutive tokens of a block, and this lane's offset within a row.
    const int row_stride = num_kv_heads * HEAD_DIM;
    const int lane_off = kv_head * HEAD_DIM + sub * VEC;

    // This lane's slice of each query head, pre-scaled so scores come out in log2 units.
    float qr[G][ELEMS];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const long long qrow = ((long long)seq * num_heads + head0 + g) * HEAD_DIM;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            float f[VEC];
            T::unpack(*reinterpret_cast<const uint4*>(q + qrow + (j * LANES_PER_TOKEN + sub) * VEC), f);
#pragma unroll
            for (int e = 0; e < VEC; ++e) qr[g][j * VEC + e] = f[e] * scale_log2;
        }
    }

    float m[G], l[G], acc[G][ELEMS];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = SERVESIM_NO_SCORE;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) acc[g][e] = 0.f;
    }

    // Issues the loads of tile `tile` (tokens tile * TILE ...) into kv; tokens outside
    // [start, end) get zeros (they are masked, and 0 * stale data must not become NaN).
    auto load_tile = [&](int tile, uint4 (&kb)[UNROLL][NV], uint4 (&vb)[UNROLL][NV]) {
        const int first = tile * TILE;
        long long block_base = 0;
        if (TILE <= BLOCK_SIZE)  // the whole tile lies in one KV block: one lookup
            block_base = (long long)table[first >> LOG2_BS] << LOG2_BS;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int pos = first + u * SLOTS_PER_WARP + slot_in_warp;
            if (pos >= start && pos < end) {
                const long long base =
                    TILE <= BLOCK_SIZE ? block_base : (long long)table[pos >> LOG2_BS] << LOG2_BS;
                const long long off = (base + (pos & (BLOCK_SIZE - 1))) * row_stride + lane_off;
                const uint4* kp = reinterpret_cast<const uint4*>(k_cache + off);
                const uint4* vp = reinterpret_cast<const uint4*>(v_cache + off);
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    kb[u][j] = kp[j * LANES_PER_TOKEN];
                    vb[u][j] = vp[j * LANES_PER_TOKEN];
                }
            } else {
#pragma unroll
                for (int j = 0; j < NV; ++j) kb[u][j] = vb[u][j] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };

    // Folds a loaded tile into (m, l, acc). Every lane of the warp calls it (the shuffles).
    auto compute_tile = [&](int tile, const uint4 (&kb)[UNROLL][NV], const uint4 (&vb)[UNROLL][NV]) {
        const int first = tile * TILE;
        float s[UNROLL][G];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float kf[ELEMS];
#pragma unroll
            for (int j = 0; j < NV; ++j) T::unpack(kb[u][j], kf + j * VEC);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int e = 0; e < ELEMS; ++e) dot = fmaf(qr[g][e], kf[e], dot);
                s[u][g] = dot;
            }
        }
#pragma unroll
        for (int off = LANES_PER_TOKEN / 2; off > 0; off >>= 1)
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int g = 0; g < G; ++g) s[u][g] += __shfl_xor_sync(SERVESIM_FULL_MASK, s[u][g], off);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int pos = first + u * SLOTS_PER_WARP + slot_in_warp;
            if (pos < start || pos >= end)
#pragma unroll
                for (int g = 0; g < G; ++g) s[u][g] = neg_inf();
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float m_new = m[g];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) m_new = fmaxf(m_new, s[u][g]);
            const float corr = fast_exp2(m[g] - m_new);
            m[g] = m_new;
            float p_sum = 0.f;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                s[u][g] = fast_exp2(s[u][g] - m_new);  // now p; 0 for masked tokens
                p_sum += s[u][g];
            }
            l[g] = fmaf(l[g], corr, p_sum);
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) acc[g][e] *= corr;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float vf[ELEMS];
#pragma unroll
            for (int j = 0; j < NV; ++j) T::unpack(vb[u][j], vf + j * VEC);
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int e = 0; e < ELEMS; ++e) acc[g][e] = fmaf(s[u][g], vf[e], acc[g][e]);
        }
    };

    // Tiles [first_tile, last_tile] cover [start, end); warp w takes first_tile + w, + 4, ...
    // Two buffers used alternately: the next tile's loads go out before this tile's math.
    const int first_tile = start / TILE;
    const int last_tile = end > start ? (end - 1) / TILE : first_tile - 1;
    uint4 ka[UNROLL][NV], va[UNROLL][NV], kb[UNROLL][NV], vb[UNROLL][NV];
    int tile = first_tile + warp;
    if (tile <= last_tile) load_tile(tile, ka, va);
    for (; tile <= last_tile; tile += 2 * DECODE_WARPS) {
        const int t1 = tile + DECODE_WARPS;
        if (t1 <= last_tile) load_tile(t1, kb, vb);
        compute_tile(tile, ka, va);
        if (t1 > last_tile) break;
        if (t1 + DECODE_WARPS <= last_tile) load_tile(t1 + DECODE_WARPS, ka, va);
        compute_tile(t1, kb, vb);
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
        if (ds.n == 1) {
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

// Merges the split-K partitions of paged_decode_kernel for sequences that have more than one
// (the others were written by paged_decode_kernel itself). Same split rule and arguments.
// Grid (num_seqs, num_heads), any thread count (threads stride over head_dim).
template <typename T>
__global__ void paged_decode_reduce_kernel(const float* __restrict__ part_acc,
                                           const float* __restrict__ part_ml,
                                           const int* __restrict__ seq_lens,
                                           typename T::raw* __restrict__ out, int num_heads,
                                           int head_dim, int num_splits, int target_splits,
                                           int min_partition, int granule) {
    const int seq = blockIdx.x;
    const int head = blockIdx.y;
    // At most num_splits partitions exist (DecodeSplit clamps): never read past part_ml.
    const int n = DecodeSplit(seq_lens[seq], target_splits, min_partition, granule, num_splits).n;
    if (n == 1) return;
    const long long first = ((long long)seq * num_heads + head) * num_splits;
    float m_all = part_ml[2 * first];
    for (int i = 1; i < n; ++i) m_all = fmaxf(m_all, part_ml[2 * (first + i)]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float l_all = 0.f, a_all = 0.f;
        for (int i = 0; i < n; ++i) {
            const float c = exp2f(part_ml[2 * (first + i)] - m_all);
            l_all += part_ml[2 * (first + i) + 1] * c;
            a_all += part_acc[(first + i) * head_dim + d] * c;
        }
        out[((long long)seq * num_heads + head) * head_dim + d] = T::from_float(l_all > 0.f ? a_all / l_all : 0.f);
    }
}
