"""LoRA adapters on a Hugging Face model for `xsched train hf:TYPE --lora ...`: new adapters from `r=8,alpha=16,
targets=q_proj,v_proj` or trained ones from a folder peft's save_pretrained wrote, the base weights frozen (no
gradients, so the captured graph makes none and the optimizer keeps no state for them). Needs peft: pip install
'xsched[lora]'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from xsched.errors import XschedError

ADAPTER_DIR = "adapter"  # under --checkpoint-dir: the adapters as PeftModel.from_pretrained loads them
_KEYS = {"r": int, "alpha": float, "dropout": float, "targets": list}


def _fail(message: str) -> XschedError:
    return XschedError(message, stage="load")


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise _fail("--lora needs peft: pip install 'xsched[lora]' (or pip install peft)") from e
    return peft


def parse_lora(text: str) -> dict[str, Any]:
    """`r=8,alpha=16,dropout=0.05,targets=q_proj,v_proj` -> {"r": 8, "alpha": 16.0, "dropout": 0.05, "targets":
    ["q_proj", "v_proj"]}: a bare name after `targets=` is one more target."""
    out: dict[str, Any] = {}
    key = None
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            if key != "targets":
                raise _fail(
                    f"--lora wants KEY=VALUE pairs (r, alpha, dropout, targets) or an adapter folder, got {part!r}"
                )
            out["targets"].append(part)
            continue
        key = name.strip()
        if key not in _KEYS:
            raise _fail(f"--lora has no key {key!r}; its keys: {', '.join(_KEYS)}")
        try:
            out[key] = [value.strip()] if key == "targets" else _KEYS[key](value)
        except ValueError as e:
            raise _fail(f"--lora {key}={value!r} is not a number") from e
    if not out.get("targets"):
        raise _fail("--lora needs targets=NAME[,NAME...], the linear layers to adapt, e.g. targets=q_proj,v_proj")
    return out


def _linear_names(model: nn.Module) -> list[str]:
    """The last name of each module peft can adapt (linear layers, GPT-2's Conv1D, embeddings)."""
    kinds = ("Linear", "Conv1D", "Embedding")
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ in kinds and n})


def add_lora(model: nn.Module, spec: str, label: str) -> nn.Module:
    """`model` with LoRA adapters from `spec` (key=value pairs, or a folder of saved adapters, trained further),
    its own weights frozen. `label` names the model in errors (e.g. hf:gpt2)."""
    peft = _peft()
    folder = Path(spec)
    if folder.is_dir():
        return _load(peft, model, folder, label)
    values = parse_lora(spec)
    have = _linear_names(model)
    missing = [t for t in values["targets"] if t not in have]
    if missing:
        raise _fail(f"--lora targets {', '.join(missing)}: {label} has no such module; it has {', '.join(have)}")
    config = peft.LoraConfig(
        r=values.get("r", 8),
        lora_alpha=values.get("alpha", 2 * values.get("r", 8)),
        lora_dropout=values.get("dropout", 0.0),
        target_modules=values["targets"],
    )
    return peft.get_peft_model(model, config)


def _load(peft: Any, model: nn.Module, folder: Path, label: str) -> nn.Module:
    if not (folder / "adapter_config.json").is_file():
        raise _fail(f"--lora {folder} has no adapter_config.json (a folder that peft's save_pretrained wrote)")
    try:
        return peft.PeftModel.from_pretrained(model, folder, is_trainable=True, local_files_only=True)
    except Exception as e:  # a corrupt config or weights file, or adapters for another model
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise _fail(f"--lora {folder}: cannot load its adapters onto {label}: {type(e).__name__}: {first}") from e


def peft_model(model: nn.Module) -> nn.Module | None:
    """The peft model inside `model` (e.g. under CausalLMLoss), if any."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, PeftModel)), None)


def save_adapters(model: nn.Module, directory: str | Path) -> Path | None:
    """The adapters of the peft model inside `model`, saved under `directory`/adapter as PeftModel.from_pretrained
    loads them; None when `model` has none."""
    found = peft_model(model)
    if found is None:
        return None
    out = Path(directory) / ADAPTER_DIR
    found.save_pretrained(out)
    return out
