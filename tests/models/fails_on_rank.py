"""A small MLP whose loss function raises on one rank during training: the rank named by
$PARTC_TEST_FAIL_RANK (none: never), from its $PARTC_TEST_FAIL_AFTER-th call on (default 3, i.e.
after a step of two micro-batches). The other ranks then fail too, or are torn down, because
their peer is gone; `partc launch` must name the rank that failed first
(tests/test_bad_inputs_signals.py)."""
import os
from typing import Iterator

import torch
from torch import nn

IN, CLASSES = 32, 10
_calls = 0


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, CLASSES))


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, IN),)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    global _calls
    _calls += 1
    rank = os.environ.get("RANK")
    if rank is not None and rank == os.environ.get("PARTC_TEST_FAIL_RANK") and \
            _calls >= int(os.environ.get("PARTC_TEST_FAIL_AFTER", "3")):
        raise RuntimeError(f"injected failure on rank {rank} (loss call {_calls})")
    return nn.functional.cross_entropy(output, target)


def batches(batch_size: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    while True:
        yield (torch.randn(batch_size, IN, generator=gen),), \
            torch.randint(0, CLASSES, (batch_size,), generator=gen)
