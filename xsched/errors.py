"""Error types shared by every stage; each names the stage and the op, value, device or step at fault."""

from __future__ import annotations


class XschedError(Exception):
    """Base error. `stage` says which pipeline stage raised it; the rest say where."""

    def __init__(
        self,
        message: str,
        *,
        stage: str,
        op: str | None = None,
        value: str | None = None,
        device: str | None = None,
        step: int | None = None,
    ) -> None:
        self.stage = stage
        self.op = op
        self.value = value
        self.device = device
        self.step = step
        self.detail = message
        where = [
            f"{k}={v}" for k, v in (("step", step), ("op", op), ("value", value), ("device", device)) if v is not None
        ]
        super().__init__(f"[{stage}] {message}" + (f" ({', '.join(where)})" if where else ""))


class GraphError(XschedError):
    """A graph that breaks contract 1 of docs/ARCHITECTURE.md (unknown schema, dangling ids, cycles, bad order)."""

    def __init__(self, message: str, **where: str | int | None) -> None:
        super().__init__(message, stage=str(where.pop("stage", None) or "graph"), **where)  # type: ignore[arg-type]


class PlanError(XschedError):
    """A plan that breaks contract 3 of docs/ARCHITECTURE.md or its semantics (missing input, over budget, ...)."""

    def __init__(self, message: str, **where: str | int | None) -> None:
        super().__init__(message, stage=str(where.pop("stage", None) or "simulate"), **where)  # type: ignore[arg-type]


class ProfileError(XschedError):
    """A profile that is corrupt, stale, or does not match the graph or machine."""

    def __init__(self, message: str, **where: str | int | None) -> None:
        super().__init__(message, stage=str(where.pop("stage", None) or "profile"), **where)  # type: ignore[arg-type]


class CaptureError(XschedError):
    """A model that cannot be captured (data-dependent control flow, unsupported op, ...)."""

    def __init__(self, message: str, **where: str | int | None) -> None:
        super().__init__(message, stage=str(where.pop("stage", None) or "capture"), **where)  # type: ignore[arg-type]


class BudgetError(XschedError):
    """A budget that cannot be parsed or cannot be met."""

    def __init__(self, message: str, **where: str | int | None) -> None:
        super().__init__(message, stage=str(where.pop("stage", None) or "budget"), **where)  # type: ignore[arg-type]


class NoLinkError(BudgetError):
    """Proven: no copy link or chain of links in the profile brings a value where every plan needs it (an op's
    input, an output's required home), so no plan exists at any budget (solve/bounds/reach.py)."""


class SolverError(XschedError):
    """A solver that cannot run as asked (unknown method, missing package, a model too big for its time limit)."""

    def __init__(self, message: str, **where: str | int | None) -> None:
        super().__init__(message, stage=str(where.pop("stage", None) or "solve"), **where)  # type: ignore[arg-type]


class NoIncumbent(SolverError):
    """A solver stopped (time limit) before it found any plan within the budgets: not a proof that none exists."""
