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

// The work of one decode block, from its place in the grid (sequence x tile of G query heads
// x split-K partition): its sequence, KV head, first query head, and the tokens [start, end)
// of its partition. `active` is false for a partition past those the sequence's own length
// needs (num_parts of them).
template <int G>
struct DecodeWork {
    int seq, kv_head, head0, split, start, end, num_parts;
    bool active;
    __device__ __forceinline__ DecodeWork(const int* __restrict__ seq_lens, int num_heads, int num_kv_heads,
                                          int target_splits, int min_partition, int granule, int num_splits) {
        seq = blockIdx.x;
        const int heads_per_kv = num_heads / num_kv_heads;
        const int tiles_per_kv = heads_per_kv / G;
        kv_head = blockIdx.y / tiles_per_kv;
        head0 = kv_head * heads_per_kv + (blockIdx.y % tiles_per_kv) * G;
        split = blockIdx.z;
        const int seq_len = seq_lens[seq];
        const DecodeSplit ds(seq_len, target_splits, min_partition, granule, num_splits);
        num_parts = ds.n;
        active = split < ds.n;
        start = split * ds.part;
        end = split == ds.n - 1 ? seq_len : min(start + ds.part, seq_len);
    }
};

// The end of a decode block: merges the warps' (acc, m, l) left in shared memory (after a
// __syncthreads) and writes the normalised output (one partition) or this partition's
// (acc, m, l) for paged_decode_reduce_kernel.
template <typename T, int HEAD_DIM, int G>
__device__ __forceinline__ void decode_epilogue(const float (&sm_acc)[DECODE_WARPS][G][HEAD_DIM],
                                                const float (&sm_m)[DECODE_WARPS][G], const float (&sm_l)[DECODE_WARPS][G],
                                                typename T::raw* __restrict__ out, float* __restrict__ part_acc,
                                                float* __restrict__ part_ml, int seq, int num_heads, int head0,
                                                int split, int num_splits, int num_parts) {
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
        if (num_parts == 1) {
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
    // fewer when q and acc already take many registers (G * ELEMS floats each), more at
    // head_dim 256 with few heads (a token's shuffles and softmax then serve twice the bytes).
    constexpr int UNROLL_WANTED = (G * ELEMS >= 64) ? 2 : HEAD_DIM == 256 ? 8 : 4;
    constexpr int UNROLL = UNROLL_WANTED / NV > 0 ? UNROLL_WANTED / NV : 1;
    constexpr int TILE = SLOTS_PER_WARP * UNROLL;
    constexpr int LOG2_BS = Log2<BLOCK_SIZE>::value;
    typedef typename T::raw raw;

    const DecodeWork<G> w(seq_lens, num_heads, num_kv_heads, target_splits, min_partition, granule, num_splits);
    if (!w.active) return;
    const int seq = w.seq, kv_head = w.kv_head, head0 = w.head0, split = w.split;
    const int start = w.start, end = w.end;

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

    // Issues the loads of tile `tile` (tokens tile * TILE ...) into kv. A slot whose token lies
    // outside [start, end) loads the partition's nearest token instead, which lies in the same
    // tile (the tile overlaps the partition) and so in the same KV block: it is masked, and
    // its finite values times p = 0 add nothing where stale memory could be NaN. No branch and
    // no zero fill in the loop: two integer min/max a token.
    auto load_tile = [&](int tile, uint4 (&kb)[UNROLL][NV], uint4 (&vb)[UNROLL][NV]) {
        const int first = tile * TILE;
        long long block_base = 0;
        if (TILE <= BLOCK_SIZE)  // the whole tile lies in one KV block: one lookup
            block_base = (long long)table[first >> LOG2_BS] << LOG2_BS;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int pos = min(max(first + u * SLOTS_PER_WARP + slot_in_warp, start), end - 1);
            const long long base = TILE <= BLOCK_SIZE ? block_base : (long long)table[pos >> LOG2_BS] << LOG2_BS;
            const long long off = (base + (pos & (BLOCK_SIZE - 1))) * row_stride + lane_off;
            const uint4* kp = reinterpret_cast<const uint4*>(k_cache + off);
            const uint4* vp = reinterpret_cast<const uint4*>(v_cache + off);
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                kb[u][j] = kp[j * LANES_PER_TOKEN];
                vb[u][j] = vp[j * LANES_PER_TOKEN];
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
    decode_epilogue<T, HEAD_DIM, G>(sm_acc, sm_m, sm_l, out, part_acc, part_ml, seq, num_heads, head0, split,
                                    num_splits, w.num_parts);
}

// Shared by the tensor-core kernels (paged_decode_mma_kernel, paged_decode_tf32x3_kernel).
// Both compute S = Q K^T with Q as the A operand (rows: the block's heads, padded to 16) and
// O^T += V^T P^T, so in lane (g, t) = (lane / 4, lane % 4): s[nt][0], s[nt][1] are head g's
// scores of tokens 8 nt + 2t and + 1 of the tile (s[nt][2..3]: padding rows), and O^T m-tile j
// holds dims (rows g, g + 8) x heads (columns 2t, 2t + 1) in acc[j][0..3].

// Online softmax on S's fragments: replaces s[nt][0..1] by p = 2^(s * scale_log2 - m) (0 for
// tokens outside [start, end) when `masked`; `first` is the tile's first position), updates head
// g's running max m_run (raw score units) and this lane's running sum l_run, and rescales the
// O^T columns by their heads' corrections. A head's maximum is two shuffles (its four lanes),
// the corrections of the two heads whose columns a lane holds two more: lanes 8t', 8t' + 4 with
// t' = t & COL_T_MASK (3; 1 when columns 4..7 repeat heads 0..3, see MmaSteps<F32, G>).
// Scores are scaled inside the exp2 (fma(s, scale, -m * scale)): Q stays unrounded.
template <int NT_S, int NT_O, int COL_T_MASK>
__device__ __forceinline__ void fragment_softmax(float (&s)[NT_S][4], float (&acc)[NT_O][4], float& m_run,
                                                 float& l_run, float scale_log2, int first, int start, int end,
                                                 bool masked, int t) {
    if (masked) {
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int pos = first + 8 * nt + 2 * t + e;
                if (pos < start || pos >= end) s[nt][e] = neg_inf();
            }
    }
    float mx = s[0][0];
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) mx = fmaxf(mx, fmaxf(s[nt][0], s[nt][1]));
    mx = fmaxf(mx, __shfl_xor_sync(SERVESIM_FULL_MASK, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(SERVESIM_FULL_MASK, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    const float corr = fast_exp2((m_run - m_new) * scale_log2);
    const float shift = m_new * scale_log2;
    m_run = m_new;
    float p_sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) {
        const float p0 = fast_exp2(fmaf(s[nt][0], scale_log2, -shift));
        const float p1 = fast_exp2(fmaf(s[nt][1], scale_log2, -shift));
        p_sum += p0 + p1;
        s[nt][0] = p0;
        s[nt][1] = p1;
    }
    l_run = fmaf(l_run, corr, p_sum);
    // This lane's O^T columns are heads 2t' and 2t' + 1, whose corrections lanes 8t', 8t' + 4 hold.
    const float corr_lo = __shfl_sync(SERVESIM_FULL_MASK, corr, 8 * (t & COL_T_MASK));
    const float corr_hi = __shfl_sync(SERVESIM_FULL_MASK, corr, 8 * (t & COL_T_MASK) + 4);
#pragma unroll
    for (int j = 0; j < NT_O; ++j) acc[j][0] *= corr_lo, acc[j][2] *= corr_lo, acc[j][1] *= corr_hi, acc[j][3] *= corr_hi;
}

// The tile schedule of the tensor-core kernels over a partition [start, end), TOK tokens a
// tile, tiles aligned to TOK. Full tiles [full_lo, full_hi) run without masks: warp w takes
// full_lo + w, + DECODE_WARPS, ...; the at most two partial tiles at the edges (one when start
// and end share a tile) run afterwards in warp 0, masked. load_k / load_v(tile, masked) issue
// a tile's loads (zeros for masked tokens), scores(s) computes S from the loaded K, and
// finish(s, tile, masked) runs the softmax and the O update from the loaded V. The next tile's
// K goes out once S has consumed this one's, its V once O has, so every lane keeps one tile's
// loads in flight; they are issued unconditionally (the last iteration reloads its own tile)
// so that the loop body has no branch around them.
template <int TOK, int NT_S, class LoadK, class LoadV, class Scores, class Finish>
__device__ __forceinline__ void run_decode_tiles(int start, int end, int warp, const LoadK& load_k,
                                                 const LoadV& load_v, const Scores& scores, const Finish& finish) {
    const int full_lo = (start + TOK - 1) / TOK;
    const int full_hi = end / TOK;
    int tile = full_lo + warp;
    if (tile < full_hi) {
        load_k(tile, false);
        load_v(tile, false);
    }
    for (; tile < full_hi; tile += DECODE_WARPS) {
        const int next = min(tile + DECODE_WARPS, full_hi - 1);
        float s[NT_S][4];
        scores(s);
        load_k(next, false);
        finish(s, tile, false);
        load_v(next, false);
    }
    if (warp == 0 && start < end) {
        const int head = start / TOK, tail = (end - 1) / TOK;
        if (start % TOK != 0 || (head == tail && end % TOK != 0)) {
            float s[NT_S][4];
            load_k(head, true);
            load_v(head, true);
            scores(s);
            finish(s, head, true);
        }
        if (tail != head && end % TOK != 0) {
            float s[NT_S][4];
            load_k(tail, true);
            load_v(tail, true);
            scores(s);
            finish(s, tail, true);
        }
    }
}

// The end of a tensor-core decode block: sums l over a head's four lanes, waits for every warp
// (sm_acc may alias what the tiles read), writes the warp's O^T (row g (+ 8) of m-tile j is dim CE (g + 8 (j / (CE / 2))) + 2 (j % (CE / 2)) (+ 1),
// columns heads 2t, 2t + 1), m (in log2 units, as paged_decode_kernel's) and l to shared
// memory, and runs decode_epilogue. Every thread of the block calls it.
template <typename T, int HEAD_DIM, int G, int NT_O, int CE>
__device__ __forceinline__ void mma_decode_end(float (&sm_acc)[DECODE_WARPS][G][HEAD_DIM], float (&sm_m)[DECODE_WARPS][G],
                                               float (&sm_l)[DECODE_WARPS][G], const float (&acc)[NT_O][4], float m_run,
                                               float l_run, float scale_log2, int warp, int g, int t,
                                               typename T::raw* __restrict__ out, float* __restrict__ part_acc,
                                               float* __restrict__ part_ml, int seq, int num_heads, int head0,
                                               int split, int num_splits, int num_parts) {
    l_run += __shfl_xor_sync(SERVESIM_FULL_MASK, l_run, 1);
    l_run += __shfl_xor_sync(SERVESIM_FULL_MASK, l_run, 2);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < NT_O; ++j) {
        const int dim = CE * (g + 8 * (j / (CE / 2))) + 2 * (j % (CE / 2));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (2 * t + h < G) {
                sm_acc[warp][2 * t + h][dim] = acc[j][h];
                sm_acc[warp][2 * t + h][dim + 1] = acc[j][2 + h];
            }
        }
    }
    if (g < G && t == 0) {
        sm_m[warp][g] = m_run * scale_log2;
        sm_l[warp][g] = l_run;
    }
    __syncthreads();
    decode_epilogue<T, HEAD_DIM, G>(sm_acc, sm_m, sm_l, out, part_acc, part_ml, seq, num_heads, head0, split,
                                    num_splits, num_parts);
}

