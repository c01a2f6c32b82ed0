"""An nn.Embedding with sparse=True: its weight would get a sparse gradient (with
PARTC_TEST_FROZEN_EMBEDDING=1 the embedding is frozen, and gets none)."""
import os

import torch
import torch.nn as nn


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16, sparse=True)
        self.head = nn.Linear(16, 4)
        if os.environ.get("PARTC_TEST_FROZEN_EMBEDDING") == "1":
            self.embed.weight.requires_grad_(False)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


def build_model():
    return Bag()


def example_inputs(batch_size: int):
    return (torch.randint(0, 100, (batch_size, 5)),)
