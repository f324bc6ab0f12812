"""A Hugging Face Trainer run within a memory budget: the usual Trainer script with one change, `XschedTrainer` and
its `budgets` in place of `Trainer` (python examples/hf_trainer.py [STEPS] [BUDGET], e.g. 5 60%)."""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from xsched.train.hf_trainer import XschedTrainer  # was: from transformers import Trainer


def main(steps: int = 5, budget: str = "60%") -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, SDPA (transformers' default) as in real Llamas
        vocab_size=256,
        max_position_embeddings=128,
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, config.vocab_size, (64, 128))  # stands in for a tokenized dataset
    data = [{"input_ids": row, "labels": row} for row in tokens]
    args = TrainingArguments(
        output_dir="hf_trainer_out",
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the one change: XschedTrainer instead of Trainer, with a budget per device ("%" of the eager peak)
    trainer = XschedTrainer(
        model=model, args=args, train_dataset=data, budgets={device: budget}, profile="model", time_limit=10
    )
    trainer.train()
    for wrapped in trainer.planned.wrapped.values():
        print(wrapped.report())
    print("losses", [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, sys.argv[2] if len(sys.argv) > 2 else "60%")
