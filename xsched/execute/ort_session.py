"""`xsched.onnx.session(...)`: an ONNX model placed across ONNX Runtime providers by measured cost under memory
budgets, run with ONNX Runtime's `run(output_names, input_feed)`; one plan per set of input shapes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xsched.capture.onnx import capture_onnx, load_model
from xsched.contracts.graph import Graph
from xsched.contracts.onnx_ops import np_dtype, require
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.execute.ort_executor import OrtExecutor
from xsched.pipeline import plan_report, solve_plan

PROVIDER_DEVICES = {"CPUExecutionProvider": "ort:cpu", "CUDAExecutionProvider": "ort:cuda"}


@dataclass(frozen=True)
class Placed:
    """One input signature's graph, plan and executor."""

    graph: Graph
    plan: Plan
    executor: OrtExecutor


class PlacedSession:
    """An ONNX model run by xsched plans on ONNX Runtime, used like an InferenceSession: `run(output_names, feed)`.

    budgets: per device, e.g. {"ort:cuda:0": "4GiB", "ort:cpu": "16GiB"} or "50%" of the eager peak (default
    "100%" on every device). providers: ONNX Runtime's names ("CUDAExecutionProvider", or (name, {"device_id": 1}))
    or xsched's ("ort:cuda:0", "ort:cpu"); graph inputs and weights live on the first. shapes: input name -> dims
    for symbolic dimensions; without them the first run's inputs decide (each new set of shapes is planned anew).
    method, time_limit, profile ("measure": measured once per graph and cached under profile_dir, default
    profiles/; "model"; or a Profile): as for `xsched.wrap`. optimization: ONNX Runtime's graph optimisation level
    inside each session ("all", "extended", "basic", "disabled").
    """

    def __init__(
        self,
        model: str | Path | Any,
        budgets: Mapping[str, str | int] | None = None,
        providers: Sequence[Any] | None = None,
        *,
        shapes: Mapping[str, Sequence[int]] | None = None,
        method: str = "auto",
        time_limit: float | None = None,
        profile: Profile | str = "measure",
        profile_dir: str | None = None,
        optimization: str = "all",
    ) -> None:
        self.model, _ = load_model(model)
        self.devices = device_names(providers)
        self.budgets = dict(budgets) if budgets else {d: "100%" for d in self.devices}
        unknown = sorted(set(self.budgets) - set(self.devices))
        if unknown:
            raise XschedError(
                f"budget for {', '.join(unknown)}, which is not among the providers' devices {', '.join(self.devices)}",
                stage="execute",
                device=unknown[0],
            )
        self.method, self.time_limit, self.profile = method, time_limit, profile
        self.profile_dir, self.optimization = profile_dir, optimization
        params = {t.name for t in self.model.graph.initializer}
        self.input_names = [i.name for i in self.model.graph.input if i.name not in params]
        self.output_names = [o.name for o in self.model.graph.output]
        self.placed: dict[tuple, Placed] = {}
        self._first: Placed | None = None
        if shapes is not None or not _symbolic(self.model, self.input_names):
            self._first = self._compile(dict(shapes or {}))

    @property
    def plan(self) -> Plan:
        """The plan of the first input shapes."""
        if self._first is None:
            raise XschedError("no plan yet: the model has symbolic dimensions and has not run", stage="execute")
        return self._first.plan

    @property
    def graph(self) -> Graph:
        if self._first is None:
            raise XschedError("no graph yet: the model has symbolic dimensions and has not run", stage="execute")
        return self._first.graph

    def report(self) -> str:
        return plan_report(self.graph, self.plan)

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None) -> list:
        """ONNX Runtime's signature: the named outputs (all when None) as numpy arrays."""
        np = require("numpy", "execute")
        missing = [n for n in self.input_names if n not in input_feed]
        extra = sorted(set(input_feed) - set(self.input_names))
        if missing or extra:
            what = f"missing inputs {', '.join(missing)}" if missing else f"unknown inputs {', '.join(extra)}"
            raise XschedError(
                f"{what}; the model's inputs are {', '.join(self.input_names)}",
                stage="execute",
                value=(missing or extra)[0],
            )
        feeds = {n: np.asarray(input_feed[n]) for n in self.input_names}
        names = list(output_names) if output_names else self.output_names
        bad = [n for n in names if n not in self.output_names]
        if bad:
            raise XschedError(
                f"unknown output {bad[0]}; the model's outputs are {', '.join(self.output_names)}",
                stage="execute",
                value=bad[0],
            )
        placed = self._get({n: tuple(a.shape) for n, a in feeds.items()})
        for n, a in feeds.items():
            want = np.dtype(np_dtype(placed.graph.value[n].dtype or "float32"))
            if a.dtype != want:
                raise XschedError(f"input {n} is {a.dtype}, the model wants {want}", stage="execute", value=n)
        outs = placed.executor.run(feeds).outputs
        return [outs[n].numpy() for n in names]

    def _get(self, shapes: Mapping[str, tuple[int, ...]]) -> Placed:
        key = tuple(sorted(shapes.items()))
        if key not in self.placed:
            self._compile(shapes)
        return self.placed[key]

    def _compile(self, shapes: Mapping[str, Sequence[int]]) -> Placed:
        graph = capture_onnx(self.model, shapes, name=self.model.graph.name or "onnx")
        plan = solve_plan(
            graph, self.budgets, self.devices, self.method, self.profile, self.time_limit, self.profile_dir
        )
        placed = Placed(graph, plan, OrtExecutor(graph, plan, self.model, optimization=self.optimization))
        self.placed[_key(graph, self.input_names)] = placed
        if self._first is None:
            self._first = placed
        return placed


def device_names(providers: Sequence[Any] | None) -> list[str]:
    """ONNX Runtime provider names (or (name, options) pairs) or ort:* device names -> ort:* device names."""
    names = []
    for p in providers or ["CPUExecutionProvider"]:
        name, options = (p[0], dict(p[1])) if isinstance(p, (tuple, list)) else (p, {})
        if name in PROVIDER_DEVICES:
            base = PROVIDER_DEVICES[name]
            name = f"{base}:{options.get('device_id', 0)}" if base == "ort:cuda" else base
        elif not str(name).startswith("ort:"):
            raise XschedError(
                f"unknown provider {name!r}: give CPUExecutionProvider, CUDAExecutionProvider or ort:cpu / ort:cuda:N",
                stage="execute",
            )
        if name not in names:
            names.append(str(name))
    return names


def _symbolic(model: Any, inputs: Sequence[str]) -> bool:
    by_name = {i.name: i for i in model.graph.input}
    for n in inputs:
        tt = by_name[n].type.tensor_type
        if not tt.HasField("shape") or any(not d.HasField("dim_value") for d in tt.shape.dim):
            return True
    return False


def _key(graph: Graph, inputs: Sequence[str]) -> tuple:
    return tuple(sorted((n, tuple(graph.value[n].shape or ())) for n in inputs))
