"""A model file for the CLI: `xsched capture examples/my_model.py:factory -o graph.json`.

A factory takes an optional `batch` and returns (model, example_inputs).
"""

import torch
from torch import nn


def factory(batch: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256),
        nn.BatchNorm1d(256),
        nn.ReLU(),
        nn.Dropout(0.1),
        *(layer for _ in range(8) for layer in (nn.Linear(256, 256), nn.ReLU())),
        nn.Linear(256, 10),
    )
    return model, (torch.randn(batch, 64),)
