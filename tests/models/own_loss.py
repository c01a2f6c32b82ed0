"""A model that computes its own loss from labels among its inputs and returns only that scalar,
as a Hugging Face model given `labels` (or CLIP with `return_loss=True`) does; no loss_fn, no
batches(): partc's defaults must train it."""
import torch
import torch.nn as nn

FEATURES, CLASSES = 16, 5


class WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                  nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.body(x), labels)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return WithLoss()


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(batch_size, FEATURES),
            "labels": torch.arange(batch_size) % CLASSES}
