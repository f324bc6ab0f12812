"""Machines for what-ifs: `cpu+sim:a100-40gb@60%mem` parsed into devices and base budgets, a profile restricted to
one machine's devices, and where each device's costs come from (measured or roofline model)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xsched.budgets import parse_budget
from xsched.contracts.graph import Graph
from xsched.contracts.profile import Profile
from xsched.devices.spec import load_spec, sim_spec
from xsched.errors import BudgetError, XschedError

MEM_SUFFIX = "%mem"  # "60%mem": a share of the device's own memory (the plain "60%" is of the eager peak)


@dataclass(frozen=True)
class Machine:
    """Devices planned together; the first is the home of every graph input. `budgets`: each device's base budget
    as written ("4GiB", "50%" of the eager peak, "60%mem" of its memory); a device not named there gets its whole
    memory."""

    devices: tuple[str, ...]
    budgets: Mapping[str, str]

    @property
    def label(self) -> str:
        return " + ".join(d + (f"@{self.budgets[d]}" if d in self.budgets else "") for d in self.devices)


def parse_machine(text: str) -> Machine:
    """`DEVICE[@BUDGET]+DEVICE[@BUDGET]...`, e.g. `cpu+sim:l4#0+sim:l4#1` or `sim:a100-40gb@60%mem+cpu`."""
    devices, budgets = [], {}
    for part in (p.strip() for p in text.split("+")):
        name, at, budget = part.partition("@")
        name, budget = name.strip(), budget.strip()
        if not name or (at and not budget):
            raise XschedError(f"a machine is DEVICE[@BUDGET]+DEVICE[@BUDGET]..., got {text!r}", stage="report")
        if name in devices:
            raise XschedError(f"device {name} appears twice in machine {text!r}", stage="report", device=name)
        devices.append(name)
        if budget:
            budgets[name] = budget
    return Machine(tuple(devices), budgets)


def union_devices(machines: Sequence[Machine]) -> list[str]:
    """Every device of every machine, in first-seen order (one profile covers them all)."""
    return list(dict.fromkeys(d for m in machines for d in m.devices))


def restrict(profile: Profile, devices: Sequence[str]) -> Profile:
    """The profile's costs for `devices` only: their ops and the links among them."""
    missing = [d for d in devices if d not in profile.devices]
    if missing:
        raise XschedError(f"the profile has no costs for {missing[0]}", stage="report", device=missing[0])
    keep = set(devices)
    copy = {k: c for k, c in profile.copy.items() if set(k.split("->")) <= keep}
    return Profile(
        profile.graph,
        {d: profile.devices[d] for d in devices},
        {d: profile.compute.get(d, {}) for d in devices},
        copy,
        {d: profile.energy_source.get(d, "model") for d in devices},
        profile.extra,
        tuple(s for s in profile.stores if s in keep),
        profile.modelled,
        profile.profiling,
    )


def base_budgets(machine: Machine, profile: Profile, eager_peak: int) -> dict[str, int]:
    """Bytes per device: as the machine says, else the device's memory (a device of unknown size: no budget)."""
    out = {}
    for d in machine.devices:
        memory = profile.devices[d].memory_bytes
        spec = machine.budgets.get(d)
        if spec is None:
            if memory > 0:
                out[d] = memory
        elif spec.endswith(MEM_SUFFIX):
            if memory <= 0:
                raise BudgetError(f"budget {spec!r} needs the device's memory size, which is unknown", device=d)
            out[d] = parse_budget(spec.removesuffix("mem"), memory, d)
        else:
            out[d] = parse_budget(spec, eager_peak, d)
    return out


def is_host(profile: Profile, device: str) -> bool:
    """True for a CPU (real, or a simulated CPU spec): the device that is not an accelerator."""
    info = profile.devices[device]
    if info.kind == "sim":
        try:
            spec = load_spec(str(info.extra["spec"])) if "spec" in info.extra else sim_spec(device)
            return spec.kind == "cpu"
        except XschedError:
            return False
    return info.kind == "cpu"


def accelerators(profile: Profile, machine: Machine) -> tuple[str, ...]:
    """The machine's non-host devices (all of them when every device is a host)."""
    acc = tuple(d for d in machine.devices if not is_host(profile, d))
    return acc or machine.devices


def cost_source(profile: Profile, device: str) -> str:
    """Where a device's op costs come from, in words for the report."""
    info = profile.devices[device]
    if info.kind == "sim":
        spec = info.extra.get("spec", device)
        return f"roofline model of spec {spec} (simulated)"
    if profile.modelled:
        return "bandwidth cost model (not measured)"
    if info.kind not in ("cpu", "cuda"):
        return f"given with the graph ({info.kind})"
    return f"measured on this {info.kind.upper()}"


def energy_of(profile: Profile, device: str) -> str:
    """'modelled', 'measured (rapl)', 'measured (nvml)' or 'not known' (Profile.energy_source)."""
    src = profile.energy_source.get(device, "model")
    return "modelled" if src in ("model", "") else "not known" if src == "none" else f"measured ({src})"


def energy_label(profile: Profile, devices: Sequence[str]) -> str:
    """'energy modelled', 'energy measured (rapl)', or per device when they differ, for figure titles."""
    kinds = {d: energy_of(profile, d) for d in devices}
    if len(set(kinds.values())) == 1:
        return f"energy {next(iter(kinds.values()))}"
    return "energy " + "; ".join(f"{d}: {k}" for d, k in kinds.items())


def graph_summary(graph: Graph) -> dict[str, object]:
    phases = {p: sum(o.phase == p for o in graph.ops) for p in ("fwd", "loss", "bwd")}
    return {
        "name": graph.name,
        "fingerprint": graph.fingerprint,
        "ops": len(graph.ops),
        "values": len(graph.values),
        "phases": phases,
    }
