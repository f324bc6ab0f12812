"""Hugging Face models for `xsched train hf:TYPE`: a `transformers` causal language model built from its model
type's config class (`--config key=value,...` over the defaults; no weights, nothing downloaded), or with the weights
`save_pretrained` wrote to a local folder (`--pretrained DIR`). Needs the `hf` extra: pip install 'xsched[hf]'.

The model is trained as `CausalLMLoss(model)(idx, targets)`, which returns the next-token cross entropy, so the
logits stay inside the plan (freed or recomputed like any activation) instead of being an output held to the end."""

from __future__ import annotations

import contextlib
import difflib
import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from xsched.errors import XschedError
from xsched.loaders import TrainingTask
from xsched.zoo import tasks

DEFAULT_BATCH = 8


def _fail(message: str) -> XschedError:
    return XschedError(message, stage="load")


class CausalLMLoss(nn.Module):
    """forward(idx, targets) -> the mean cross entropy of `lm`'s logits (in fp32, as transformers' own loss) against
    the next tokens; `lm` is the Hugging Face model, its weights under `lm.`."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=idx).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class OwnLoss(nn.Module):
    """forward(input_ids, labels) -> the Hugging Face model's own loss (causal LM, masked LM or seq2seq cross
    entropy): a model that returns its loss, as `wrap` and the benchmarks train it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def own_loss(outputs: torch.Tensor, targets: Any) -> torch.Tensor:
    """The loss of a model that returns it (CausalLMLoss)."""
    return outputs


def parse_overrides(text: str | None) -> dict[str, Any]:
    """`n_layer=2,n_embd=64,activation_function=gelu` -> {key: value}; values are JSON (numbers, true, null) or
    else strings."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise _fail(f"--config wants KEY=VALUE pairs separated by commas, got {part!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[Any]:
    """transformers without its import-time and config warnings (e.g. a small test vocabulary below GPT-2's
    bos_token_id); errors still raise."""
    try:
        import transformers
    except ImportError as e:
        raise _fail("hf: models need transformers: pip install 'xsched[hf]'") from e
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield transformers
    finally:
        transformers.logging.set_verbosity(level)


def _model_type(name: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    if name not in CAUSAL:
        close = difflib.get_close_matches(name, list(CAUSAL), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else " (e.g. gpt2, llama, mistral, qwen2)"
        raise _fail(f"unknown Hugging Face causal language model type {name!r}{hint}")


def _check_keys(name: str, overrides: dict[str, Any], default: Any) -> None:
    for key in overrides:
        if not hasattr(default, key):
            keys = ", ".join(sorted(k for k in default.to_diff_dict() if k != "transformers_version"))
            raise _fail(f"unknown config key {key!r} for hf:{name} ({type(default).__name__}; its keys: {keys})")


def build(name: str, overrides: str | None = None, pretrained: str | None = None) -> nn.Module:
    """The causal LM of model type `name` (e.g. gpt2, llama): from its config with `overrides`, fresh weights drawn
    from torch's global generator, or loaded from `pretrained` (a save_pretrained folder, read locally only)."""
    values = parse_overrides(overrides)
    with _quiet_transformers() as transformers:
        _model_type(name)
        _check_keys(name, values, transformers.AutoConfig.for_model(name))
        try:
            if pretrained is None:
                config = transformers.AutoConfig.for_model(name, **values)
                config.use_cache = False  # training: no key/value cache among the outputs
                return transformers.AutoModelForCausalLM.from_config(config)
            return _pretrained(transformers, name, values, Path(pretrained))
        except XschedError:
            raise
        except Exception as e:  # an inconsistent config (e.g. n_embd not divisible by n_head) fails in the model
            first = str(e).splitlines()[0][:200] if str(e) else ""
            raise _fail(
                f"cannot build hf:{name} with --config {overrides or '(defaults)'}: {type(e).__name__}: {first}"
            ) from e


def _pretrained(transformers: Any, name: str, values: dict[str, Any], folder: Path) -> nn.Module:
    if not (folder / "config.json").is_file():
        raise _fail(f"--pretrained {folder} has no config.json (a folder that save_pretrained wrote)")
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, **values)
    if config.model_type != name:
        raise _fail(f"--pretrained {folder} holds a {config.model_type} model, not hf:{name}")
    config.use_cache = False
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, config=config, local_files_only=True, output_loading_info=True
    )
    lost = [*info.get("missing_keys", ()), *(str(k) for k in info.get("mismatched_keys", ()))]
    if lost:
        raise _fail(f"--pretrained {folder} lacks {len(lost)} of the model's weights or shapes, e.g. {lost[0]}")
    return model.float()  # fp32 master weights whatever dtype they were saved in; autocast lowers the compute


def context_length(lm: nn.Module) -> int | None:
    return getattr(lm.config, "max_position_embeddings", None)


def hf_task(
    spec: str,
    overrides: str | None = None,
    pretrained: str | None = None,
    batch: int | None = None,
    seq_len: int | None = None,
    seed: int = 0,
    lora: str | None = None,
) -> TrainingTask:
    """`hf:TYPE` as a training task: CausalLMLoss around the built model, batches of `seq_len` tokens (default the
    model's context length), and the zoo gpt2 task's synthetic sequences as data (`--data` replaces them); `lora`:
    LoRA adapters (`--lora`), the model's own weights frozen."""
    name = spec.removeprefix("hf:")
    lm = build(name, overrides, pretrained)
    if lora is not None:  # adapters over the frozen model (xsched.train.lora)
        from xsched.train.lora import add_lora

        lm = add_lora(lm, lora, spec)
    longest = context_length(lm)
    seq = seq_len if seq_len is not None else longest or 1024
    if longest is not None and seq > longest:
        raise _fail(f"--seq-len {seq} exceeds hf:{name}'s context length {longest} (max_position_embeddings)")
    rows = batch if batch is not None else DEFAULT_BATCH
    vocab = lm.get_input_embeddings().num_embeddings
    stream = partial(tasks.sequence_batch, spec, vocab, seq, rows, seed=seed)
    return TrainingTask(spec, CausalLMLoss(lm), stream(0), own_loss, stream)
