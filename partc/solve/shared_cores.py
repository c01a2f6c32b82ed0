"""How ranks that share a CPU core split it, as the simulator models the OS scheduler.

Where a node runs more gloo processes than it has cores (`PipelineSpec.core_sharing`), the
processes computing on one core at a time share it. The plain model is processor sharing: k
busy ranks each progress at 1/k. Linux's fair scheduler is fair over time rather than at each
instant: a process that wakes from a wait is placed a little behind the processes that kept
running and runs ahead of them until it has caught up. Measured on a 2-core VM (Linux 6.18,
4 gloo processes of a 4-stage pipeline, two per core; bench/launch_timeline.py with the
threads' /proc schedstat): a rank woken by its input ran 9.6 ms of forward in one slice while
its core-mate, mid-forward, waited 12.9 ms on the run queue. That favours whoever was waiting,
and GPipe's critical path runs through a rank that computes its forwards back to back while a
downstream core-mate wakes for each of its own: processor sharing priced 4-process GPipe
plans 10-17% faster than they ran (docs/benchmarks.md).

The model here: each rank has a served time (the CPU seconds it has had, its virtual runtime).
A rank that starts a computation after waiting is placed `wake_credit_s` behind its core's
level (the least served of the ranks computing there, never decreasing), or keeps its own
served time where that is later (it ran more recently than the others); on each core the
least-served computing ranks share the core's computing share equally and the others wait
until they catch up. With `wake_credit_s` 0 every waker joins at the level and this is
processor sharing exactly. The credit is a property of the node's scheduler, measured by
`partc calibrate` (partc.hardware.wake_credit), and recorded in the cluster config.
"""
from __future__ import annotations

import math
from typing import Collection, Sequence

_TIE = 1e-12  # served seconds within which two ranks count as level


class SharedCores:
    """The served times of the ranks sharing cores and what they imply for their rates.

    `sharing`: per rank, the ranks on its core, itself included (`PipelineSpec.core_sharing`;
    a rank appears once per replica on that core)."""

    def __init__(self, sharing: Sequence[Sequence[int]], wake_credit_s: float) -> None:
        if not wake_credit_s >= 0 or not math.isfinite(wake_credit_s):
            raise ValueError(f"wake_credit_s must be a finite number >= 0, got {wake_credit_s!r}")
        self.credit = wake_credit_s
        # a core is known by its ranks (with several replicas per stage a rank's group is its
        # replica-0 device's core, and the groups of a core's ranks can differ: each group then
        # competes on its own, while `load` still counts everything on the rank's core)
        self.core = [tuple(sorted(set(group))) for group in sharing]
        # processes per rank on its core: replicas of a stage on one core run in lockstep
        self.copies = [max(1, list(group).count(rank)) for rank, group in enumerate(sharing)]
        self.served = [0.0] * len(sharing)
        self.level = dict.fromkeys(self.core, 0.0)
        self.free_since = [0.0] * len(sharing)  # when each rank's last computation ended

    def start(self, rank: int, now: float, computing: Collection[int]) -> None:
        """`rank` starts a computation at `now` (`computing`: the ranks computing now, `rank`
        among them or not). After a wait it joins its core behind the level by the credit, or
        at it when no core-mate is computing; straight after its last computation it keeps its
        place."""
        if now <= self.free_since[rank]:
            return
        core = self.core[rank]
        mates = any(other != rank and self.core[other] == core for other in computing)
        self.served[rank] = max(self.served[rank],
                                self.level[core] - (self.credit if mates else 0.0))

    def finish(self, rank: int, now: float) -> None:
        """`rank`'s computation ended at `now`."""
        self.free_since[rank] = now

    def slowdowns(self, computing: Collection[int], load: Sequence[int]) -> dict[int, float]:
        """Per computing rank, the wall seconds a second of its own work takes: under processor
        sharing `load[rank]` (the processes and copies runnable on its core); here the core's
        computing processes' part of the core goes to the processes of its least-served
        computing ranks, so theirs is `load[rank]` x leaders / computing processes, and the
        others' inf (they wait)."""
        least: dict[tuple[int, ...], float] = {}
        processes: dict[tuple[int, ...], int] = {}
        for rank in computing:
            core = self.core[rank]
            least[core] = min(least.get(core, math.inf), self.served[rank])
            processes[core] = processes.get(core, 0) + self.copies[rank]
        leading: dict[tuple[int, ...], int] = {}
        for rank in computing:
            core = self.core[rank]
            if self.served[rank] <= least[core] + _TIE:
                leading[core] = leading.get(core, 0) + self.copies[rank]
        slow = {}
        for rank in computing:
            core = self.core[rank]
            # leaders / processes first: exactly 1 when all lead, so 0 credit is processor
            # sharing to the bit
            slow[rank] = load[rank] * (leading[core] / processes[core]) \
                if self.served[rank] <= least[core] + _TIE else math.inf
        return slow

    def catch_up_s(self, computing: Collection[int], slow: dict[int, float]) -> float:
        """Seconds until a running rank catches up with the next-least-served computing rank of
        its core (when the slowdowns change); inf when none is behind another."""
        best = math.inf
        for rank in computing:
            if slow[rank] == math.inf:
                continue
            core = self.core[rank]
            ahead = [self.served[other] for other in computing
                     if self.core[other] == core and self.served[other] > self.served[rank] + _TIE]
            if ahead:
                best = min(best, (min(ahead) - self.served[rank]) * slow[rank])
        return best

    def advance(self, computing: Collection[int], slow: dict[int, float], dt: float) -> None:
        """`dt` seconds pass at `slow`: the ranks' served times and the cores' levels move."""
        if not self.credit:
            return  # every computing rank of a core stays level: nothing to track
        for rank in computing:
            if slow[rank] != math.inf:
                self.served[rank] += dt / slow[rank]
        least: dict[tuple[int, ...], float] = {}
        for rank in computing:
            core = self.core[rank]
            least[core] = min(least.get(core, math.inf), self.served[rank])
        for core, served in least.items():
            if served > self.level[core]:
                self.level[core] = served
