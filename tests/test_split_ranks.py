"""Under torchrun every rank chooses the same optimizer split: AdamW's rates are measured on rank 0 and broadcast
(two gloo processes, each rank's own measurement made to differ)."""

from __future__ import annotations

import torch.distributed as dist
import torch.multiprocessing as mp

from xsched.train import TrainConfig, plan_wrap, split_inputs
from xsched.train import dist as xdist


def _rank(rank: int, store_path: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        measured = []

        def rate(device: str) -> float:  # each rank's own measurement differs, as two GPUs' would
            measured.append(device)
            return 1e9 * (rank + 1) + (7 if device == "cpu" else 0)

        split_inputs.adamw_rate = rate
        world = xdist.World(rank, rank, 2, "gloo")
        config = TrainConfig(model="zoo:mlp", budgets={"cpu:0": "1GiB"})
        out[rank] = (plan_wrap.adamw_rates(config, "cpu", "cpu:1", world), measured)
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_rank_zeros_rates(tmp_path) -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
        got = dict(out)
    assert got[0][0] == got[1][0] == (1e9 + 7, 1e9)
    assert got[0][1] == ["cpu", "cpu:1"] and got[1][1] == []  # rank 1 measured nothing


def test_configured_rates_are_not_measured() -> None:
    config = TrainConfig(model="zoo:mlp", budgets={"cpu:0": "1GiB"}, adamw_rates=(2e9, 3e9))
    assert plan_wrap.adamw_rates(config, "cpu", "cpu:1", xdist.World()) == (2e9, 3e9)
