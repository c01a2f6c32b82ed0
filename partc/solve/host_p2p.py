"""Host-synchronous p2p (gloo) in the pipeline simulator: each rank's sends, receives and waits
as torch's schedules post them, transfers that start only when both sides have posted, and
copies that take CPU on both processes' cores.

Measured on this repository's 2-core machine (gloo over loopback, torch 2.13, processes pinned
to their own cores), what the simpler model of a send as its sender's busy time misses:

- A gloo send is a rendezvous: its bytes move only once the receiver has posted the matching
  receive. A sender whose receiver posted 20 ms late waits 20.6 ms for 1 B and 26.9 ms for 16 MiB.
- torch's schedules post a receive right before the compute that needs it; partc's runtime
  posts a GPipe or 1F1B step's receives at its start (partc.run.schedule.P2PTimer), so the
  transfer starts when its sender posts it. `Schedule1F1B` waits on a stage's deferred send
  together with its next receive: in steady state two neighbours meet at every exchange.
- Posting costs ~90 us; the copy runs on gloo's IO thread, on the pinned core of each side
  (a computation running meanwhile took 7.3 ms longer on the sender of a 16 MiB message,
  6.2 ms on its receiver), while the transfer itself took 7.9 ms (bench/gloo_p2p.py).

So a transfer here starts when both its sender and its receiver have posted it, progresses like
work on both ranks' cores (processor sharing with their computations and other transfers, at
the slower side's rate) for the link's time (`send_forward_s` / `send_backward_s`), and a rank
blocks where torch waits on it. This module builds the per-rank programs of posts, waits and
computations (`programs`) and runs them (`run`); `partc.solve.simulator` replays the result.
"""
from __future__ import annotations

import math
from typing import Sequence

from partc.options import Schedule
from partc.solve.shared_cores import SharedCores

Item = tuple[int, object]
"""One step of a rank's program: (COMPUTE, action), (POST, keys) or (WAIT, keys)."""

COMPUTE, POST, WAIT = 0, 1, 2

_DONE = 1e-12  # seconds of work below which a computation or transfer counts as finished


def programs(schedule: Schedule, orders: Sequence[Sequence[tuple[str, int, int]]], s: int,
             v: int, m: int) -> list[list[Item]]:
    """Per rank, its computations with the posts and waits torch's schedule class puts around
    them, from the ranks' ("F"|"B", virtual stage, micro-batch) orders. Actions and transfers
    are integers: F(k, i) is k * M + i, B(k, i) is V * M + k * M + i, and a transfer's key is
    the action that produced it (F(k, i): its output to stage k + 1; B(k, i): its input
    gradient to stage k - 1)."""
    if schedule == "interleaved-1f1b":
        return _runtime_programs([_lowered(ops, m) for ops in orders], s, v, m)
    return [_single_program(schedule, rank, s, m) for rank in range(s)]


