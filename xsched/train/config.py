"""What one `xsched train` run is: `TrainConfig`, its choices, and the one-line error for each value that cannot
work, raised before anything is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from xsched.budgets import parse_budget
from xsched.errors import XschedError
from xsched.lanes import ISSUE_MODES

OPTIMIZERS = ("adamw", "sgd")
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("constant", "cosine", "linear")
SPLIT_BY = ("order", "time")  # --optimizer-split-by (xsched.train.placement, xsched.train.split_time)
DEFAULT_CHECKPOINT_EVERY = 100
DEFAULT_EVAL_EVERY = 100
DEFAULT_EVAL_BATCHES = 8


@dataclass(frozen=True)
class TrainConfig:
    """One training run. `batch` is per process and per micro-batch (`grad_accum` of them per optimizer step);
    `steps` is the total to reach (a resumed run trains the rest). A bare `cuda` in `budgets` or `devices` is this
    process's GPU (cuda:LOCAL_RANK under torchrun), also in `param_home` and `stores`. `weight_decay` None is the optimizer's usual value (AdamW 0.01,
    SGD 0); it applies to the parameters of two or more dimensions (weights, embeddings), not to biases and norms."""

    model: str
    budgets: Mapping[str, str]
    steps: int = 100
    lr: float = 1e-3
    optimizer: str = "adamw"
    batch: int | None = None
    scale: str = "default"
    devices: tuple[str, ...] | None = None
    method: str = "auto"
    time_limit: float | None = None
    gap: float | None = None  # the solver stops once its plan is within this relative gap of the lower bound
    profile: str = "measure"
    cache_dir: str = "profiles"
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # default DEFAULT_CHECKPOINT_EVERY when checkpoint_dir is given
    resume: bool = False
    seed: int = 0
    precision: str = "fp32"
    grad_accum: int = 1
    clip_grad: float | None = None
    weight_decay: float | None = None
    lr_schedule: str = "constant"
    warmup: int = 0
    min_lr: float = 0.0
    data: str | None = None  # a token file (uint16 .bin or .npy) for language models
    val_data: str | None = None
    eval_every: int | None = None  # default DEFAULT_EVAL_EVERY when val_data is given
    eval_batches: int | None = None  # default DEFAULT_EVAL_BATCHES
    hf_config: str | None = None  # hf: models: "key=value,..." over the model type's default config
    pretrained: str | None = None  # hf: models: a save_pretrained folder
    seq_len: int | None = None  # hf: models: the sequence length (default: the model's context length)
    lora: str | None = None  # hf: models: LoRA adapters, "r=8,alpha=16,targets=q_proj,v_proj" or a saved folder
    log_csv: str | None = None
    param_home: str | None = None  # where the parameters, gradients and optimizer state live (default: first device)
    stores: tuple[str, ...] = ()  # devices that hold values and run no op (only their copies are profiled)
    compile: bool = False  # run one-device runs of steps as compiled regions (xsched.execute.segments)
    expandable_segments: bool = False  # CUDA's expandable segments on before the plan's first allocation (Executor)
    planned_addresses: bool = False  # the step's values in one arena per device (Executor; xsched.execute.arena)
    delayed_update: bool = False  # --param-home's AdamW one step late (ZeRO-Offload's DPU; see train.host_adamw)
    # Twin-Flow: this share of the compute budget holds optimizer-placed params; "auto": the planner chooses it
    optimizer_split: float | str | None = None
    optimizer_split_by: str = "order"  # which params move: "order" (released last), "time" (least predicted step)
    adamw_rates: tuple[float, float] | None = None  # the split's AdamW params/s on the home, the device (else measured)
    trace: str | None = None  # a Chrome trace of the last step's lanes and optimizer buckets, written here
    chunk_loss: int | None = None  # the cross-entropy in this many row blocks (xsched.capture.chunk_loss)
    host_threads: int | str | None = None  # the host optimizer's torch threads ("all": torch's; None: train.host_share)
    host_nice: int | None = None  # added to its worker's nice value (None: the default of train.host_share)
    issue: str = "lanes"  # who issues a GPU plan's overlapped steps: a thread per lane, or "one" (execute.executor)

    def check(self) -> None:
        """A one-line XschedError for each value that cannot work, before anything is loaded."""
        if not self.budgets:
            _fail("give at least one budget: --budget DEVICE=SIZE, e.g. cpu=8GiB or cuda=80%")
        for device, size in self.budgets.items():
            parse_budget(size, eager_peak=1, device=device)  # the syntax only; "%" is resolved when planning
        for flag, value in (("--steps", self.steps), ("--grad-accum", self.grad_accum)):
            if value < 1:
                _fail(f"{flag} must be at least 1, got {value}")
        if not self.lr > 0:
            _fail(f"--lr must be positive, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            _fail(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            _fail(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.lr_schedule not in SCHEDULES:
            _fail(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        if self.batch is not None and self.batch < 1:
            _fail(f"--batch must be at least 1, got {self.batch}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            _fail(f"--clip-grad must be positive, got {self.clip_grad}")
        if self.weight_decay is not None and not self.weight_decay >= 0:
            _fail(f"--weight-decay must be at least 0, got {self.weight_decay}")
        if self.warmup < 0:
            _fail(f"--warmup must be at least 0, got {self.warmup}")
        if self.gap is not None and not 0 <= self.gap < 1:
            _fail(f"--gap must be a relative gap in [0, 1), got {self.gap}")
        if self.chunk_loss is not None and self.chunk_loss < 1:
            _fail(f"--chunk-loss must be at least 1, got {self.chunk_loss}")
        if not 0 <= self.min_lr <= self.lr:
            _fail(f"--min-lr must be between 0 and --lr ({self.lr}), got {self.min_lr}")
        self._check_files_and_evals()
        self._check_homes()
        self._check_delayed()
        self._check_host_share()
        if self.issue not in ISSUE_MODES:
            _fail(f"--issue must be {' or '.join(ISSUE_MODES)}, got {self.issue!r}")

    def _check_host_share(self) -> None:
        for flag, value in (("--host-threads", self.host_threads), ("--host-nice", self.host_nice)):
            if value is not None and self.param_home is None:
                _fail(f"{flag} needs --param-home (it sizes the host optimizer there)")
        threads = self.host_threads
        if threads is not None and threads != "all" and not (isinstance(threads, int) and threads >= 1):
            _fail(f"--host-threads must be a thread count of at least 1 or all, got {threads!r}")
        if self.host_nice is not None and not (isinstance(self.host_nice, int) and 0 <= self.host_nice <= 19):
            _fail(
                f"--host-nice must be an increment from 0 to 19 (a higher priority needs privileges), got {self.host_nice!r}"
            )

    def _check_delayed(self) -> None:
        if self.optimizer_split is not None:
            self._check_split()
        if self.adamw_rates is not None and not (len(self.adamw_rates) == 2 and min(self.adamw_rates) > 0):
            _fail(
                f"adamw_rates must be two positive rates (parameters/s on the home, the device), got {self.adamw_rates}"
            )
        if self.optimizer_split_by not in SPLIT_BY:
            _fail(f"--optimizer-split-by must be one of {', '.join(SPLIT_BY)}, got {self.optimizer_split_by!r}")
        if not self.delayed_update:
            return
        if self.optimizer != "adamw":
            _fail(f"--delayed-update applies to the host AdamW (--optimizer adamw), not --optimizer {self.optimizer}")
        if self.param_home is None:
            _fail("--delayed-update needs --param-home (the host optimizer it delays)")
        if self.clip_grad is not None:
            _fail(
                "--delayed-update cannot clip (--clip-grad): the host AdamW steps each bucket before the norm is known"
            )
        if self.precision == "fp16":
            _fail("--delayed-update cannot skip overflowed steps (--precision fp16): use bf16 or fp32")

    def _check_split(self) -> None:
        share = self.optimizer_split
        if self.param_home is None:
            _fail(f"--optimizer-split {share} needs --param-home (it moves some parameters' optimizer off that home)")
        if share != "auto" and not (isinstance(share, float | int) and 0 < share < 1):
            _fail(f"--optimizer-split must be a share of the compute budget in (0, 1) or auto, got {share}")
        computing = [d for d in self.devices or self.budgets if d not in self.stores and d != self.param_home]
        if not computing:
            _fail(
                f"--optimizer-split {share}: no parameter can move, no device computes but --param-home "
                f"{self.param_home}"
            )

    def _check_homes(self) -> None:
        devices = list(self.devices or self.budgets)
        for flag, device in [("--param-home", self.param_home), *(("--store", d) for d in self.stores)]:
            if device is not None and device not in devices:
                _fail(
                    f"{flag} {device} is not among the devices {devices}: give it a --budget (or name it in --devices)"
                )
        if self.stores and all(d in self.stores for d in devices):
            _fail(f"every device is a store ({', '.join(self.stores)}): at least one must compute")

    def _check_files_and_evals(self) -> None:
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            _fail("--checkpoint-every needs --checkpoint-dir")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            _fail(f"--checkpoint-every must be at least 1, got {self.checkpoint_every}")
        if self.resume and self.checkpoint_dir is None:
            _fail("--resume needs --checkpoint-dir (the folder of a run's step-*.pt files)")
        if self.eval_every is not None and self.val_data is None:
            _fail("--eval-every needs --val-data (a token file)")
        if self.eval_every is not None and self.eval_every < 1:
            _fail(f"--eval-every must be at least 1, got {self.eval_every}")
        if self.eval_batches is not None and self.eval_batches < 1:
            _fail(f"--eval-batches must be at least 1, got {self.eval_batches}")
        hf = self.model.startswith("hf:")
        for flag, value in (
            ("--config", self.hf_config),
            ("--pretrained", self.pretrained),
            ("--seq-len", self.seq_len),
            ("--lora", self.lora),
        ):
            if value is not None and not hf:
                _fail(f"{flag} applies to hf:NAME models only (zoo models take sizes in --scale, e.g. small:seq=32)")
        if self.seq_len is not None and self.seq_len < 1:
            _fail(f"--seq-len must be at least 1, got {self.seq_len}")
        if hf and self.scale != "default":  # else the full-size model is built, as if --scale were not given
            _fail(f"--scale applies to zoo models only; {self.model} takes its size from --config (e.g. n_layer=2)")


def _fail(message: str) -> NoReturn:
    raise XschedError(message, stage="train")
