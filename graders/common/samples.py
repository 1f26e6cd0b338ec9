"""The labelled points debug_training's and find_the_hang's checks train on (one class, two notebooks)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

FEATURES = 4


class Samples(Dataset):
    """n labelled points of ``classes`` classes; every row of x is distinct, so a batch tells which samples it holds."""

    def __init__(self, n: int, seed: int, classes: int = 3):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=gen)
        teacher = torch.randn(FEATURES, classes, generator=gen)
        self.y = (self.x @ teacher + 0.8 * torch.randn(n, classes, generator=gen)).argmax(dim=1)
        self.rows = {tuple(row.tolist()): i for i, row in enumerate(self.x)}

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def indices_of(self, x: torch.Tensor) -> list[int]:
        return [self.rows.get(tuple(row), -1) for row in x.detach().to("cpu", torch.float32).reshape(-1, FEATURES).tolist()]
