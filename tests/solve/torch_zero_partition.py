"""The partition torch's ZeroRedundancyOptimizer makes, computed on gloo ranks spawned by
tests/solve/test_levers.py. Its own module that imports only torch: a spawned rank imports the
module its function lives in, and the test module's imports (capture, the solver) would cost
each of the three ranks seconds of CPU."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def torch_partition(rank: int, world: int, port: int, sizes: list[int], out: Any) -> None:
    """Rank `rank` of `world`: build parameters of `sizes` and, on rank 0, put each rank's
    parameter indices, as ZeroRedundancyOptimizer partitions them, into `out["owned"]`."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)
    ids = {id(p): i for i, p in enumerate(params)}
    if rank == 0:
        out["owned"] = [[ids[id(p)] for g in groups for p in g["params"]]
                        for groups in opt._partition_parameters()]
    dist.destroy_process_group()
