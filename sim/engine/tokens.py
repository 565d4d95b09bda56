"""Prompt token ids for real compute: deterministic per request, shared where prefixes are shared.

A request's prompt is the bytes typed by a user (byte-level vocabulary), or tokens drawn from the
scenario seed. Requests from a trace with `hash_ids` (Mooncake) get one block of tokens per hash
id, so equal ids give equal token prefixes, exactly what prefix caching needs to find; requests
of a synthetic workload with a shared system prompt start with their group's prompt tokens.
These are the equalities `KVCacheManager.block_key` relies on.
"""

from __future__ import annotations

import numpy as np

_PROMPT_STREAM, _HASH_STREAM, _SYSTEM_STREAM = 101, 102, 103
SESSION_STREAM = 104  # a conversation's new tokens of each turn (sim.engine.users)


def prompt_token_ids(seed: int, req, vocab_size: int, hash_block_size: int = 512) -> np.ndarray:
    """The `req.prompt_len` prompt token ids of `req` (int32)."""
    n = req.prompt_len
    if req.prompt_text is not None:
        ids = np.frombuffer(req.prompt_text, dtype=np.uint8).astype(np.int32) % vocab_size
        return ids[:n] if len(ids) >= n else np.resize(ids, n)
    parts, have = [], 0
    if req.shared_prefix is not None:
        group, shared = req.shared_prefix
        rng = np.random.default_rng([seed, _SYSTEM_STREAM, group])
        parts.append(rng.integers(0, vocab_size, size=shared, dtype=np.int32))
        have = shared
    for h in req.hash_ids or ():
        if have >= n:
            break
        rng = np.random.default_rng([seed, _HASH_STREAM, int(h)])
        parts.append(rng.integers(0, vocab_size, size=hash_block_size, dtype=np.int32))
        have += hash_block_size
    if have < n:
        # a further sample of a request has that request's prompt
        owner = req.req_id if req.parent_id is None else req.parent_id
        rng = np.random.default_rng([seed, _PROMPT_STREAM, owner])
        parts.append(rng.integers(0, vocab_size, size=n - have, dtype=np.int32))
    return np.concatenate(parts)[:n] if parts else np.zeros(0, dtype=np.int32)
