"""Eviction over blocks (DTR, Kirisame et al. 2021, one level up): stage by stage, each block part runs with a
fixed option; when its memory points do not fit, the resident boundary value or phantom cheapest to rebuild per
byte and step of waiting is dropped, and rebuilt on demand by rerunning its block (a partial option where one
makes it). Kept to the model's rules (one run of a part and option per stage, within its stages), its runs are
the H-ILP's MIP start (HiGHS completes and checks the rest); without them, its events in order, flattened and
simulated, are a plan of its own when the model has none."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from xsched.solve.hier.hindex import HIndex

Run = tuple[int, int, int]  # (stage-unit, option, stage)
Event = tuple  # ("run", k, o, t) or ("copy", v, src, dst, t), in execution order


class _Stuck(Exception):
    pass


def greedy_events(
    ix: HIndex, choice: Sequence[int], strict: bool, late: Callable[[], bool] = lambda: False
) -> list[Event] | None:
    """The eviction schedule with option `choice[block]` for each block's first run, or None when it cannot fit
    the budgets or `late()` says so before it is done (asked once a stage). `strict`: within the model's rules
    (then a MIP start)."""
    try:
        return _Greedy(ix, choice, strict).schedule(late)
    except _Stuck:
        return None


def as_start(events: Sequence[Event]) -> tuple[set[Run], set[tuple[int, int, int, int]]]:
    """The runs and copies of a strict schedule: the H-ILP's R and C at 1."""
    return {e[1:] for e in events if e[0] == "run"}, {e[1:] for e in events if e[0] == "copy"}


