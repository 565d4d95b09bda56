"""`chunked`: vLLM V1 / Sarathi-Serve scheduling.

Running requests go first (decodes, and the next chunk of any prompt still prefilling), then
waiting requests fill what is left of the token budget (`max_num_batched_tokens`), so a long
prompt is prefilled over several steps while decodes keep flowing. When blocks run short, the
most recently admitted request is preempted; no new request is admitted in a step that preempted.

Admission follows vLLM V1: a waiting (or preempted) request is admitted only if blocks for all
its tokens so far fit (`scheduler.reserve_full_sequence`), leaving the watermark free while
anything runs; the first request that does not fit ends admission for the step.
"""

from __future__ import annotations

from sim import stepping
from sim.policies.base import Policy, SchedulerOutput


class ChunkedPolicy(Policy):
    name = "chunked"
    description = "vLLM V1 / Sarathi-Serve: decodes first, prefill chunks fill the token budget"
    models_v1 = True

    def schedule(self) -> SchedulerOutput:
        """Running requests first within the token budget, then admissions from the queue
        in what is left (`sim.stepping.chunked_schedule`, compiled where it could be)."""
        return stepping.chunked_schedule(self)

    def decodes_alone(self) -> bool:
        return len(self.running) <= self.cfg.max_num_batched_tokens  # (one token each)

    def admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit from the queue, in the policy's order, within what is left of the token budget
        and `max_num_seqs`, while blocks for each (and the watermark) fit; the first that does
        not fit ends admission unless `make_room` preempts for it. (`sim.stepping`, compiled
        where it could be.)"""
        stepping.admit_waiting(self, out, budget)

    def make_room(self, out: SchedulerOutput, req) -> int | None:
        """`req`, next in the queue, does not fit: preempt for it and return the tokens given
        back, or None to end admission for this step (vLLM V1 never preempts for a waiting
        request)."""
        return None



# What the hot path does itself for a plain ChunkedPolicy (sim.stepping: `PolicyState.plain`).
_METHODS = ("schedule", "schedule_running", "admit_waiting", "make_room", "decodes_alone",
            "next_waiting", "plan_waiting", "watermark_blocks", "schedule_admitted",
            "take_waiting", "next_change_time", "has_work", "add", "finished",
            "skip_ahead_safe")
_ORIGINAL = {name: getattr(ChunkedPolicy, name) for name in _METHODS}


def is_plain(policy) -> bool:
    """Whether `policy` is exactly a ChunkedPolicy, none of its methods patched."""
    if type(policy) is not ChunkedPolicy:
        return False
    mine = policy.__dict__
    return all(name not in mine and getattr(ChunkedPolicy, name) is f
               for name, f in _ORIGINAL.items())
