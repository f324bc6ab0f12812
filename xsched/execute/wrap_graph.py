"""The graph `wrap` runs: the module captured for its devices (the loss chunked as asked, the outputs the caller
holds marked), or, for a plan given to it, the capture that plan was made for; the buffers its plan reads after
updating them, and the devices in the order the solver homes inputs by."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from xsched.capture.chunk_loss import chunked_as_asked
from xsched.capture.grad_outputs import GradOutputs
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan
from xsched.errors import PlanError, XschedError
from xsched.solve.autograd_boundary import forward_outputs


def held_by_caller(graph: Graph) -> Graph:
    """`graph` with its non-scalar forward outputs held by the caller from the autograd boundary on: `wrap` returns
    them, and code such as `loss = F.cross_entropy(model(x), y); loss.backward()` keeps them through backward."""
    held = tuple(v for v in forward_outputs(graph) if graph.value[v].shape != ())
    return dataclasses.replace(graph, held_outputs=held) if held else graph


def graph_to_run(
    traced: Callable[..., Graph],
    plan: Plan | None,
    inference: bool,
    grad_outputs: GradOutputs,
    device_type: str,
    chunk_loss: int | None,
    hold: bool,
) -> Graph:
    """`traced(inference=, grad_outputs=, device_type=)` (a capture of the module) as `wrap` plans and runs it; with
    a `plan`, the capture it was made for: this one, else that of every output (capture's and `xsched capture`'s
    default), or one typed for the CPU (`xsched capture`'s default too: a GPU runs it through the dtype adapters,
    its dropout unfused). A plan for none of them is a one-line PlanError."""

    def graph_of(grads: GradOutputs, kind: str) -> Graph:
        g = traced(inference=inference, grad_outputs=grads, device_type=kind)
        g = g if inference else chunked_as_asked(g, chunk_loss)
        return held_by_caller(g) if hold and not inference else g

    graph = graph_of(grad_outputs, device_type)
    if plan is None or plan.graph == graph.fingerprint:
        return graph
    tried = [(grad_outputs, device_type)]
    for grads, kind in [] if inference else [("all", device_type), (grad_outputs, "cpu"), ("all", "cpu")]:
        if (grads, kind) in tried:  # the same capture again (grad_outputs "all", or typed for the CPU already)
            continue
        tried.append((grads, kind))
        other = graph_of(grads, kind)
        if other.fingerprint == plan.graph:
            return other
    raise PlanError(
        f"the plan was made for graph {plan.graph}; this model on these inputs captures as {graph.fingerprint}: "
        "plan it again for this model",
        stage="execute",
    )


def read_after_update(graph: Graph, plan: Plan) -> set[str]:
    """Buffers some step reads after their update was first computed (recomputation of a batch norm): these
    need a per-call snapshot, since the update is written into the module buffer as soon as it exists."""
    of = {graph.value[v].updates: v for v in graph.outputs if graph.value[v].updates}
    updated: set[str] = set()
    out: set[str] = set()
    for s in plan.steps:
        if isinstance(s, Compute):
            op = graph.op[s.op]
            out.update(b for b in op.inputs if of.get(b) in updated)
            updated.update(op.outputs)
    return out


def computing_first(devices: Sequence[str], stores: Sequence[str]) -> list[str]:
    """The computing devices, then the stores (added where `devices` lacks them): the solver homes graph inputs on
    the first device, which must run ops. A store that is the only device leaves nothing to compute on."""
    computing = [d for d in devices if d not in stores]
    if not computing:
        raise XschedError(
            f"no device left to compute on: devices {list(devices)} are all stores ({', '.join(stores)}); name a "
            "compute device in budgets or devices",
            stage="execute",
            device=stores[0],
        )
    return computing + list(stores)
