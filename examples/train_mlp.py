"""A training factory for `xsched train`: an MLP regressor on a synthetic, seeded data stream.

    xsched train examples/train_mlp.py:factory --budget cpu=70% --steps 50
    torchrun --nproc-per-node 2 -m xsched.cli train examples/train_mlp.py:factory --budget cpu=70% --steps 50

The factory takes `batch` (per process) and returns (model, example_batch, loss_fn, batches):
- example_batch is (inputs, targets): xsched captures and plans the model for `model(*inputs)` at these shapes;
- loss_fn(outputs, targets) -> a scalar tensor;
- batches(step, rank, world) -> the (inputs, targets) rank `rank` of `world` trains on at step `step`. Here it is
  rank's slice of one global batch drawn from a generator seeded by the step, so two processes of batch b see
  exactly what one process of batch 2b sees, and a resumed run sees what an uninterrupted one would.
"""

import torch
from torch import nn

FEATURES, HIDDEN, OUTPUTS = 64, 256, 8


def factory(batch: int = 256):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUTPUTS)
    )
    teacher = torch.randn(FEATURES, OUTPUTS, generator=torch.Generator().manual_seed(1))

    def batches(step: int, rank: int, world: int):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(world * batch, FEATURES, generator=gen)
        y = torch.tanh(x @ teacher)
        rows = slice(rank * batch, (rank + 1) * batch)
        return x[rows].clone(), y[rows].clone()

    return model, batches(0, 0, 1), nn.functional.mse_loss, batches
