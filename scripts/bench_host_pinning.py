"""Host memory pinned during the setup of `xsched train --param-home cpu` beside a GPU (issue 30), counted without
one: the bytes the wrapped module and the host optimizer's buckets pin and copy into pinned memory, as before (the
module pinned every parameter alone, then the buckets packed some into new pinned buffers) and now (the buckets pin
what they pack in slabs, then the module pins the rest).

    PYTHONPATH=scripts python scripts/bench_host_pinning.py [--model gpt2] [--scale full:n_layer=48,...] [--order plan|reverse]

The model gets uninitialised host memory (bench_setup_plan's `--empty`). Every pinned allocation goes through
`xsched.execute.host_pin.pinned_empty`, replaced here by a plain one that is recorded (the CPU build of torch cannot
pin); copies into it and its zeroing are counted, not done, so the count costs no memory. `--order plan`: the
parameters in the order the `park` plan at 16 GiB releases them, as `xsched train` buckets them (the capture takes
about 10 s); `reverse`: the reverse of the module's order. "Dead" is pinned memory no parameter or bucket holds any
more: torch's pinned host cache keeps it. The fp32 gradient buffers the buckets pin are the design's, in both."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_setup_plan import GPU, HOST, SCALE, Clock, build, empty_model
from torch.utils._python_dispatch import TorchDispatchMode

from xsched.execute import host_pin
from xsched.execute.param_home import ListenerSlot, ParamPoints, param_homes
from xsched.solve import SolverOptions, solve
from xsched.train import host_adamw, host_buckets
from xsched.train.host_adamw import HostAdamW
from xsched.train.optim import param_groups

MiB = 2**20


class PinCount(TorchDispatchMode):
    """Pinned allocations recorded by storage; copies into them and their zeroing counted and skipped; the peak of
    the pinned memory (as torch rounds it) and `model`'s host memory not pinned yet, at each pinned allocation."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.held: dict[int, torch.Tensor] = {}  # storage pointer -> the allocation (kept: no address reused)
        self.copied = 0
        self.peak = 0

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        self.held[t.untyped_storage().data_ptr()] = t
        pageable = {
            s.data_ptr(): s.nbytes()
            for x in [*self.model.parameters(), *self.model.buffers()]
            if (s := x.untyped_storage()).data_ptr() not in self.held
        }
        self.peak = max(self.peak, self.rounded() + sum(pageable.values()))
        return t

    def rounded(self) -> int:
        """The pinned bytes as torch's host allocator (CachingHostAllocator) holds them: each a power of two."""
        return sum(_pow2(t.untyped_storage().nbytes()) for t in self.held.values())

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.held

    def pinned_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.held.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.zero_.default) and self.is_pinned(args[0]):
            if func is torch.ops.aten.copy_.default:
                self.copied += args[0].numel() * args[0].element_size()
            return args[0]
        return func(*args, **(kwargs or {}))


def release_order(model: torch.nn.Module, name: str, scale: str, order: str) -> list[str]:
    """The trained parameters' names in the order the run releases them (see the module)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if order == "reverse":
        return names[::-1]
    graph, profile = build(name, scale, "fp32", True, Clock())
    budgets = {GPU: "16GiB", HOST: "100GiB"}
    plan = solve(graph, profile, budgets, [GPU, HOST], "park", SolverOptions(), homes=param_homes(graph, HOST))
    return [n for n in ParamPoints(graph, plan, ListenerSlot()).order if n in names]


def pin_each_alone(module: torch.nn.Module) -> None:
    """What the wrapped module did before: each host parameter and buffer copied into a pinned allocation alone."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.data = host_pin.pin_host(t.data)


def setup(model: torch.nn.Module, names: list[str], before: bool) -> dict[str, int]:
    """One setup's counts, in bytes: the module's pins and the buckets' in the given order."""
    count = PinCount(model)
    swapped: list[Callable[[], None]] = []
    for module in (host_pin, host_buckets, host_adamw):
        if hasattr(module, "pinned_empty"):
            real = module.pinned_empty
            module.pinned_empty = count.empty
            swapped.append(lambda m=module, r=real: setattr(m, "pinned_empty", r))
    real_is_pinned = torch.Tensor.is_pinned
    torch.Tensor.is_pinned = lambda t: count.is_pinned(t)
    named = dict(model.named_parameters())
    decay_of = {id(p): g["weight_decay"] for g in param_groups(model.parameters(), 0.1) for p in g["params"]}
    decay = {n: decay_of[id(named[n])] for n in names}
    try:
        with count:
            if before:
                pin_each_alone(model)
            host = HostAdamW([(n, named[n]) for n in names], decay, 1e-4, pin=not before)  # before: as they are
            host.close()
            if not before:
                host_pin.pin_unpinned(model)
    finally:
        torch.Tensor.is_pinned = real_is_pinned
        for undo in swapped:
            undo()
    grad_buffers = [seg.grad for b in host.buckets for seg in b.segments if count.is_pinned(seg.grad)]
    grads = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in grad_buffers}.values())
    tensors = [*model.parameters(), *model.buffers()]
    live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if count.is_pinned(t)}
    weights = count.pinned_bytes() - grads
    return {
        "weights pinned": weights,
        "copied into pinned": count.copied,
        "dead pinned": weights - sum(live.values()),
        "gradients pinned": grads,
        "all pinned, as torch rounds it": count.rounded(),
        "setup's peak: that and the weights not pinned yet": count.peak,
    }


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", help="a zoo model")
    ap.add_argument("--scale", default=SCALE)
    ap.add_argument("--order", default="plan", choices=("plan", "reverse"))
    args = ap.parse_args()
    model = empty_model(args.model, args.scale)
    total = sum(p.numel() * p.element_size() for p in model.parameters()) / MiB
    names = release_order(model, args.model, args.scale, args.order)
    rows = {"before": setup(model, names, before=True)}
    del model
    rows["now"] = setup(empty_model(args.model, args.scale), names, before=False)
    print(f"{args.model} {args.scale}: {total:,.1f} MiB of parameters, order {args.order}")
    print(f"| MiB | {' | '.join(rows)} |\n|---|{'---|' * len(rows)}")
    for key in rows["now"]:
        print(f"| {key} | {' | '.join(f'{r[key] / MiB:,.3f}' for r in rows.values())} |")


if __name__ == "__main__":
    main()
