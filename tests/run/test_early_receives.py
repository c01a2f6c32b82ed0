"""Early receives on gloo (partc.run.schedule.P2PTimer.post_receives): every receive of a step
posted at its start and handed to torch's schedule when it posts the same receive. Real gloo
process groups, real PipelineStages and torch's own ScheduleGPipe / Schedule1F1B, three ranks
(the middle one receives activations from one neighbour and gradients from the other)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from partc.hardware.local import free_port
from partc.run.schedule import P2PTimer

RANKS, MICROBATCHES, STEPS = 3, 4, 3


def _train(rank: int, schedule_cls: Any, timer: P2PTimer) -> list[torch.Tensor]:
    """STEPS steps of SGD on this rank's Linear stage; returns its weights after them."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(RANKS)]
    stage = PipelineStage(layers[rank], rank, RANKS, torch.device("cpu"))
    schedule = schedule_cls(stage, MICROBATCHES, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    optimizer = torch.optim.SGD(layers[rank].parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(2 * MICROBATCHES, 8, generator=torch.Generator().manual_seed(step))
        target = torch.randn(2 * MICROBATCHES, 8, generator=torch.Generator().manual_seed(-step))
        optimizer.zero_grad()
        timer.post_receives([stage], MICROBATCHES)
        if rank == 0:
            schedule.step(x)
        elif rank == RANKS - 1:
            schedule.step(target=target, losses=[])
        else:
            schedule.step()
        optimizer.step()
    return [p.detach().clone() for p in layers[rank].parameters()]


def _rank(rank: int, port: int, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)
    try:
        torch.set_num_threads(1)
        timer = P2PTimer(torch.device("cpu"))
        timer.install()
        out = {}
        for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
            timer.early_receives = False
            plain = _train(rank, cls, timer)
            taken_before = timer.early_taken
            timer.early_receives = True
            early = _train(rank, cls, timer)
            out[name] = (all(torch.equal(a, b) for a, b in zip(plain, early, strict=True)),
                         timer.early_taken - taken_before, len(timer._early))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict[str, tuple[bool, int, int]]]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, results)) for rank in range(RANKS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    hung = [p for p in procs if p.is_alive()]  # a receive matched to the wrong send waits forever
    for p in hung:
        p.kill()
        p.join()
    assert not hung and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return dict(results.get() for _ in range(RANKS))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_early_receives_train_bit_for_bit_as_torch_posts_them(
        outcomes: dict[int, dict[str, tuple[bool, int, int]]], schedule: str) -> None:
    """The same weights after three steps with and without early receives; every receive after
    the first step (which sets the stages up) was posted early and taken by the schedule, and
    none is left over."""
    per_step = {0: MICROBATCHES, 1: 2 * MICROBATCHES, 2: MICROBATCHES}
    for rank in range(RANKS):
        same, taken, left = outcomes[rank][schedule]
        assert same, f"rank {rank}"
        assert taken == per_step[rank] * (STEPS - 1), f"rank {rank}"
        assert left == 0
