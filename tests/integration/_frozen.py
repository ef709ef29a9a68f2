"""A model with a frozen base under a small trainable head (an incremental save's case: the
base goes to a stable file that later generations link or copy), its training step, and the
state a restore must give back, for the tests that save it."""

from __future__ import annotations

import torch


class FrozenBase(torch.nn.Module):
    """A frozen ``width`` x ``width`` base (4 MB at 1000) under a head of ``width`` x 4."""

    def __init__(self, width: int = 1000) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.width = width
        self.base = torch.nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.base(x)))


def fresh(width: int = 1000) -> tuple[FrozenBase, torch.optim.Optimizer]:
    """The model and an AdamW over its head."""
    model = FrozenBase(width)
    return model, torch.optim.AdamW(model.head.parameters(), lr=1e-2)


def train_step(model: FrozenBase, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(8, model.width)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and the optimizer, copied."""
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items()})
    return out