def _single_program(schedule: Schedule, rank: int, s: int, m: int) -> list[Item]:
    """ScheduleGPipe / Schedule1F1B `_step_microbatches` (torch 2.13) on rank `rank` = stage,
    with every receive of the step posted at its start, as partc's runtime does on gloo."""
    vm = s * m
    first, last = rank == 0, rank == s - 1

    def fwd(i: int) -> int:
        return rank * m + i

    def bwd(i: int) -> int:
        return vm + rank * m + i

    def recv_f(i: int) -> tuple[int, ...]:
        return () if first else ((rank - 1) * m + i,)

    def send_f(i: int) -> tuple[int, ...]:
        return () if last else (fwd(i),)

    def recv_b(i: int) -> tuple[int, ...]:
        return () if last else (vm + (rank + 1) * m + i,)

    def send_b(i: int) -> tuple[int, ...]:
        return () if first else (bwd(i),)

    # partc's runtime posts the step's receives at its start (partc.run.schedule.P2PTimer) and
    # hands them to the schedule's later posts of the same receives
    early = tuple(k for i in range(m) for k in recv_f(i)) + \
        tuple(k for i in range(m) for k in recv_b(i))
    out: list[Item] = [(POST, early)] if early else []

    def exchange(keys: tuple[int, ...]) -> None:  # _wait_batch_p2p(_batch_p2p(keys))
        sends = tuple(k for k in keys if k not in early)
        if sends:
            out.append((POST, sends))
        if keys:
            out.append((WAIT, keys))

    def post(keys: tuple[int, ...]) -> tuple[int, ...]:
        if keys:
            out.append((POST, keys))
        return keys

    def wait(keys: tuple[int, ...]) -> None:
        if keys:
            out.append((WAIT, keys))

    if schedule == "gpipe":
        pending: tuple[int, ...] = ()
        for i in range(m):
            exchange(recv_f(i))
            out.append((COMPUTE, fwd(i)))
            pending += post(send_f(i))
        wait(pending)
        pending = ()
        for i in range(m):
            exchange(recv_b(i))
            out.append((COMPUTE, bwd(i)))
            pending += post(send_b(i))
        wait(pending)
        return out

    warmup = min(m, s - rank)
    sending: tuple[int, ...] = ()
    deferred: tuple[int, ...] = ()
    for i in range(warmup):
        exchange(recv_f(i))
        out.append((COMPUTE, fwd(i)))
        wait(sending)
        sending = ()
        if i != warmup - 1:
            sending = post(send_f(i))
        else:
            deferred = send_f(i)  # fused with the first backward's receive
    forward = warmup
    backward = 0
    while True:
        exchange(deferred + recv_b(backward))
        out.append((COMPUTE, bwd(backward)))
        deferred = send_b(backward)
        backward += 1
        if forward == m:
            break
        exchange(deferred + recv_f(forward))
        out.append((COMPUTE, fwd(forward)))
        deferred = send_f(forward)
        forward += 1
    sending = post(deferred)
    while backward < m:
        exchange(recv_b(backward))
        out.append((COMPUTE, bwd(backward)))
        wait(sending)
        sending = post(send_b(backward))
        backward += 1
    wait(sending)
    return out


def _lowered(ops: Sequence[tuple[str, int, int]], m: int,
             max_active_stages: int = 3) -> list[tuple[str, int, int] | None]:
    """A rank's computations as `_PipelineScheduleRuntime` lowers them before placing its
    sends and receives, its other actions as None: `_add_unshard_reshard` (an UNSHARD before a
    stage among the next `max_active_stages` distinct ones becomes active, a RESHARD when one
    drops out of them and for each still active at the end; emitted without FSDP too) and
    `_add_reduce_grad` (a REDUCE_GRAD after each stage's last backward). Each takes a round of
    `_add_send_recv` like a computation, which moves where the receives land."""
    out: list[tuple[str, int, int] | None] = []
    active: set[int] = set()
    backwards: dict[int, int] = {}
    for i, op in enumerate(ops):
        upcoming: list[int] = []
        for _, stage, _ in ops[i:]:
            if stage not in upcoming:
                upcoming.append(stage)
                if len(upcoming) == max_active_stages:
                    break
        dropped = [stage for stage in active if stage not in upcoming]
        fetched = [stage for stage in upcoming if stage not in active]
        out.extend([None] * (len(dropped) + len(fetched)))
        active = (active - set(dropped)) | set(fetched)
        out.append(op)
        if op[0] == "B":
            backwards[op[1]] = backwards.get(op[1], 0) + 1
            if backwards[op[1]] == m:
                out.append(None)
    out.extend([None] * len(active))
    return out