class _Greedy:
    def __init__(self, ix: HIndex, choice: Sequence[int], strict: bool) -> None:
        self.ix, self.choice, self.strict = ix, choice, strict
        self.events: list[Event] = []
        self.resident: set[tuple[int, int]] = set()
        self.held: dict[int, int] = {}  # forward stage-unit -> option of the phantom held
        self.runs: set[Run] = set()
        self.copies: set[tuple[int, int, int, int]] = set()
        self.used = list(ix.const)
        self.fresh: set[tuple] = set()  # made in the current stage: not dropped before the stage ends
        self.twin_of = {f: b for b, f in ix.twin.items()}
        # value -> stages whose first run reads it (with the chosen options), ascending
        self.uses: dict[int, list[int]] = {}
        for k, (u, _) in enumerate(ix.units):
            for v, _ in ix.reads[(k, choice[u])]:
                self.uses.setdefault(v, []).append(k)
        for v in ix.outputs:
            self.uses.setdefault(v, []).append(ix.T)
        if ix.t_back is not None:
            for v in ix.fwd_out:
                self.uses.setdefault(v, []).append(ix.t_back)
        for us in self.uses.values():
            us.sort()

    def schedule(self, late: Callable[[], bool]) -> list[Event]:
        ix = self.ix
        for t in range(ix.T):
            if late():
                raise _Stuck
            self.fresh = set()
            if t == ix.t_back:
                for v in ix.fwd_out:
                    self.ensure(v, self._where(v), t, set())
            self.run(t, self.choice[ix.units[t][0]], t, set())
            self.drop_dead(t)
        for v in ix.outputs:
            self.ensure(v, ix.end_dev.get(v, self._where(v)), ix.T - 1, set())
        return self.events

    def _where(self, v: int) -> int:
        on = [d for vv, d in self.resident if vv == v]
        if on:
            return min(on)
        p = self.ix.prod[v]
        if p is None:
            return self.ix.home[v]
        return min(d for o in range(len(self.ix.parts[p])) for vv, d in self.ix.outs[(p, o)] if vv == v)

    def add(self, v: int, d: int) -> None:
        if (v, d) not in self.resident and self.ix.home.get(v) != d:
            self.resident.add((v, d))
            self.used[d] += self.ix.mem[v]

    def remove(self, v: int, d: int) -> None:
        if (v, d) in self.resident:
            self.resident.discard((v, d))
            self.used[d] -= self.ix.mem[v]

    def run(self, k: int, o: int, t: int, pinned: set) -> None:
        ix = self.ix
        if self.strict and ((k, o, t) in self.runs or t > ix.last[k]):
            raise _Stuck  # one run per part, option and stage in the model
        pin = pinned | {("v", v, d) for v, d in ix.reads[(k, o)]}
        for v, d in ix.reads[(k, o)]:
            self.ensure(v, d, t, pin)
        whole_b = k in ix.twin and ix.full[k][o]  # a backward part's first run, which needs its phantom
        if whole_b and self.held.get(ix.twin[k]) != o:
            self.run(ix.twin[k], o, t, pin)
        pin |= {("p", ix.twin.get(k, k))}
        for d in ix.dev_range:  # the correction terms: inputs read for the last time here are freed in the part
            dead = {v for v, _ in ix.reads[(k, o)] if not any(s > t for s in self.uses.get(v, ()))}
            worst = max((b - sum(ix.mem[v] for v in done if v in dead) for b, done in ix.points[k][o][d]), default=0.0)
            self.fit(d, worst, t, pin)
        self.runs.add((k, o, t))
        self.events.append(("run", k, o, t))
        for v, d in ix.outs[(k, o)]:
            self.add(v, d)
            self.fresh.add(("v", v, d))
        if k in self.twin_of and t <= self.twin_of[k]:  # a phantom only lives until its backward part
            self.release(k)
            self.held[k] = o
            for d in ix.dev_range:
                self.used[d] += ix.phantom[k][o][d]
        if whole_b:
            self.release(ix.twin[k])

    def release(self, f: int) -> None:
        if f in self.held:
            o = self.held.pop(f)
            for d in self.ix.dev_range:
                self.used[d] -= self.ix.phantom[f][o][d]

    def ensure(self, v: int, d: int, t: int, pinned: set) -> None:
        ix = self.ix
        if (v, d) in self.resident or ix.home.get(v) == d:
            return
        src = [s for vv, s in self.resident if vv == v] + ([ix.home[v]] if v in ix.home else [])
        src = [
            s
            for s in src
            if self.ix.profile.link(ix.devices[s], ix.devices[d]) is not None
            and ((v, s, d, t) in ix.copy_time or not self.strict)
        ]
        if src:
            s = min(src, key=lambda s: ix.copy_time.get((v, s, d, t), 0.0))
            self.fit(d, ix.mem[v], t, pinned)
            self.copies.add((v, s, d, t))
            self.events.append(("copy", v, s, d, t))
            self.add(v, d)
            return
        p = ix.prod[v]
        if p is None:
            raise _Stuck  # an input elsewhere with no link: cannot be rebuilt
        makers = [
            o
            for o in self._makers(p, v)
            if (v, d) in ix.outs[(p, o)]
            and (t > p or ix.full[p][o])
            and (not self.strict or ((p, o, t) not in self.runs and t <= ix.last[p]))
        ]
        if not makers:
            raise _Stuck  # e.g. a gradient dropped that no partial option makes again
        self.run(p, min(makers, key=lambda o: (ix.time[p][o], o)), t, pinned)

    def _makers(self, p: int, v: int) -> list[int]:
        """Options of stage-unit p that can make v again (`HIndex.again`)."""
        ix = self.ix
        return [o for o in range(len(ix.parts[p])) if ix.again(p, o) and any(vv == v for vv, _ in ix.outs[(p, o)])]

    def fit(self, d: int, need: float, t: int, pinned: set) -> None:
        """Drop what is cheapest to rebuild until `need` more fits on d."""
        cap = self.ix.budget[d]
        if cap is None:
            return
        while self.used[d] + need > cap + 1e-9:
            victims = [("v", v, dd) for v, dd in self.resident if dd == d and ("v", v, dd) not in pinned]
            if self.ix.t_back is not None and t >= self.ix.t_back:  # the caller holds these from backward's start
                victims = [x for x in victims if x[1] not in self.ix.held]
            victims += [("p", f) for f in self.held if ("p", f) not in pinned and self.ix.phantom[f][self.held[f]][d]]
            if not victims:
                raise _Stuck
            if any(x not in self.fresh for x in victims):  # made this stage: dropped last (the model cannot
                victims = [x for x in victims if x not in self.fresh]  # remake it in the same stage)
            memo: dict[int, float] = {}
            worst = min(victims, key=lambda x: self._score(x, t, memo))
            if worst[0] == "v":
                self.remove(worst[1], worst[2])
            else:
                self.release(worst[1])

    def _score(self, x: tuple, t: int, memo: dict[int, float]) -> float:
        """Rebuild time (with that of its missing inputs, as DTR's e*) per byte and stage of waiting; never needed
        again first of all."""
        ix = self.ix
        if x[0] == "p":
            f = x[1]
            o = self.held[f]
            size = sum(ix.phantom[f][o])
            return self._rebuild(f, o, memo) / (max(size, 1e-12) * (self.twin_of[f] - t + 1))
        v = x[1]
        later = [s for s in self.uses.get(v, ()) if s > t]
        if not later:
            return -1.0
        return self._cost(v, memo) / (max(ix.mem[v], 1e-12) * (later[0] - t))

    def _cost(self, v: int, memo: dict[int, float], depth: int = 0) -> float:
        """Time to make v again: its cheapest maker and, recursively (8 levels), the inputs that are not resident."""
        if v not in memo:
            p = self.ix.prod[v]
            makers = self._makers(p, v) if p is not None else []
            memo[v] = min(self._rebuild(p, o, memo, depth) for o in makers) if makers else 1e9
        return memo[v]

    def _rebuild(self, k: int, o: int, memo: dict[int, float], depth: int = 0) -> float:
        ix = self.ix
        missing = [v for v, d in ix.reads[(k, o)] if (v, d) not in self.resident] if depth < 8 else []
        return ix.time[k][o] + sum(self._cost(v, memo, depth + 1) for v in missing)

    def drop_dead(self, t: int) -> None:
        for v, d in list(self.resident):
            if not any(s > t for s in self.uses.get(v, ())):
                self.remove(v, d)
