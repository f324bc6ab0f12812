"""`transformers.Trainer` with one change (XschedTrainer and a budget) trains like the plain Trainer: the same
losses each step and the same parameters after 3 steps."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import batches, build
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def run(trainer_cls: type, model: torch.nn.Module, tmp_path, **extra) -> tuple[list[float], torch.nn.Module]:
    batch = batches("llama")
    rows = [{"input_ids": ids, "labels": labels} for s in range(3) for ids, labels in zip(*batch(s))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=rows, **extra)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def test_xsched_trainer_trains_like_the_plain_trainer(tmp_path) -> None:
    from xsched.train.hf_trainer import XschedTrainer

    torch.manual_seed(0)
    model = build("llama", "sdpa").model  # the Hugging Face model itself, as Trainer users hand it over
    ref = copy.deepcopy(model)
    budgets = {"cpu": "70%"}
    got, trainer = run(XschedTrainer, model, tmp_path / "x", budgets=budgets, method="checkpoint", profile="model")
    want, _ = run(transformers.Trainer, ref, tmp_path / "plain")
    assert len(got) == len(want) == 3
    assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), rtol=1e-4, atol=1e-5)
    (wrapped,) = trainer.planned.wrapped.values()  # one batch signature, one plan, within its budget
    assert wrapped.plan.solver.found_by == "checkpoint"
