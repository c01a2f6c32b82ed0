"""Sharded gradients (ZeRO-2) for a stage's data-parallel replicas, on its TorchScript module as
it is: the plan's `sharding: gradients`.

The stage's optimizer is torch's ZeroRedundancyOptimizer (ZeRO-1), which gives each replica the
parameters it steps. `GradientSharder` makes each replica hold only those parameters' gradients:
as a backward forms a parameter's gradient (a post-accumulate-grad hook on the parameter, so the
stage module needs no change), it joins its owner's bucket (partc.solve.memory.gradient_buckets,
in the order the gradients form, which `gradient_order` finds by one placeholder backward); a
full bucket is reduced onto its owner (`torch.distributed.reduce`, one collective per bucket,
in the same order on every replica), and the replicas that do not own it drop their copies.
The owner's gradients accumulate the reduced sums over micro-batches (autograd adds the next
micro-batch's gradient into them; the others start from nothing each time, so a reduce of the
sum stays the sum over replicas and micro-batches). `finish` divides by the replicas (DDP's
mean) and all-reduces the parameters other pipeline ranks hold too (`kept_whole`: tied
weights, whose copies' gradients launch then sums across stages).

A replica thus holds its share of the gradients, plus at most one filling bucket per other
owner (partc.solve.memory.gradient_bucket_bytes: about an eighth of its share) during a
backward, where DDP holds every gradient for the whole step; it pays one reduce per bucket and
micro-batch instead of one all-reduce per step. partc.solve.memory and partc.solve.levers price
both.

Why not FSDP2 (`fully_shard`): under torch.distributed.pipelining it defers the reduce-scatter to
the last micro-batch (the gradients stay whole until then), and reduce-scattering each
micro-batch of a stage held as one module needs the whole stage's gradients and FSDP's flat copy
at once; measured in bench/zero_stages.py, it held more than ZeRO-1.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Collection, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from partc.solve.memory import gradient_buckets


class GradientSharder:
    """Reduce a stage's gradients onto the replicas that own them as they form (module
    docstring). Also the stage's `grad_sync` timer: `reset` before a step, `seconds` after."""

    def __init__(self, module: torch.nn.Module, optimizer: ZeroRedundancyOptimizer,
                 order: Sequence[str], kept_whole: Collection[str], group: Any,
                 device: torch.device) -> None:
        params = dict(module.named_parameters())
        self.group = group
        self.device = device
        self.replicas = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        # the replica ZeroRedundancyOptimizer lets step each parameter
        partition = optimizer._partition_parameters()  # type: ignore[attr-defined]
        owner = {id(p): r for r, groups in enumerate(partition) for g in groups
                 for p in g["params"]}
        sharded = [n for n in order if n not in kept_whole]
        sizes = [params[n].numel() * params[n].element_size() for n in sharded]
        owners = [owner[id(params[n])] for n in sharded]
        buckets = gradient_buckets(sizes, owners, self.replicas)
        self.buckets = [[params[sharded[i]] for i in bucket] for bucket in buckets]
        self.owner_of = [owners[bucket[0]] for bucket in buckets]
        self.destination = [dist.get_global_rank(group, r) for r in range(self.replicas)]
        self.waiting = [len(b) for b in self.buckets]
        self.owned = [params[n] for n, r in zip(sharded, owners, strict=True) if r == self.me]
        self.whole = [params[n] for n in order if n in kept_whole]
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(self._ready, b))
                        for b, bucket in enumerate(self.buckets) for p in bucket]
        self.reset()

    def reset(self) -> None:
        self.spent = 0.0
        self.events: list[tuple[Any, Any]] = []

    def seconds(self) -> float:
        """This step's time in reduces and the final all-reduce (call after `finish`). On CUDA
        from events read once here: synchronising around every bucket would serialise the
        backward with its reduces."""
        if self.events:
            torch.cuda.synchronize(self.device)
            return sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        return self.spent

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """A span of reduce time: CUDA events on a GPU (read in `seconds`), the host clock on a
        CPU."""
        if self.device.type == "cuda":
            marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            marks[0].record()
            yield
            marks[1].record()
            self.events.append(marks)
        else:
            start = time.perf_counter()
            yield
            self.spent += time.perf_counter() - start

    def _ready(self, bucket: int, _param: torch.Tensor) -> None:
        self.waiting[bucket] -= 1
        if self.waiting[bucket] == 0:
            self.waiting[bucket] = len(self.buckets[bucket])
            with self._timed():
                self._reduce(bucket)

    def _reduce(self, bucket: int) -> None:
        members = self.buckets[bucket]
        owner = self.owner_of[bucket]
        grads: list[torch.Tensor] = []
        for p in members:
            assert p.grad is not None  # its hook ran in this backward
            grads.append(p.grad)
        if len(grads) == 1 and grads[0].is_contiguous():
            flat = grads[0]  # reduced in place
        else:
            flat = torch.cat([g.reshape(-1) for g in grads])
        dist.reduce(flat, dst=self.destination[owner], group=self.group)
        if owner == self.me:
            if flat is not grads[0]:
                at = 0
                for g in grads:
                    g.copy_(flat[at:at + g.numel()].view_as(g))
                    at += g.numel()
                _release(flat)
        else:
            for p in members:
                p.grad = None
            for g in grads:
                _release(g)
            if flat is not grads[0]:
                _release(flat)
        del flat, grads

    def finish(self) -> None:
        """After the step's last backward: the owned gradients become the mean over replicas
        (DDP's), the kept-whole ones are all-reduced to it."""
        with self._timed():
            for p in self.owned:
                if p.grad is not None:
                    p.grad.div_(self.replicas)
            for p in self.whole:
                if p.grad is None:  # formed on no micro-batch here, but on the other replicas
                    p.grad = torch.zeros_like(p)
                p.grad.div_(self.replicas)
                dist.all_reduce(p.grad, group=self.group)


def _release(tensor: torch.Tensor) -> None:
    """Free a tensor's memory now, on this thread, where it alone spans its storage (a gradient
    autograd handed over, a bucket's flat copy): the collective's work object may hold the last
    reference and drop it on the process group's thread, a free that torch's CPU profiler
    (launch's memory measurement) never sees, so the memory counted as held to the step's end.
    A tensor sharing its storage with others is left to its references."""
    storage = tensor.untyped_storage()
    if tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.element_size():
        storage.resize_(0)
