"""Real compute for servesim: paged attention kernels (NumPy and CUDA), a tiny model, an executor.

`gpu` never imports `sim`: the engine reaches it only through the executor protocol of
`sim/engine/executor.py`, which `gpu.executor.ModelExecutor` implements by duck typing.

Memory layout (the same on both backends)
-----------------------------------------
KV cache, per layer, one array for K and one for V:

    k_cache, v_cache   [num_blocks, block_size, num_kv_heads, head_dim]

A block holds `block_size` consecutive token positions of one sequence; within a block a
token's row is `num_kv_heads * head_dim` contiguous elements, so one token of one kv head is a
contiguous `head_dim` vector (16-byte vector loads on the GPU).

Per batch (built once per step, shared by every layer):

    block_tables   [num_seqs, max_blocks_per_seq] int32   physical block of each logical block
    seq_lens       [num_seqs] int32    tokens in the cache, the one being decoded included
    slot_mapping   [num_tokens] int64  where each new token's K/V goes:
                                       slot = block_id * block_size + offset; negative = skip
    cu_seqlens_q   [num_prefill_seqs + 1] int32   prefill chunk offsets into the query rows

Token position p of sequence s lives in block `block_tables[s, p // block_size]` at offset
`p % block_size`. Entries of a block table past the sequence's last block are padding and are
never read for data (their value does not matter).

Grouped-query attention: query head h reads kv head h // (num_heads // num_kv_heads).

Storage dtypes: float32, float16, and bfloat16 (CuPy only; carried as uint16 bit patterns since
NumPy and CuPy have no bfloat16 dtype). Accumulation is float32 (float64 on NumPy when q is
float64, which the tiny model uses for batch invariance; see `gpu.model`).

Kernels
-------
`paged_decode_attention`, `paged_prefill_attention` and `write_kv` dispatch on the array type of
their first argument: NumPy arrays run `gpu.numpy_backend`, CuPy arrays run `gpu.cupy_backend`
(CUDA C in `gpu/kernels/*.cu`, compiled by NVRTC on first use). `get_backend("auto" | "numpy" |
"cupy")` names a backend explicitly; `import gpu` never needs CuPy.
"""

from .backend import (
    BACKEND_NAMES,
    Backend,
    get_backend,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)
from .errors import BackendUnavailable, KernelError, VerifyError

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "BackendUnavailable",
    "KernelError",
    "VerifyError",
    "get_backend",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
]