// The storage-specific steps of paged_decode_mma_kernel. 16-bit storage: the products in the
// storage format, m16n8k16 (S; O over 16 tokens) and m16n8k8 (O over 8 tokens). G: heads per
// block.
template <typename T, int G>
struct MmaSteps {
    static const int kColTMask = 3;  // O^T column 2t (+ 1) is head 2t (+ 1)
    // Q's A fragment of one k-step (a quad in shared memory) from its two words of Q: row g
    // holds them, rows g + 8 (padding) are zero.
    static __device__ __forceinline__ uint4 q_quad(unsigned x, unsigned y) { return make_uint4(x, 0u, y, 0u); }
    // Q K^T over one k-step into the accumulators acc (two, zeroed before the first k-step);
    // b0, b1: the K words of the dims q_quad's x, y hold. 16-bit storage uses acc[0] only.
    static __device__ __forceinline__ void s_step(float (&acc)[2][4], const uint4& qv, unsigned b0, unsigned b1) {
        const unsigned a[4] = {qv.x, qv.y, qv.z, qv.w};
        const unsigned b[2] = {b0, b1};
        T::mma16816(acc[0], a, b, acc[0]);
    }
    // S's scores (s[0], s[1]; s[2], s[3] padding) once every k-step is in.
    static __device__ __forceinline__ void s_done(const float (&acc)[2][4], float (&s)[4]) {
        s[0] = acc[0][0], s[1] = acc[0][1], s[2] = acc[0][2], s[3] = acc[0][3];
    }
    // P^T's B fragments, from the probabilities in S's fragments.
    template <int NT_S>
    struct P {
        unsigned b[NT_S];
    };
    template <int NT_S>
    static __device__ __forceinline__ P<NT_S> make_p(const float (&s)[NT_S][4], int lane) {
        P<NT_S> p;
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) p.b[nt] = T::pack2(s[nt][0], s[nt][1]);
        return p;
    }
    // O^T's columns as heads (2t, 2t + 1) once every tile is in.
    template <int NT_O>
    static __device__ __forceinline__ void o_done(float (&acc)[NT_O][4]) {}
    // O^T m-tile (c, w) += V^T P^T over the tile. V^T's A fragment pairs, per register, one dim
    // of two tokens: dims CE (g + 8c) + 2w (row g) and + 1 (row g + 8) of chunk c.
    template <int NT_S, int VTOK, int VCH, int CW>
    static __device__ __forceinline__ void o_step(float (&acc)[4], const unsigned (&vw)[VTOK][VCH][CW], int c, int w,
                                                  const P<NT_S>& p) {
        if (NT_S == 1) {
            const unsigned a[2] = {__byte_perm(vw[0][c][w], vw[1][c][w], 0x5410u),
                                   __byte_perm(vw[0][c][w], vw[1][c][w], 0x7632u)};
            const unsigned b[1] = {p.b[0]};
            T::mma1688(acc, a, b, acc);
        } else {
            const unsigned a[4] = {__byte_perm(vw[0][c][w], vw[1][c][w], 0x5410u),
                                   __byte_perm(vw[0][c][w], vw[1][c][w], 0x7632u),
                                   __byte_perm(vw[VTOK - 2][c][w], vw[VTOK - 1][c][w], 0x5410u),
                                   __byte_perm(vw[VTOK - 2][c][w], vw[VTOK - 1][c][w], 0x7632u)};
            const unsigned b[2] = {p.b[0], p.b[NT_S - 1]};
            T::mma16816(acc, a, b, acc);
        }
    }
};

