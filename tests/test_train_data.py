"""`xsched train --data/--val-data`: token files (nanoGPT's uint16 .bin, .npy) as batches that are windows of the
file and a pure function of (step, rank); training, validation (eval mode, by its own plan) and the --json and
--log-csv lines against plain PyTorch; the Llama-style example on a token file; and each bad input as one line,
exit status 2, with the checkpoints left as they were."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close
from train_support import ROOT, assert_same_weights, child_env, eager_train

from xsched import zoo
from xsched.cli import main
from xsched.train import TrainConfig, train
from xsched.train.checkpoint import read_checkpoint
from xsched.train.data import open_tokens, token_batches

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = (ROOT / "README.md").read_bytes()  # byte tokens: a vocabulary of 256
GPT = "tiny:vocab=256"  # zoo gpt2 tiny (dropout 0.1) over bytes: batch 2 of 16 tokens


def write_bin(path: Path, ids: np.ndarray | bytes) -> Path:
    np.asarray(np.frombuffer(ids, np.uint8) if isinstance(ids, bytes) else ids, np.uint16).tofile(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tokens")
    cut = len(TEXT) * 9 // 10
    np.save(d / "val.npy", np.frombuffer(TEXT[cut:], np.uint8).astype(np.int32))
    return {"train": write_bin(d / "train.bin", TEXT[:cut]), "val": d / "val.npy", "dir": d}


def test_batches_are_windows_of_the_file_and_pure_in_step_and_rank(files) -> None:
    tokens = open_tokens(files["train"], vocab=256, seq=16)
    assert isinstance(tokens, np.memmap) and len(tokens) == len(TEXT) * 9 // 10
    text = np.frombuffer(TEXT, np.uint8)
    two = token_batches(tokens, "targets", batch=2, seq=16, seed=0, stream="train")
    four = token_batches(tokens, "targets", batch=4, seq=16, seed=0, stream="train")
    (x,), y = four(5)
    assert x.dtype == torch.int64 and x.shape == y.shape == (4, 16)
    for row, target in zip(x.numpy(), y.numpy()):
        starts = [i for i in range(len(tokens) - 16) if (text[i : i + 16] == row).all()]
        assert any((text[i + 1 : i + 17] == target).all() for i in starts)  # a window and its next tokens
    halves = [two(5, rank, 2) for rank in (0, 1)]
    assert torch.equal(torch.cat([h[0][0] for h in halves]), x) and torch.equal(torch.cat([h[1] for h in halves]), y)
    assert torch.equal(four(5)[0][0], x) and not torch.equal(four(6)[0][0], x)
    (idx, targets), none = token_batches(tokens, "model_loss", 4, 16, 0, "train")(5)
    assert none is None and torch.equal(idx, x) and torch.equal(targets, y)


def test_trains_and_validates_on_token_files_like_eager(files, tmp_path, capfd) -> None:
    """GPT-2 (tiny, dropout on) trains on the .bin and evaluates on the .npy every 2 steps: training losses,
    validation losses (eval mode: no dropout) and weights as plain PyTorch's on the same windows; the JSON step
    lines carry lr, grad norm, tokens/s and peaks, and the CSV log holds the same rows."""
    log = tmp_path / "log.csv"
    args = ["train", "zoo:gpt2", "--scale", GPT, "--budget", "cpu=100%", "--profile", "model", "--method", "sqrt"]
    args += ["--data", str(files["train"]), "--val-data", str(files["val"]), "--eval-every", "2", "--eval-batches"]
    args += ["2", "--steps", "4", "--cache-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ck"), "--json"]
    assert main([*args, "--log-csv", str(log)]) == 0
    lines = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
    steps = [e for e in lines if e["event"] == "step"]

    z = zoo.build("gpt2", scale=GPT)
    train_windows = token_batches(open_tokens(files["train"], 256, 16), "model_loss", 2, 16, 0, "train")
    val_windows = token_batches(open_tokens(files["val"], 256, 16), "model_loss", 2, 16, 0, "val")
    vals = {}

    def validate(step: int) -> None:
        if step % 2:
            z.model.eval()
            with torch.no_grad():
                vals[step] = torch.stack([z.model(*val_windows(i)[0])[1] for i in range(2)]).mean().item()
            z.model.train()

    want = eager_train(z.model, train_windows, lambda out, _: out[1], 4, after_step=validate)
    assert_close([e["loss"] for e in steps], want["loss"], rtol=1e-5, atol=1e-6)
    assert [e["val_loss"] for e in steps][::2] == [None, None]
    assert_close([steps[1]["val_loss"], steps[3]["val_loss"]], [vals[1], vals[3]], rtol=1e-5, atol=1e-6)
    assert lines[-1]["final_val_loss"] == steps[3]["val_loss"]
    assert_same_weights(read_checkpoint(tmp_path / "ck", 4)["model"], z.model, rtol=1e-5, atol=1e-6)
    for e in steps:
        assert e["lr"] == 1e-3 and e["grad_norm"] > 0 and e["tokens_per_s"] > 0 and e["peak_bytes"]["cpu"] > 0

    with open(log, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    for row, e in zip(rows, steps):
        assert float(row["loss"]) == e["loss"] and float(row["grad_norm"]) == e["grad_norm"]
        assert int(row["peak_bytes:cpu"]) == e["peak_bytes"]["cpu"] and row["val_loss"] == str(e["val_loss"] or "")


SMALL_LLAMA = f"""
import sys
sys.path.insert(0, {str(ROOT / "examples")!r})
from train_llama import factory as llama

