"""Identical blocks (HiREmate, Appendix C.1.1): a block's canonical form — each op, in the block's order, by its
target, phase, workspace and devices, and its inputs and outputs by local index; each value by its size, role at
the block's boundary and home — hashed. Blocks of one class are solved once and the options translated."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xsched.contracts.profile import Profile
from xsched.solve.hier.region import Region


@dataclass(frozen=True)
class Canon:
    """A block's class key and the ops and values of its canonical walk (position i of one block corresponds to
    position i of any block of its class)."""

    key: str
    ops: tuple[str, ...]
    values: tuple[str, ...]

    def to(self, other: Canon) -> tuple[dict[str, str], dict[str, str]]:
        """Op and value renaming from this block to `other`, of the same class."""
        assert self.key == other.key
        return dict(zip(self.ops, other.ops)), dict(zip(self.values, other.values))


def canon(
    region: Region, profile: Profile, devices: Sequence[str], homes: Mapping[str, str], children: Sequence[str] = ()
) -> Canon:
    """The canonical form of a region; `children`: the class keys of its child blocks, in order (a block of
    identical ops split differently is another class)."""
    sub = region.graph
    ops = (*region.f_ops, *region.b_ops)
    local: dict[str, int] = {}

    def idx(v: str) -> int:
        return local.setdefault(v, len(local))

    items = []
    for o in ops:
        op = sub.op[o]
        items.append(
            (
                op.target,
                op.phase,
                op.workspace_bytes,
                tuple(idx(v) for v in op.inputs),
                tuple(idx(v) for v in op.outputs),
                tuple(profile.can_run(o, d) for d in devices),
            )
        )
    inputs, f_out, outs = set(region.inputs), set(region.f_outputs), set(sub.outputs)
    values = tuple(local)
    roles = []
    for v in values:
        val = sub.value[v]
        role = "in" if v in inputs else "fout" if v in f_out else "out" if v in outs else "internal"
        roles.append(
            (val.nbytes, val.kind, role, homes.get(v), local.get(val.grad_of or ""), local.get(val.updates or ""))
        )
    text = repr((len(region.f_ops), items, roles, tuple(children)))
    return Canon(hashlib.sha256(text.encode()).hexdigest()[:24], ops, values)