// fp32 storage: 3xTF32 (F32::split_tf32), m16n8k8 only. A k-step of S covers 8 dims (a K word
// per B register); O goes 8 tokens a step.
//
// S needs two mma a k-step, not three: the A rows that pad the heads to 16 carry Q's lo, so
// A = [Q hi; Q lo] times K lo and times K hi (two accumulators: two independent chains of
// mma) hold Q hi K in rows g and Q lo K in rows g + 8 of the same lane, which s_done adds
// (Q lo K lo, a fourth term 3xTF32 drops, comes free). O^T = V^T P^T has no padding rows:
// three mma, small terms first; but with at most 4 heads its B = P^T has 4 padding columns,
// which then carry P's lo ("folded": columns 0..3 P hi, 4..7 P lo of heads 0..3), so V lo and
// V hi times it are two mma, and o_done adds columns 4..7 into 0..3 (V lo P lo, again free).
template <int G>
struct MmaSteps<F32, G> {
    static const bool kFold = G <= 4;
    static const int kColTMask = kFold ? 1 : 3;
    // Q's A fragment: {hi x, lo x, hi y, lo y} (a0, a2: row g; a1, a3: row g + 8).
    static __device__ __forceinline__ uint4 q_quad(unsigned x, unsigned y) {
        uint4 r;
        F32::split_tf32(__uint_as_float(x), r.x, r.y);
        F32::split_tf32(__uint_as_float(y), r.z, r.w);
        return r;
    }
    static __device__ __forceinline__ void s_step(float (&acc)[2][4], const uint4& qv, unsigned b0, unsigned b1) {
        const unsigned a[4] = {qv.x, qv.y, qv.z, qv.w};
        unsigned b_hi[2], b_lo[2];
        F32::split_tf32(__uint_as_float(b0), b_hi[0], b_lo[0]);
        F32::split_tf32(__uint_as_float(b1), b_hi[1], b_lo[1]);
        F32::mma1688(acc[0], a, b_lo, acc[0]);
        F32::mma1688(acc[1], a, b_hi, acc[1]);
    }
    // Small terms first: Q lo K lo + Q lo K hi + Q hi K lo + Q hi K hi.
    static __device__ __forceinline__ void s_done(const float (&acc)[2][4], float (&s)[4]) {
#pragma unroll
        for (int e = 0; e < 2; ++e) s[e] = acc[1][e] + (acc[0][e] + (acc[1][2 + e] + acc[0][2 + e]));
    }
    // Folded, hi is the whole B: lane (g, t) of column g >= 4 takes head g - 4's lo from lane
    // 16 below it.
    template <int NT_S>
    struct P {
        unsigned hi[NT_S][2], lo[NT_S][2];
    };
    template <int NT_S>
    static __device__ __forceinline__ P<NT_S> make_p(const float (&s)[NT_S][4], int lane) {
        P<NT_S> p;
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                F32::split_tf32(s[nt][e], p.hi[nt][e], p.lo[nt][e]);
                if (kFold) {
                    const unsigned lo_of_head_below = __shfl_xor_sync(SERVESIM_FULL_MASK, p.lo[nt][e], 16);
                    if (lane >= 16) p.hi[nt][e] = lo_of_head_below;
                }
            }
        return p;
    }
    // Folded: lane (g, t) with t < 2 adds columns 2t + 4, 2t + 5 (lane + 2) to its heads 2t, 2t + 1.
    template <int NT_O>
    static __device__ __forceinline__ void o_done(float (&acc)[NT_O][4]) {
        if (!kFold) return;
#pragma unroll
        for (int j = 0; j < NT_O; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] += __shfl_xor_sync(SERVESIM_FULL_MASK, acc[j][e], 2);
    }
    // V^T's A fragment of m-tile c and n-tile nt (CE = 2: one V load is one word pair, w = 0):
    // a0, a1 = dims 2 (g + 8c), + 1 of token 8 nt + 2t (column t), a2, a3 = the same dims of
    // token 8 nt + 2t + 1 (column t + 4).
    template <int NT_S, int VTOK, int VCH, int CW>
    static __device__ __forceinline__ void o_step(float (&acc)[4], const unsigned (&vw)[VTOK][VCH][CW], int c, int w,
                                                  const P<NT_S>& p) {
        static_assert(CW == 2, "fp32: V loads of two words");
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) {
            const unsigned v[4] = {vw[2 * nt][c][0], vw[2 * nt][c][1], vw[2 * nt + 1][c][0], vw[2 * nt + 1][c][1]};
            unsigned a_hi[4], a_lo[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) F32::split_tf32(__uint_as_float(v[i]), a_hi[i], a_lo[i]);
            const unsigned b_hi[2] = {p.hi[nt][0], p.hi[nt][1]}, b_lo[2] = {p.lo[nt][0], p.lo[nt][1]};
            F32::mma1688(acc, a_lo, b_hi, acc);
            if (!kFold) F32::mma1688(acc, a_hi, b_lo, acc);
            F32::mma1688(acc, a_hi, b_hi, acc);
        }
    }
};