def factory(batch=2):
    return llama(batch, seq=16, vocab=256, dim=32, layers=2)
"""


def test_the_llama_example_trains_on_a_token_file_like_eager(files, tmp_path) -> None:
    """The Llama-style example (examples/train_llama.py, a ((idx,), targets) batch and its own loss function) at
    a small size in bf16, on the .bin file: its losses and weights are plain PyTorch's."""
    (tmp_path / "small.py").write_text(SMALL_LLAMA)
    config = TrainConfig(
        f"{tmp_path}/small.py:factory",
        {"cpu": "100%"},
        steps=3,
        precision="bf16",
        data=str(files["train"]),
        method="sqrt",
        profile="model",
        cache_dir=str(tmp_path),
        checkpoint_dir=str(tmp_path / "ck"),
    )
    result = train(config)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_llama import factory, next_token_loss
    finally:
        sys.path.remove(str(ROOT / "examples"))
    torch.manual_seed(0)
    model = factory(2, seq=16, vocab=256, dim=32, layers=2)[0]
    windows = token_batches(open_tokens(files["train"], 256, 16), "targets", 2, 16, 0, "train")
    want = eager_train(model, windows, next_token_loss, 3, precision="bf16")
    assert result.losses == want["loss"]
    assert_same_weights(read_checkpoint(tmp_path / "ck", 3)["model"], want["model"], rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def saved_run(files, tmp_path_factory) -> tuple[Path, list[str]]:
    """A checkpointed run on the token files, to resume with bad input: it must survive untouched."""
    d = tmp_path_factory.mktemp("run")
    args = ["zoo:gpt2", "--scale", GPT, "--budget", "cpu=100%", "--profile", "model", "--method", "sqrt", "--steps"]
    args += ["1", "--data", str(files["train"]), "--cache-dir", str(d), "--checkpoint-dir", str(d / "ck")]
    assert main(["train", *args]) == 0
    return d / "ck", args


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def bad_inputs(d: Path) -> dict[str, tuple[list[str], str]]:
    """Case -> (arguments replacing or added to the saved run's, the error's words)."""
    (d / "odd.bin").write_bytes(b"\x01\x02\x03")
    (d / "garbage.npy").write_bytes(b"\x93NUMPY not really")
    np.save(d / "floats.npy", np.zeros(100, np.float32))
    write_bin(d / "short.bin", np.arange(10))
    beyond = np.frombuffer(TEXT[:4000], np.uint8).astype(np.uint16)
    beyond[1234] = 300
    write_bin(d / "beyond.bin", beyond)
    return {
        "missing": (["--data", str(d / "nope.bin")], "nope.bin does not exist"),
        "odd-bin": (["--data", str(d / "odd.bin")], "is not uint16 tokens: 3 bytes"),
        "garbage-npy": (["--data", str(d / "garbage.npy")], "is not a readable .npy array"),
        "float-npy": (["--data", str(d / "floats.npy")], "1-D float32 array; want 1-D integer token ids"),
        "short": (["--data", str(d / "short.bin")], "has 10 tokens, fewer than one window of seq + 1 = 17"),
        "text-file": (["--data", str(ROOT / "README.md")], "must be a uint16 .bin (nanoGPT's layout) or a 1-D"),
        "beyond-vocab": (["--data", str(d / "beyond.bin")], "token id 300 at position 1234 is outside the vocab"),
        "val-beyond-vocab": (["--val-data", str(d / "beyond.bin")], "token id 300 at position 1234"),
        "grad-accum-0": (["--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
        "eval-no-val": (["--eval-every", "5"], "--eval-every needs --val-data"),
        "not-a-lm": (["zoo:mlp_mixer", "--scale", "tiny"], "--data fills a batch ((idx, targets), None)"),
        "other-precision": (["--precision", "bf16"], "the checkpoint's run has precision='fp32', this run 'bf16'"),
        "config-on-zoo": (["--config", "n_layer=2"], "--config applies to hf:NAME models only"),
        "hf-name": (["hf:gpt3"], "unknown Hugging Face causal language model type 'gpt3'; did you mean gptj, gpt2"),
        "hf-key": (["hf:gpt2", "--config", "n_layer=1,n_lyer=2"], "unknown config key 'n_lyer' for hf:gpt2"),
        "hf-pretrained": (["hf:gpt2", "--pretrained", str(d)], "has no config.json"),
        "hf-scale": (["hf:gpt2", "--scale", "tiny"], "--scale applies to zoo models only; hf:gpt2 takes its size"),
    }


CASES = [
    "missing",
    "odd-bin",
    "garbage-npy",
    "float-npy",
    "short",
    "text-file",
    "beyond-vocab",
    "val-beyond-vocab",
    "grad-accum-0",
    "eval-no-val",
    "not-a-lm",
    "other-precision",
    "config-on-zoo",
    "hf-name",
    "hf-key",
    "hf-pretrained",
    "hf-scale",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_loses_no_checkpoint(case, saved_run, tmp_path, capsys) -> None:
    if case.startswith("hf-"):
        pytest.importorskip("transformers")
    ck, args = saved_run
    extra, message = bad_inputs(tmp_path)[case]
    argv = list(args)
    if extra[0].startswith(("zoo:", "hf:")):
        argv[0], extra = extra[0], extra[1:]
    if argv[0].startswith("hf:"):  # sized by --config, not the zoo's --scale
        del argv[argv.index("--scale") : argv.index("--scale") + 2]
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    before = snapshot(ck)
    assert main(["train", *argv, "--steps", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("xsched: error:")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and err.rstrip().endswith(errors[0])
    assert snapshot(ck) == before


def test_the_real_data_script_runs_a_few_steps(tmp_path, monkeypatch, capsys) -> None:
    """scripts/train_real_data.py (smoke): token files from the installed licence texts, a few steps on them."""
    spec = importlib.util.spec_from_file_location("train_real_data", ROOT / "scripts" / "train_real_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for key, value in child_env().items():
        monkeypatch.setenv(key, value)
    vals = script.main(["--out", str(tmp_path), "--steps", "2", "--", "--profile", "model", "--method", "sqrt"])
    assert set(vals) == {1, 2} and all(0 < v < 10 for v in vals.values())
    train_ids = np.fromfile(tmp_path / "train.bin", np.uint16)
    assert len(train_ids) > 100_000 and train_ids.max() < 256
    assert "licence files of torch, numpy, scipy" in capsys.readouterr().out
