// Scatter new K/V rows into the paged cache: row t goes to slot slot_mapping[t].
//
// Grid (num_tokens), any block size. A token's row (num_kv_heads * head_dim elements) is
// contiguous both in k/v and at its slot in the cache, so this is a row copy in words of type W
// (uint4 when the row is a multiple of 16 bytes, else 4- or 2-byte words); it never converts,
// so one instantiation serves every storage dtype. Negative slots (padding) are skipped.
#include "common.cuh"

template <typename W>
__global__ void write_kv_kernel(const W* __restrict__ k,           // [num_tokens, row_words]
                                const W* __restrict__ v,           // [num_tokens, row_words]
                                W* __restrict__ k_cache,           // [num_slots, row_words]
                                W* __restrict__ v_cache,           // [num_slots, row_words]
                                const long long* __restrict__ slot_mapping,  // [num_tokens]
                                int row_words) {
    const long long slot = slot_mapping[blockIdx.x];
    if (slot < 0) return;
    const long long src = (long long)blockIdx.x * row_words;
    const long long dst = slot * row_words;
    for (int i = threadIdx.x; i < row_words; i += blockDim.x) {
        k_cache[dst + i] = k[src + i];
        v_cache[dst + i] = v[src + i];
    }
}
