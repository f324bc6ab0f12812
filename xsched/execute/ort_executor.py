"""Placed execution on ONNX Runtime: each run of a plan's computes on one provider is one session (built once),
values pass between sessions as OrtValues on their device, and copies, frees and recomputation are the plan's.

The walk is a pass over the plan interpreter (`xsched.interpret`), so its rules, budgets and step-tagged errors
are the simulator's. A run of computes on device d (a segment) ends where one session could no longer follow
the plan: at a copy into d, at a copy out of d of a value the segment computes, and before a compute where the
values the session must hold longer than the plan says would exceed d's budget. An op computed twice in one
segment writes under a second name. Frees on d of values the segment does not read happen before its session
runs; values it computes and the plan frees before it ends stay inside the session (ONNX Runtime frees them after
their last use); values it reads and the plan frees before it ends are freed when it ends (a session holds its
inputs), and counted until then; the values it computes that are still resident when it ends are its outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xsched.contracts.graph import Graph
from xsched.contracts.onnx_ops import build_model, require, static_array
from xsched.contracts.plan import Copy, Plan
from xsched.devices.base import get_device
from xsched.devices.ort import OrtDevice
from xsched.errors import XschedError
from xsched.execute.ort_segments import Action, OverBudget, Segment, Segmenter


@dataclass(frozen=True)
class OrtRun:
    """One run: graph outputs (OrtValues), and per action with exact stores (plan step, bytes held per device)."""

    outputs: dict[str, Any]
    held_after: tuple[tuple[int, Mapping[str, int]], ...]
    peak_held: Mapping[str, int]


class OrtExecutor:
    """Runs `plan` on ONNX Runtime. `model`: the ONNX model the graph was captured from (a ModelProto or path;
    its initializers are the params). `devices` maps plan devices to ORT devices (default: the plan's names,
    which must be ort:* devices). `optimization`: ONNX Runtime's graph optimisation level in each session."""

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        model: Any,
        *,
        devices: Mapping[str, str] | None = None,
        optimization: str = "all",
        check: bool = True,
    ) -> None:
        self.graph, self.plan, self.optimization = graph, plan, optimization
        self.device_names = {d: (devices or {}).get(d, d) for d in plan.devices}
        self.dev = {d: _ort_device(d, name) for d, name in self.device_names.items()}
        cuts: frozenset[int] = frozenset()
        while True:  # where deferred frees would exceed a budget, end the segment before that compute: walk again
            prep = Segmenter(graph, plan, self.dev, check_budgets=check, cuts=cuts)
            try:
                self.actions: tuple[Action, ...] = tuple(prep.run())
                break
            except OverBudget as e:
                if e.step in cuts:  # cannot happen: a cut frees the deferred values before the compute counts
                    raise XschedError(
                        "deferred frees exceed the budget after a cut", stage="execute", step=e.step
                    ) from e
                cuts |= {e.step}
        self.cuts = cuts
        # graph bytes resident per device, as the plan interpreter counts them, with the deferred frees
        self.peak_bytes = dict(prep.peak)
        self.output_on = {v: prep.where_output(v) for v in graph.outputs}
        self.nbytes = {v.id: v.nbytes for v in graph.values}
        self.params = self._load_params(model)
        self._sessions: dict[tuple, Any] = {}
        self.sessions = {k: self._session(a.do) for k, a in enumerate(self.actions) if isinstance(a.do, Segment)}

    @property
    def segments(self) -> list[Segment]:
        return [a.do for a in self.actions if isinstance(a.do, Segment)]

    def _load_params(self, model: Any) -> dict[str, Any]:
        """Each param once, as an OrtValue on its home (a plan never frees a graph input on its home)."""
        onnx = require("onnx", "execute")
        if not isinstance(model, onnx.ModelProto):
            from xsched.capture.onnx import load_model

            model = load_model(model)[0]
        found = {t.name: t for t in model.graph.initializer}
        params = {}
        for v in self.graph.inputs:
            if self.graph.value[v].kind != "param":
                continue
            if v not in found:
                raise XschedError(
                    "the model has no initializer for this param: is it the model the graph was captured from?",
                    stage="execute",
                    value=v,
                )
            params[v] = self.dev[self.plan.homes[v]].put(onnx.numpy_helper.to_array(found[v]))
        return params

    def _session(self, seg: Segment) -> Any:
        """The segment's session, shared by every segment with the same ops, feeds, params and outputs."""
        key = (
            seg.device,
            seg.ops,
            tuple(tuple(sorted(r.items())) for r in seg.renames),
            seg.feeds,
            seg.params,
            seg.outputs,
        )
        if key not in self._sessions:
            inline = {v: static_array(self.graph.value[v]) for v in seg.params}
            external = [v for v, a in inline.items() if a is None]
            inline = {v: a for v, a in inline.items() if a is not None}
            model = build_model(
                self.graph,
                seg.ops,
                seg.feeds,
                seg.outputs,
                initializers=inline,
                external=external,
                renames=seg.renames,
                output_names=seg.output_names,
                name=f"{self.graph.name}:{seg.device}:{seg.ops[0]}",
            )
            try:
                self._sessions[key] = self.dev[seg.device].session(
                    model, {v: self.params[v] for v in external}, self.optimization
                )
            except Exception as e:  # ONNX Runtime's message names the node it cannot place
                raise XschedError(
                    f"ONNX Runtime cannot build the session of ops {seg.ops[0]}..{seg.ops[-1]}: {_line(e)}",
                    stage="execute",
                    step=seg.steps[0],
                    op=seg.ops[0],
                    device=seg.device,
                ) from e
        return self._sessions[key]

    # ---- running ----
    def run(self, feeds: Mapping[str, Any], *, trace: bool = False) -> OrtRun:
        """One run with graph inputs `feeds` (input name -> array or OrtValue); outputs as OrtValues. With `trace`,
        the bytes held after each action, and every value made checked against the graph's shape."""
        stores: dict[str, dict[str, Any]] = {d: {} for d in self.dev}
        for v, d in self.plan.homes.items():
            if v in self.params:
                stores[d][v] = self.params[v]
            elif v in feeds:
                x = feeds[v]
                stores[d][v] = x = x if _is_ortvalue(x) else self.dev[d].put(x)
                self._check_shape(v, x, d, None)
            else:
                raise XschedError("no value fed for graph input", stage="execute", value=v, device=d)
        held = {d: sum(self.nbytes[v] for v in s) for d, s in stores.items()}
        peak, after = dict(held), []
        for k, a in enumerate(self.actions):
            do = a.do
            if isinstance(do, Segment):
                store = stores[do.device]
                outs = self._run_segment(k, store)
                for v, x in zip(do.outputs, outs):
                    if v not in store:
                        held[do.device] += self.nbytes[v]
                    store[v] = x
                    if trace:
                        self._check_shape(v, x, do.device, a.step)
            elif isinstance(do, Copy):
                x = stores[do.dst][do.value] = self.dev[do.src].transfer(stores[do.src][do.value], self.dev[do.dst])
                held[do.dst] += self.nbytes[do.value]
                if trace:
                    self._check_shape(do.value, x, do.dst, a.step)
            else:
                del stores[do.device][do.value]
                held[do.device] -= self.nbytes[do.value]
            if trace:
                for d, b in held.items():
                    peak[d] = max(peak[d], b)
                after.append((a.at, {d: held[d] for d in a.exact}))
        outputs = {v: stores[self.output_on[v]][v] for v in self.graph.outputs}
        return OrtRun(outputs, tuple(after), peak)

    def _check_shape(self, v: str, x: Any, device: str, step: int | None) -> None:
        want = self.graph.value[v].shape
        if tuple(x.shape()) != want:
            what = "fed" if step is None else "made"
            raise XschedError(
                f"{what} with shape {list(x.shape())}, the graph's is {list(want or ())}",
                stage="execute",
                step=step,
                value=v,
                device=device,
            )

    def _run_segment(self, k: int, store: Mapping[str, Any]) -> list[Any]:
        a = self.actions[k]
        seg: Segment = a.do  # type: ignore[assignment]
        try:
            return self.dev[seg.device].run(self.sessions[k], {v: store[v] for v in seg.feeds}, seg.output_names)
        except Exception as e:
            raise XschedError(
                f"ONNX Runtime failed running ops {seg.ops[0]}..{seg.ops[-1]}: {_line(e)}",
                stage="execute",
                step=a.step,
                op=seg.ops[0],
                device=seg.device,
            ) from e

    def __call__(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Graph outputs as numpy arrays."""
        return {v: x.numpy() for v, x in self.run(feeds).outputs.items()}


def _ort_device(plan_device: str, name: str) -> OrtDevice:
    dev = get_device(name)
    if not isinstance(dev, OrtDevice):
        raise XschedError(
            f"plan device {plan_device} runs on {name}, not an ONNX Runtime device: plan on "
            "ort:cpu / ort:cuda:N, or map it with devices=",
            stage="execute",
            device=plan_device,
        )
    return dev


def _is_ortvalue(x: Any) -> bool:
    return type(x).__name__ == "OrtValue"


def _line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"


def plain_session(model: Any, devices: Sequence[str], optimization: str = "all") -> Any:
    """One ordinary InferenceSession of the whole model on the providers of `devices` (ort:* names), GPU first,
    as a user would make it: ONNX Runtime assigns the nodes itself."""
    ort = require("onnxruntime", "execute")
    devs = [get_device(d) for d in devices]
    ords = [d for d in devs if isinstance(d, OrtDevice)]
    cuda = next((d for d in ords if d.where == "cuda"), None)
    cpu = next((d for d in ords if d.where == "cpu"), None)
    so = ort.SessionOptions()
    from xsched.devices.ort import OPTIMIZATION

    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION[optimization])
    so.log_severity_level = 3
    if cpu is not None and cpu.threads:
        so.intra_op_num_threads = cpu.threads
    providers: list[Any] = [("CUDAExecutionProvider", {"device_id": str(cuda.device_id)})] if cuda else []
    providers.append("CPUExecutionProvider")
    data = model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
    return ort.InferenceSession(data, so, providers=providers)