def _runtime_programs(slots: Sequence[Sequence[tuple[str, int, int] | None]], s: int, v: int,
                      m: int) -> list[list[Item]]:
    """`_PipelineScheduleRuntime` (ScheduleInterleaved1F1B, torch 2.13): `_add_send_recv` places
    each send right after its computation and the matching receive on the receiving rank in
    the same round; the runtime posts both without waiting, waits on a receive right before
    the computation that consumes it, and on every send at the end of the step."""
    vm = v * m

    def key(kind: str, stage: int, mb: int) -> int:
        return (0 if kind == "F" else vm) + stage * m + mb

    def has_comms(kind: str, stage: int) -> bool:
        if kind == "F":
            return stage != v - 1 and (stage + 1) % s != stage % s
        return stage != 0 and (stage - 1) % s != stage % s

    queues = {rank: list(ops) for rank, ops in enumerate(slots) if ops}
    out: list[list[Item]] = [[] for _ in range(s)]
    done: list[set[int]] = [set() for _ in range(s)]  # computations run on the rank
    received: list[set[int]] = [set() for _ in range(s)]  # transfers whose receive it posted
    sends: list[list[int]] = [[] for _ in range(s)]
    while queues:
        progress = False
        for rank in sorted(queues):
            slot = queues[rank][0]
            if slot is None:  # not a computation: always ready, places nothing
                progress = True
                queues[rank].pop(0)
                if not queues[rank]:
                    del queues[rank]
                continue
            kind, stage, mb = slot
            # ready once its input was received, or computed on this rank
            needs = key("F", stage - 1, mb) if kind == "F" and stage != 0 else \
                key("B", stage + 1, mb) if kind == "B" and stage != v - 1 else -1
            if needs >= 0 and needs not in received[rank] and needs not in done[rank]:
                continue
            progress = True
            action = key(kind, stage, mb)
            # wait on the receive of an input a neighbour rank sent (has_comms of its producer)
            if needs >= 0 and has_comms(kind, stage - 1 if kind == "F" else stage + 1):
                out[rank].append((WAIT, (needs,)))
            out[rank].append((COMPUTE, action))
            done[rank].add(action)
            if has_comms(kind, stage):
                peer = (stage + 1) % s if kind == "F" else (stage - 1) % s
                out[rank].append((POST, (action,)))
                sends[rank].append(action)
                out[peer].append((POST, (action,)))
                received[peer].add(action)
            queues[rank].pop(0)
            if not queues[rank]:
                del queues[rank]
        if not progress:
            raise ValueError("deadlock: torch's runtime cannot place the sends and receives "
                             "of this action order")
    for rank in range(s):
        if sends[rank]:
            out[rank].append((WAIT, tuple(sends[rank])))
    return out


