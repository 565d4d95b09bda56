"""Routers: which replica of a deployment (`sim.deploy.cluster`) an arriving request goes to.

A router sees the replicas as they stand at the request's arrival (each at its first step
boundary at or after it) and returns the replica's index and, for the event log, why.
"""

from __future__ import annotations

from sim.engine.engine import Engine
from sim.engine.kv import blocks_for
from sim.engine.request import Request


def outstanding(e: Engine) -> int:
    """Requests routed to `e` that have not ended."""
    c = e.counts
    return c["arrived"] - c["finished"] - c["cancelled"] - c["rejected"]


def _least_outstanding(engines) -> tuple[int, str]:
    loads = [outstanding(e) for e in engines]
    i = loads.index(min(loads))
    return i, f"least outstanding ({loads[i]})"


class Router:
    """Chooses the replica of each arrival from the replicas' state at its arrival."""

    name = ""

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def choose(self, req: Request, engines: list[Engine]) -> tuple[int, str]:
        """(replica index, why) for `req`."""
        raise NotImplementedError


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.next = 0

    def choose(self, req, engines):
        i = self.next
        self.next = (i + 1) % len(engines)
        return i, "round robin"


class LeastOutstanding(Router):
    """The replica with the fewest requests routed to it and not yet ended (ties: lowest
    index)."""

    name = "least-outstanding"

    def choose(self, req, engines):
        return _least_outstanding(engines)


class LeastKV(Router):
    """The replica with the least KV demand: blocks in use plus the blocks its queued requests
    still need (ties: fewest outstanding, then lowest index)."""

    name = "least-kv"

    def choose(self, req, engines):
        loads = []
        for e in engines:
            bs = e.block_size
            queued = sum(blocks_for(r.num_tokens, bs) - len(r.block_table)
                         for r in e.policy.waiting)
            loads.append((e.kv.num_used_blocks + queued, outstanding(e)))
        i = loads.index(min(loads))
        return i, f"least kv ({loads[i][0]} blocks)"


class PrefixAffinity(Router):
    """Requests that share a prefix go where it is: to the replica whose prefix cache holds the
    most of the request's leading blocks (`match_prefix`), or failing that to the replica the
    longest run of them was last routed to (a table of the shareable block keys routed so far,
    as SGLang's router keeps a tree), unless that replica has `affinity_max_imbalance` more
    outstanding requests than the least loaded; otherwise, least-outstanding."""

    name = "prefix-affinity"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.owner: dict = {}  # shareable block key -> replica it was last routed to

    def choose(self, req, engines):
        kv = engines[0].kv
        hits = [len(e.kv.match_prefix(req)) for e in engines]
        keys = req.block_keys
        if keys is None:  # prefix caching off: the keys the cache would use
            chains = kv.hash_chains(req.hash_ids) if req.hash_ids else None
            keys = req.block_keys = [kv.block_key(req, j, chains)
                                     for j in range((req.prompt_len - 1) // kv.block_size)]
        shared = []
        for k in keys:
            if k[0] == "u":  # a request's own tokens, and every key after them, are unique
                break
            shared.append(k)
        routed, last = 0, None
        for k in shared:
            owner = self.owner.get(k)
            if owner is None:
                break
            routed, last = routed + 1, owner
        best = max(range(len(engines)), key=lambda i: (hits[i], -i))
        score = hits[best]
        why = f"prefix cached ({score} blocks)"
        if routed > score:
            best, score, why = last, routed, f"prefix routed ({routed} blocks)"
        loads = [outstanding(e) for e in engines]
        if score == 0:
            best, why = _least_outstanding(engines)
        elif loads[best] - min(loads) > self.cfg.affinity_max_imbalance:
            best, why = _least_outstanding(engines)
            why = "balance: " + why
        for k in shared:
            self.owner[k] = best
        return best, why


class QueueLength(Router):
    """vLLM's data-parallel load balancing: the rank with the lowest `4 x waiting + running`
    (ties: lowest index), as `DPLBAsyncMPClient.get_core_engine_for_request` scores the engine
    cores (vllm/v1/engine/core_client.py). vLLM reads counts the coordinator publishes every
    100 ms, plus its own routings since; here they are exact at the arrival."""

    name = "queue-length"

    def choose(self, req, engines):
        scores = [4 * len(e.policy.waiting) + len(e.policy.running) for e in engines]
        i = scores.index(min(scores))
        return i, f"queue length (score {scores[i]})"


ROUTERS: dict[str, type[Router]] = {
    cls.name: cls for cls in (RoundRobin, LeastOutstanding, LeastKV, PrefixAffinity,
                              QueueLength)}