// Tensor-core decode (same grid, arguments, split rule and outputs as paged_decode_kernel; the
// host picks it for every storage). fp16 / bf16 multiply in their own format; fp32 in 3xTF32
// (F32::split_tf32), whose products keep fp32's accuracy where plain tf32 would round K, V, Q
// and P to 11 significant bits.
//
// Per warp, a tile is TOK consecutive tokens (8, or 16 for head_dim <= 64), and the math is two
// mma.sync products with fp32 accumulation, lane (g, t) = (lane / 4, lane % 4) in the PTX
// fragment layouts:
//   - S = Q K^T (M = the block's G heads, padded to 16 rows with zeros; N = 8 tokens; K = 16
//     dims per step (m16n8k16) at 16-bit storage, 8 (m16n8k8) at fp32). Lane (g, t) loads
//     token g of each n-tile, 16-byte vectors t, t + 4, ... of its row, straight into B
//     registers: a k-step's dims may be any as long as Q uses the same, so a vector's four
//     words serve two k-steps as they are. Q's A fragments (built the same way) sit in shared
//     memory, one 16-byte quad per lane and k-step (fp32: the hi and lo halves of two words).
//   - O^T += V^T P^T (M = 16 dims, N = 8 heads; K = 8 tokens a step, or 16 at 16-bit storage
//     and head_dim <= 64): P^T's B fragment (tokens 2t, 2t + 1 of head g) is S's accumulator
//     fragment as it is, no shuffle; lane (g, t) loads tokens 2t, 2t + 1 (+ 8, + 9), chunk g
//     (+ 8, ...) of their rows, whose words V^T's A fragment takes as they are (fp32: 8-byte
//     chunks) or paired with byte permutes (16-bit). The accumulators' 16 rows are dims, their
//     8 columns heads (fp32 with at most 4 heads: columns 4..7 the lo parts, see MmaSteps).
// The online softmax (fragment_softmax) and the tile schedule (run_decode_tiles) are above.
template <typename T, int HEAD_DIM, int G, int BLOCK_SIZE>
__global__ void __launch_bounds__(DECODE_THREADS) paged_decode_mma_kernel(
    const typename T::raw* __restrict__ q, const typename T::raw* __restrict__ k_cache,
    const typename T::raw* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, typename T::raw* __restrict__ out, float* __restrict__ part_acc,
    float* __restrict__ part_ml, int num_heads, int num_kv_heads, int max_blocks_per_seq, int num_splits,
    int target_splits, int min_partition, int granule, float scale_log2) {
    static_assert(HEAD_DIM == 32 || HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256,
                  "head_dim in [32, 256]");
    static_assert(G >= 1 && G <= 8, "heads per block in [1, 8]");
    static_assert(BLOCK_SIZE >= 1 && (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0, "block_size a power of two");
    typedef MmaSteps<T, G> Steps;
    constexpr int VEC = T::kVec;                  // elements per 16-byte vector
    constexpr int TOK = HEAD_DIM <= 64 ? 16 : 8;  // tokens per warp tile (the O product's k)
    constexpr int NT_S = TOK / 8;                 // n-tiles of S
    constexpr int KVEC = HEAD_DIM / (4 * VEC);    // 16-byte K vectors per lane per token
    constexpr int KSTEPS = 2 * KVEC;              // k-steps of S (half a vector each)
    constexpr int NT_O = HEAD_DIM / 16;           // m-tiles of O^T
    // Dims per V load: 16 bytes at 16-bit storage (8 at head_dim 32); 8 bytes at fp32, two
    // tokens' pairs of which make V^T's A fragment in place (a 16-byte vector would have to be
    // regrouped with four register moves an m-tile).
    constexpr int CE = VEC == 4 ? 2 : HEAD_DIM < 64 ? 4 : 8;
    constexpr int CW = CE * (int)sizeof(typename T::raw) / 4;  // words per V load
    constexpr int VCH = HEAD_DIM / (8 * CE);      // V chunks per lane per token
    constexpr int VTOK = TOK / 4;                 // V tokens per lane
    constexpr int LOG2_BS = Log2<BLOCK_SIZE>::value;
    typedef typename T::raw raw;

    const DecodeWork<G> w(seq_lens, num_heads, num_kv_heads, target_splits, min_partition, granule, num_splits);
    if (!w.active) return;
    const int seq = w.seq, kv_head = w.kv_head, head0 = w.head0, split = w.split;
    const int start = w.start, end = w.end;

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane >> 2;  // groupID: a head (A rows, C rows), a token (S n), a V column
    const int t = lane & 3;   // threadID_in_group
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const int row_stride = num_kv_heads * HEAD_DIM;

    // Q as A fragments, one 16-byte quad per lane and k-step, in shared memory (re-read each
    // tile rather than held in 4 * KSTEPS registers): row g = head head0 + g (zero past G),
    // k-step 2m + h takes words 2h, 2h + 1 of its vector t + 4m (the K vectors' dims); rows
    // 8..15 are zero (fp32: Q's lo, see MmaSteps<F32, G>). The warps' O^T for the epilogue
    // reuse the buffer once the tiles are done (both at once would pass 48 KiB at fp32 and
    // head_dim 256).
    __shared__ union {
        uint4 q[KSTEPS][32];
        float acc[DECODE_WARPS][G][HEAD_DIM];
    } sm;
    uint4 (&sm_q)[KSTEPS][32] = sm.q;
    if (warp == 0) {
#pragma unroll
        for (int m = 0; m < KVEC; ++m) {
            uint4 w = make_uint4(0u, 0u, 0u, 0u);
            if (g < G)
                w = *reinterpret_cast<const uint4*>(q + ((long long)seq * num_heads + head0 + g) * HEAD_DIM +
                                                    VEC * (t + 4 * m));
            sm_q[2 * m][lane] = Steps::q_quad(w.x, w.y);
            sm_q[2 * m + 1][lane] = Steps::q_quad(w.z, w.w);
        }
    }
    __syncthreads();

    float m_run = SERVESIM_NO_SCORE, l_run = 0.f;  // head g's running max (raw units) and this lane's sum
    // O^T accumulators, one C fragment per m-tile of 16 dims: [0], [1] = dim row g, heads 2t,
    // 2t + 1; [2], [3] = dim row g + 8, the same heads (dims: see mma_decode_end).
    float acc[NT_O][4];
#pragma unroll
    for (int j = 0; j < NT_O; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    unsigned kw[NT_S][KVEC][4];           // K words: token 8 nt + g, vector t + 4 m
    unsigned vw[VTOK][VCH][CW];           // V words: token 2t + e + 8 p (index 2p + e), chunk g + 8 i

    // How a tile's rows find their KV block. TOK <= BLOCK_SIZE: the tile lies in one block, one
    // lookup a tile. GROUPS (8 <= BLOCK_SIZE < TOK): each group of 8 rows (K's n-tile nt, V's
    // tokens 8 p + 2t (+ 1)) lies in one block, one lookup a group, made by load_k and kept in
    // grp_blk for load_v of the same tile (which always follows it, run_decode_tiles). Else
    // (blocks of 1-4 tokens) a lookup per row.
    constexpr bool GROUPS = TOK > BLOCK_SIZE && BLOCK_SIZE >= 8;
    constexpr int NGRP = TOK / 8;
    // Element offsets of this lane's rows within a tile, or within their group's block (the
    // token part: none when each row is looked up).
    int k_off[NT_S], v_off[VTOK];
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt)
        k_off[nt] = (TOK <= BLOCK_SIZE ? (8 * nt + g) * row_stride
                     : GROUPS        ? (((8 * nt) & (BLOCK_SIZE - 1)) + g) * row_stride
                                     : 0) +
                    kv_head * HEAD_DIM + VEC * t;
#pragma unroll
    for (int x = 0; x < VTOK; ++x)
        v_off[x] = (TOK <= BLOCK_SIZE ? (2 * t + (x & 1) + 8 * (x >> 1)) * row_stride
                    : GROUPS        ? (((8 * (x >> 1)) & (BLOCK_SIZE - 1)) + 2 * t + (x & 1)) * row_stride
                                    : 0) +
                   kv_head * HEAD_DIM + CE * g;
    int grp_blk[NGRP];  // GROUPS: each group's block (of the tile load_k took last), 0 if not read
#pragma unroll
    for (int j = 0; j < NGRP; ++j) grp_blk[j] = 0;
    // GROUPS and a lookup per row: a row's address is its lane's base (head and vector, and
    // with GROUPS its in-block row) plus its block times the block's bytes: one 32x32 -> 64-bit
    // multiply-add per load (IMAD.WIDE.U32) rather than 64-bit element arithmetic.
    const unsigned blk_bytes = (unsigned)(BLOCK_SIZE * row_stride * (int)sizeof(raw));
    const char* const k_lane = reinterpret_cast<const char*>(k_cache + k_off[0]);
    const char* const v_lane[2] = {reinterpret_cast<const char*>(v_cache + v_off[0]),
                                   reinterpret_cast<const char*>(v_cache + v_off[1])};
    auto grp_at = [&](const char* lane_base, int j, int in_block) -> const char* {
        return lane_base + (size_t)in_block * row_stride * sizeof(raw) +
               (unsigned long long)(unsigned)grp_blk[j] * blk_bytes;
    };
    // A lookup per row (blocks of 1-4 tokens): a lane's in-block rows are fixed (K: g, V: 2t (+ 1),
    // modulo the block size; a tile starts on a block), so they join its base; V's rows 2t and
    // 2t + 1 share a block from 2 tokens up, and one lookup.
    const char* const k_row_lane = k_lane + (size_t)(g & (BLOCK_SIZE - 1)) * row_stride * sizeof(raw);
    const char* const v_row_lane[2] = {
        v_lane[0] + (size_t)((2 * t) & (BLOCK_SIZE - 1)) * row_stride * sizeof(raw),
        v_lane[0] + (size_t)((2 * t + 1) & (BLOCK_SIZE - 1)) * row_stride * sizeof(raw)};
    // The lookups themselves: a lane's rows lie at fixed block offsets from its first row's
    // block (K: (8 nt) / block size; V: (x & 1 + 8 (x / 2)) / block size, rows 2t, 2t + 1 sharing
    // one from 2 tokens up), so each lane keeps a pointer into the table and a tile adds its
    // blocks: one pointer a tile for K and one for V, the lookups immediate offsets from it.
    const int* const k_tab = table + (g >> LOG2_BS);
    const int* const v_tab = table + ((2 * t) >> LOG2_BS);
    auto tab_at = [&](const int* lane_tab, int tile) -> const int* {
        return lane_tab + (unsigned)tile * (unsigned)(TOK >> LOG2_BS);
    };
    auto row_at = [&](const char* lane_row_base, int blk) -> const char* {
        return lane_row_base + (unsigned long long)(unsigned)blk * blk_bytes;
    };
    // TOK <= BLOCK_SIZE: the first element of tile `tile`, one lookup (minus the lane offsets).
    auto tile_base = [&](int tile) -> long long {
        const int first = tile * TOK;
        return (((long long)table[first >> LOG2_BS] << LOG2_BS) + (first & (BLOCK_SIZE - 1))) * row_stride;
    };
    auto load_k = [&](int tile, bool masked) {
        const long long base = TOK <= BLOCK_SIZE ? tile_base(tile) : 0;
        const int* const kt = tab_at(k_tab, tile);
        if (GROUPS) {
#pragma unroll
            for (int j = 0; j < NGRP; ++j) {
                // (a group with no row in [start, end) may lie past the table's last block)
                const int first = tile * TOK + 8 * j;
                grp_blk[j] = !masked || (first < end && first + 8 > start) ? table[first >> LOG2_BS] : 0;
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) {
            const int i = 8 * nt + g, pos = tile * TOK + i;
            if (!masked || (pos >= start && pos < end)) {
                const uint4* p =
                    GROUPS ? reinterpret_cast<const uint4*>(grp_at(k_lane, nt, (8 * nt) & (BLOCK_SIZE - 1)))
                    : TOK <= BLOCK_SIZE ? reinterpret_cast<const uint4*>(k_cache + base + k_off[nt])
                                        : reinterpret_cast<const uint4*>(row_at(k_row_lane, kt[(8 * nt) >> LOG2_BS]));
#pragma unroll
                for (int m = 0; m < KVEC; ++m) {
                    const uint4 w = p[4 * m];
                    kw[nt][m][0] = w.x, kw[nt][m][1] = w.y, kw[nt][m][2] = w.z, kw[nt][m][3] = w.w;
                }
            } else {
#pragma unroll
                for (int m = 0; m < KVEC; ++m) kw[nt][m][0] = kw[nt][m][1] = kw[nt][m][2] = kw[nt][m][3] = 0u;
            }
        }
    };
    auto load_v = [&](int tile, bool masked) {  // after load_k(tile, masked): see grp_blk
        const long long base = TOK <= BLOCK_SIZE ? tile_base(tile) : 0;
        const int* const vt = tab_at(v_tab, tile);
        int pair_blk = 0;  // a lookup per row, 2-4 tokens: the block of rows 2t, 2t + 1 (+ 8 p)
#pragma unroll
        for (int x = 0; x < VTOK; ++x) {
            const int i = 2 * t + (x & 1) + 8 * (x >> 1), pos = tile * TOK + i;
            const bool live = !masked || (pos >= start && pos < end);
            if (!GROUPS && TOK > BLOCK_SIZE && (BLOCK_SIZE == 1 || !(x & 1))) {
                // (from 2 tokens up the pair's block, if either row is in [start, end))
                const bool need = live || (BLOCK_SIZE >= 2 && pos + 1 >= start && pos + 1 < end);
                pair_blk = need ? vt[((x & 1) + 8 * (x >> 1)) >> LOG2_BS] : 0;
            }
            const raw* p =
                GROUPS ? reinterpret_cast<const raw*>(grp_at(v_lane[x & 1], x >> 1, (8 * (x >> 1)) & (BLOCK_SIZE - 1)))
                    : TOK <= BLOCK_SIZE ? v_cache + base + v_off[x]
                                        : reinterpret_cast<const raw*>(live ? row_at(v_row_lane[x & 1], pair_blk)
                                                                            : v_lane[0]);
#pragma unroll
            for (int c = 0; c < VCH; ++c) {
                if (CW == 4) {
                    const uint4 w = live ? reinterpret_cast<const uint4*>(p)[8 * c] : make_uint4(0u, 0u, 0u, 0u);
                    vw[x][c][0] = w.x, vw[x][c][1] = w.y, vw[x][c][CW - 2] = w.z, vw[x][c][CW - 1] = w.w;
                } else {
                    const uint2 w = live ? reinterpret_cast<const uint2*>(p)[8 * c] : make_uint2(0u, 0u);
                    vw[x][c][0] = w.x, vw[x][c][CW - 1] = w.y;
                }
            }
        }
    };
    // S = Q K^T for the tile: s[nt][e] = score of head g and token 8 nt + 2t + e ([2], [3]:
    // the padding rows).
    auto scores = [&](float (&s)[NT_S][4]) {
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) {
            float sa[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                const uint4 qv = sm_q[ks][lane];
                Steps::s_step(sa, qv, kw[nt][ks / 2][2 * (ks & 1)], kw[nt][ks / 2][2 * (ks & 1) + 1]);
            }
            Steps::s_done(sa, s[nt]);
        }
    };
    // Softmax, then O^T += V^T P^T. P^T's B fragment (k = tokens 2t, 2t + 1 [+ 8], n = head g) is
    // the S accumulator as it is; V^T's A fragments: MmaSteps::o_step.
    auto finish = [&](float (&s)[NT_S][4], int tile, bool masked) {
        fragment_softmax<NT_S, NT_O, Steps::kColTMask>(s, acc, m_run, l_run, scale_log2, tile * TOK, start, end,
                                                       masked, t);
        const typename Steps::template P<NT_S> p = Steps::template make_p<NT_S>(s, lane);
#pragma unroll
        for (int j = 0; j < NT_O; ++j) Steps::template o_step<NT_S>(acc[j], vw, j / (CE / 2), j % (CE / 2), p);
    };
    run_decode_tiles<TOK, NT_S>(start, end, warp, load_k, load_v, scores, finish);
    Steps::o_done(acc);

    __shared__ float sm_m[DECODE_WARPS][G];
    __shared__ float sm_l[DECODE_WARPS][G];
    mma_decode_end<T, HEAD_DIM, G, NT_O, CE>(sm.acc, sm_m, sm_l, acc, m_run, l_run, scale_log2, warp, g, t, out,
                                             part_acc, part_ml, seq, num_heads, head0, split, num_splits, w.num_parts);
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
