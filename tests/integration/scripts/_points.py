"""The noisy point-classification dataset the test scripts train on (imported from the
scripts' own folder, which Python puts first on the path of a script it runs)."""

from __future__ import annotations

import torch


class Points(torch.utils.data.Dataset):
    """``n`` points of ``dim`` features (fixed by ``seed``) labelled by the largest of their
    first three, plus fresh noise on every read (per-sample RNG); ``with_index`` also
    returns the sample id."""

    def __init__(self, n: int, dim: int, seed: int, with_index: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x[:, :3].argmax(1)
        self.with_index = with_index

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i] + 0.05 * torch.randn(self.x.shape[1])
        return (x, self.y[i], i) if self.with_index else (x, self.y[i])