def run(progs: list[list[Item]], forward_s: Sequence[float], backward_s: Sequence[float],
        send_forward_s: Sequence[float], send_backward_s: Sequence[float],
        forward_latency_s: Sequence[float], backward_latency_s: Sequence[float],
        sharing: Sequence[Sequence[int]], m: int, wake_credit_s: float = 0.0
        ) -> tuple[list[float], list[float], list[int], list[float]]:
    """Run the programs: (start, finish) per computation (NaN if it never ran), how far each rank
    got (in program steps), and when each rank's program ended (NaN if it did not).

    Per virtual stage: its forward and backward compute seconds, the link time of its outputs to
    the next stage and of its input gradients to the previous one, and the latency part of
    each (a wait; the rest is copying on both ends' cores). `sharing`: per
    rank, the ranks on its core (itself included, once per replica). Every runnable thing on a
    core (a rank's computation, each transfer with an end on it) progresses at 1 / (their
    number); a transfer at its slower side's rate."""
    s = len(progs)
    v = len(forward_s)
    vm = v * m
    start_of = [math.nan] * (2 * vm)
    finish = [math.nan] * (2 * vm)
    position = [0] * s
    ended = [math.nan] * s
    computing = [-1] * s  # the action a rank is computing, -1 when none
    left = [0.0] * s  # its own seconds of work still to do
    posted: dict[int, int] = {}  # transfer -> sides that posted it (1 or 2)
    moving: dict[int, float] = {}  # transfer in flight -> its seconds of copying still to do
    copying: set[int] = set()  # transfers past their latency, copying on both cores
    arrived: set[int] = set()
    waiting_until: dict[int, float] = {}  # transfer in its latency -> when that ends
    peers: dict[int, tuple[int, int]] = {}  # transfer -> (sender, receiver) ranks
    cores = SharedCores(sharing, wake_credit_s)
    now = 0.0

    def start_transfer(k: int) -> None:
        """Both sides posted transfer k: it waits out its latency, then copies on both cores."""
        if k < vm:
            stage = k // m
            seconds, delay, peer = send_forward_s[stage], forward_latency_s[stage], stage + 1
        else:
            stage = (k - vm) // m
            seconds, delay, peer = send_backward_s[stage], backward_latency_s[stage], stage - 1
        peers[k] = (stage % s, peer % s)
        if seconds <= 0:
            arrive(k)
            return
        delay = min(delay, seconds)
        moving[k] = seconds - delay
        if delay > 0:
            waiting_until[k] = now + delay
        else:
            copying.add(k)

    def arrive(k: int) -> None:
        arrived.add(k)
        dirty.update(peers[k])  # both ends may be waiting on it

    def advance(rank: int) -> None:
        """Run the rank's instantaneous steps: posts, satisfied waits, the start of a
        computation."""
        program = progs[rank]
        while computing[rank] < 0 and position[rank] < len(program):
            what, arg = program[position[rank]]
            if what == WAIT:
                if not all(k in arrived for k in arg):  # type: ignore[attr-defined]
                    break
            elif what == POST:
                for k in arg:  # type: ignore[attr-defined]
                    posted[k] = posted.get(k, 0) + 1
                    if posted[k] == 2:
                        start_transfer(k)
            else:
                action = int(arg)  # type: ignore[call-overload]
                stage = (action if action < vm else action - vm) // m
                computing[rank] = action
                left[rank] = forward_s[stage] if action < vm else backward_s[stage]
                start_of[action] = now
                cores.start(rank, now, busy)
                busy.add(rank)
            position[rank] += 1
        if computing[rank] < 0 and position[rank] == len(program) and ended[rank] != ended[rank]:
            ended[rank] = now

    # Ranks to re-examine: all at first, then those whose computation ended or to or from
    # which a transfer arrived (nothing else lets a rank move on).
    dirty = set(range(s))
    busy: set[int] = set()  # ranks computing
    while True:
        while dirty:
            advance(dirty.pop())
        if not moving and not waiting_until and not busy:
            return start_of, finish, position, ended
        threads = [1 if rank in busy else 0 for rank in range(s)]
        for k in copying:
            a, b = peers[k]
            threads[a] += 1
            threads[b] += 1
        load = [sum(threads[other] for other in sharing[rank]) for rank in range(s)]
        rate = {k: 1.0 / max(load[peers[k][0]], load[peers[k][1]]) for k in copying}
        slow = cores.slowdowns(busy, load)
        step = cores.catch_up_s(busy, slow)
        for rank in busy:
            if slow[rank] != math.inf:
                step = min(step, left[rank] * slow[rank])
        for k in copying:
            step = min(step, moving[k] / rate[k])
        for until in waiting_until.values():
            step = min(step, until - now)
        now += step
        cores.advance(busy, slow, step)
        for rank in list(busy):
            if slow[rank] == math.inf:
                continue
            left[rank] -= step / slow[rank]
            if left[rank] <= _DONE:
                finish[computing[rank]] = now
                computing[rank] = -1
                cores.finish(rank, now)
                busy.discard(rank)
                dirty.add(rank)
        for k in list(copying):
            moving[k] -= step * rate[k]
            if moving[k] <= _DONE:
                del moving[k]
                copying.discard(k)
                arrive(k)
        for k in [k for k, until in waiting_until.items() if until <= now + _DONE]:
            del waiting_until[k]
            if moving[k] > _DONE:
                copying.add(k)
            else:
                del moving[k]
                arrive(k)
