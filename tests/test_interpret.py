"""The plan interpreter: one walk, hooks in plan order, each rule raised once with the step it breaks."""

from __future__ import annotations

import pytest
from conftest import chain_graph

from xsched.contracts.plan import Compute, Copy, Free, Plan
from xsched.contracts.result import SolveResult
from xsched.errors import PlanError
from xsched.interpret import PlanInterpreter


def _plan(graph, steps, homes=None, budgets=None) -> Plan:
    return Plan(
        graph.fingerprint,
        budgets or {},
        {"x": "cpu"} if homes is None else homes,
        tuple(steps),
        SolveResult("hand", "heuristic"),
    )


class Recorder(PlanInterpreter):
    """A custom pass: records each hook call and the bytes it saw."""

    def begin(self):
        self.log = [("begin", dict(self.used))]

    def on_compute(self, i, s, op):
        self.log.append(("compute", i, op.id, s.device))

    def on_copy(self, i, s):
        self.log.append(("copy", i, s.value, s.src, s.dst))

    def on_free(self, i, s):
        self.log.append(("free", i, s.value, s.device))

    def after_step(self, i, s):
        self.log.append(("after", i, dict(self.used)))

    def end(self):
        self.log.append(("end",))
        return self.log


def test_hooks_run_in_plan_order_with_residency_updated_after_each() -> None:
    g = chain_graph([16, 32])
    steps = [Compute("f0", "cpu"), Copy("a0", "cpu", "gpu"), Free("a0", "cpu"), Compute("f1", "gpu")]
    log = Recorder(g, _plan(g, steps)).run()
    assert log == [
        ("begin", {"cpu": 8, "gpu": 0}),
        ("compute", 0, "f0", "cpu"),
        ("after", 0, {"cpu": 24, "gpu": 0}),
        ("copy", 1, "a0", "cpu", "gpu"),
        ("after", 1, {"cpu": 24, "gpu": 16}),
        ("free", 2, "a0", "cpu"),
        ("after", 2, {"cpu": 8, "gpu": 16}),
        ("compute", 3, "f1", "gpu"),
        ("after", 3, {"cpu": 8, "gpu": 48}),
        ("end",),
    ]


def test_peak_counts_outputs_and_workspace_while_a_compute_runs() -> None:
    g = chain_graph([16, 32])
    it = PlanInterpreter(g, _plan(g, [Compute("f0", "cpu"), Compute("f1", "cpu")]))
    it.run()
    assert it.peak == {"cpu": 8 + 16 + 32} and it.peak_step == {"cpu": 1}

    class Workspace(PlanInterpreter):
        def workspace(self, i, s, op):
            return 100 if op.id == "f0" else 0

    w = Workspace(g, _plan(g, [Compute("f0", "cpu"), Compute("f1", "cpu")]))
    w.run()
    assert w.peak == {"cpu": 8 + 16 + 100} and w.peak_step == {"cpu": 0}


BROKEN = [
    # (steps, homes, the error's words, step, op, value, device)
    ([Compute("f1", "cpu")], None, "input a0 is not resident on cpu", 0, "f1", "a0", "cpu"),
    ([Compute("nope", "cpu")], None, "compute of an unknown op", 0, "nope", None, "cpu"),
    ([Copy("a0", "cpu", "gpu")], None, "value is not resident on cpu", 0, "f0", "a0", "cpu"),
    ([Compute("f0", "cpu"), Copy("a0", "cpu", "cpu")], None, "copy to the device it comes from", 1, None, "a0", "cpu"),
    (
        [Compute("f0", "cpu"), Copy("a0", "cpu", "gpu"), Copy("a0", "cpu", "gpu")],
        None,
        "already resident on gpu",
        2,
        None,
        "a0",
        "gpu",
    ),
    ([Free("a0", "cpu")], None, "free of a value not resident on cpu", 0, None, "a0", "cpu"),
    ([Free("x", "cpu")], None, "graph input freed on its home device", 0, None, "x", "cpu"),
    ([Compute("f0", "cpu")], None, "op is never computed", 1, "f1", None, None),
    (
        [Compute("f0", "cpu"), Compute("f1", "cpu"), Free("a1", "cpu")],
        None,
        "not resident anywhere at the end",
        3,
        "f1",
        "a1",
        None,
    ),
    ([Compute("f0", "cpu"), Compute("f1", "cpu")], {}, "graph input has no home device", None, None, "x", None),
]


@pytest.mark.parametrize("steps,homes,words,step,op,value,device", BROKEN)
def test_each_rule_names_the_step_op_value_and_device(steps, homes, words, step, op, value, device) -> None:
    g = chain_graph([16, 32])
    with pytest.raises(PlanError, match=words) as e:
        PlanInterpreter(g, _plan(g, steps, homes)).run()
    got = e.value
    assert (got.step, got.op, got.value, got.device) == (step, op, value, device)
    assert str(got).count(words) == 1  # said once, not once per pass


def test_budget_is_checked_only_when_asked_and_names_the_step() -> None:
    g = chain_graph([16, 32])
    plan = _plan(g, [Compute("f0", "cpu"), Compute("f1", "cpu")], budgets={"cpu": 40})
    PlanInterpreter(g, plan).run()
    with pytest.raises(PlanError, match="exceeds the budget of 40 B") as e:
        PlanInterpreter(g, plan, check_budgets=True).run()
    assert (e.value.step, e.value.op, e.value.device) == (1, "f1", "cpu")


def test_inputs_homed_over_the_budget_fail_before_the_first_step() -> None:
    """The steps check what they allocate; inputs homed over the budget are caught before any step allocates (a
    plan whose first steps free or copy would pass otherwise)."""
    g = chain_graph([16, 32])
    homed = sum(g.value[v].nbytes for v in g.inputs)
    steps = [Compute("f0", "cpu"), Compute("f1", "cpu")]
    PlanInterpreter(g, _plan(g, steps, budgets={"cpu": homed - 1})).run()  # unchecked: no error
    with pytest.raises(PlanError, match=f"inputs homed on cpu take {homed} B, over its budget of {homed - 1} B") as e:
        PlanInterpreter(g, _plan(g, steps, budgets={"cpu": homed - 1}), check_budgets=True)
    assert e.value.device == "cpu" and "\n" not in str(e.value)


def test_stage_of_the_pass_is_named() -> None:
    class Run(PlanInterpreter):
        stage = "execute"

    g = chain_graph([16])
    with pytest.raises(PlanError) as e:
        Run(g, _plan(g, [Free("a0", "cpu")])).run()
    assert e.value.stage == "execute"
