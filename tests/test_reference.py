"""Reference interpreter: plans run on captured graphs reproduce eager PyTorch, and its residency equals the simulator's."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_run_counts
from torch import nn

import xsched.execute.reference as reference
from xsched.capture import bind_inputs, capture, unpack_outputs
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, place_frees, required_homes
from xsched.contracts.result import SolveResult
from xsched.errors import PlanError, XschedError
from xsched.execute import execute, run_plan
from xsched.simulate import simulate
from xsched.solve.reference import eager_plan


class Net(nn.Module):
    """Conv + batch norm + dropout + an MLP head with a loss: every kind of op the interpreter must get right."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.fc1 = nn.Linear(6 * 4 * 4, 32)
        self.drop = nn.Dropout(0.4)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x, y):
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1)
        logits = self.fc2(self.drop(F.gelu(self.fc1(h))))
        return F.cross_entropy(logits, y), logits


def _setup():
    torch.manual_seed(0)
    model = Net()
    inputs = (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
    return model, inputs, capture(model, inputs)


def _eager(model, inputs, tangents, seed=7):
    m = copy.deepcopy(model)
    torch.manual_seed(seed)
    outs = m(*inputs)
    torch.autograd.backward(list(outs), list(tangents))
    return outs, {k: p.grad for k, p in m.named_parameters()}, dict(m.named_buffers())


def _tangents():
    g = torch.Generator().manual_seed(1)
    return torch.rand((), generator=g), torch.randn(4, 5, generator=g)


def _assert_same(g, values, want):
    outs, grads, buffers = want
    got = unpack_outputs(g, values)
    assert len(got.outputs) == len(outs)
    for a, b in zip(got.outputs, outs):
        assert torch.equal(a, b)
    assert set(got.grads) == set(grads)
    for k in grads:
        assert torch.equal(got.grads[k], grads[k]), k
    assert set(got.buffers) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    for k, b in got.buffers.items():
        assert torch.equal(b, buffers[k]), k


def test_eager_plan_reproduces_eager_pytorch_and_simulator_residency():
    model, inputs, g = _setup()
    tangents = _tangents()
    plan = eager_plan(g, "cpu")
    torch.manual_seed(7)
    trace = execute(g, plan, bind_inputs(g, model, inputs, tangents))
    _assert_same(g, trace.outputs, _eager(model, inputs, tangents))
    assert_run_counts(g, plan, trace.resident_after, trace.peak_bytes)  # independent counts, not the simulator's
    # the inputs were not touched: a second run from the same state gives the same answer
    torch.manual_seed(7)
    again = run_plan(g, plan, bind_inputs(g, model, inputs, tangents))
    assert all(torch.equal(again[k], trace.outputs[k]) for k in trace.outputs)


def _two_device_plan(g: Graph, random_on_home: bool = False) -> Plan:
    """Blocks of three ops alternate between cpu:0 and cpu:1, with copies where an input lives elsewhere."""
    homes = {v: "cpu:0" for v in g.inputs}
    where = {v: ["cpu:0"] for v in g.inputs}
    steps: list = []
    for k, o in enumerate(g.ops):
        d = ("cpu:0", "cpu:1")[(k // 3) % 2 and not (random_on_home and reference.is_random(o))]
        for v in dict.fromkeys(o.inputs):
            if d not in where[v]:
                steps.append(Copy(v, where[v][0], d))
                where[v].append(d)
        steps.append(Compute(o.id, d))
        for v in o.outputs:
            where[v] = [d]
    for v, d in required_homes(g, homes).items():
        if d not in where[v]:
            steps.append(Copy(v, where[v][0], d))
    steps = place_frees(g, steps, homes)
    return Plan(g.fingerprint, {}, homes, tuple(steps), SolveResult("test:two-device", "heuristic"))


def test_two_device_plan_gives_the_same_results():
    model, inputs, g = _setup()
    tangents = _tangents()
    plan = _two_device_plan(g)
    assert sum(isinstance(s, Copy) for s in plan.steps) > 5 and any(isinstance(s, Free) for s in plan.steps)
    assert {d for d in plan.devices} == {"cpu:0", "cpu:1"}
    torch.manual_seed(7)
    trace = execute(g, plan, bind_inputs(g, model, inputs, tangents), devices={"cpu:0": "cpu", "cpu:1": "cpu"})
    _assert_same(g, trace.outputs, _eager(model, inputs, tangents))
    assert_run_counts(g, plan, trace.resident_after, trace.peak_bytes)
    assert max(r["cpu:1"] for r in trace.resident_after) > 0


def _recompute_dropout_plan(g: Graph) -> tuple[Plan, str]:
    """Eager order, but the dropout mask is freed after forward and recomputed right before backward uses it."""
    bern = next(o for o in g.ops if o.target == "aten.bernoulli.p")
    make = g.op[g.producer[bern.inputs[0]]]  # empty_like
    scale = g.op[g.consumers[bern.outputs[0]][0]]  # div: the scaled mask backward reads
    chain = [make.id, bern.id, scale.id]
    user = next(o for o in g.ops if o.phase == "bwd" and scale.outputs[0] in o.inputs)
    steps = []
    for o in g.ops:
        if o.id == user.id:
            steps += [Compute(c, "cpu") for c in chain]
        steps.append(Compute(o.id, "cpu"))
    homes = {v: "cpu" for v in g.inputs}
    steps = place_frees(g, steps, homes)
    return Plan(g.fingerprint, {}, homes, tuple(steps), SolveResult("test:recompute", "heuristic")), bern.id


def test_recomputed_dropout_reproduces_the_same_mask():
    model, inputs, g = _setup()
    tangents = _tangents()
    plan, bern = _recompute_dropout_plan(g)
    assert sum(isinstance(s, Compute) for s in plan.steps) == len(g.ops) + 3
    torch.manual_seed(7)
    trace = execute(g, plan, bind_inputs(g, model, inputs, tangents))
    assert bern in trace.recomputed
    _assert_same(g, trace.outputs, _eager(model, inputs, tangents))
    assert_run_counts(g, plan, trace.resident_after, trace.peak_bytes)


def test_recompute_without_rng_replay_would_differ(monkeypatch):
    """Control for the test above: without restoring the RNG state the recomputed mask is different."""
    model, inputs, g = _setup()
    tangents = _tangents()
    plan, _ = _recompute_dropout_plan(g)
    monkeypatch.setattr(reference, "is_random", lambda op: False)
    torch.manual_seed(7)
    values = run_plan(g, plan, bind_inputs(g, model, inputs, tangents))
    _, grads, _ = _eager(model, inputs, tangents)
    got = unpack_outputs(g, values).grads
    assert not torch.equal(got["fc1.weight"], grads["fc1.weight"])


def test_plan_errors_name_step_op_value_and_device():
    model, inputs, g = _setup()
    env = bind_inputs(g, model, inputs)
    homes = {v: "cpu" for v in g.inputs}
    first = g.ops[0]
    needs = next(o for o in g.ops if any(v in g.producer for v in o.inputs))
    bad = Plan(g.fingerprint, {}, homes, (Compute(needs.id, "cpu"),), SolveResult("bad", "heuristic"))
    with pytest.raises(PlanError, match="not resident") as e:
        run_plan(g, bad, env)
    assert (e.value.step, e.value.op, e.value.device, e.value.stage) == (0, needs.id, "cpu", "execute")
    freeing_input = Plan(g.fingerprint, {}, homes, (Free(g.inputs[0], "cpu"),), SolveResult("bad", "heuristic"))
    with pytest.raises(PlanError, match="freed on its home"):
        run_plan(g, freeing_input, env)
    copy_missing = Plan(
        g.fingerprint, {}, homes, (Copy(first.outputs[0], "cpu", "cpu:1"),), SolveResult("bad", "heuristic")
    )
    with pytest.raises(PlanError, match="not resident on cpu"):
        run_plan(g, copy_missing, env)
    reader = next(o for o in g.ops if first.outputs[0] in o.inputs)
    use_after_free = Plan(
        g.fingerprint,
        {},
        homes,
        (Compute(first.id, "cpu"), Free(first.outputs[0], "cpu"), Compute(reader.id, "cpu")),
        SolveResult("bad", "heuristic"),
    )
    with pytest.raises(PlanError, match="not resident on cpu") as e:
        run_plan(g, use_after_free, env)
    assert (e.value.step, e.value.op, e.value.value) == (2, reader.id, first.outputs[0])
    unfinished = Plan(g.fingerprint, {}, homes, (Compute(first.id, "cpu"),), SolveResult("bad", "heuristic"))
    with pytest.raises(PlanError, match="never computed"):
        run_plan(g, unfinished, env)
    eager = eager_plan(g, "cpu")
    tight = Plan(**{**eager.__dict__, "budgets": {"cpu": eager.predicted.peak_bytes["cpu"] - 1}})
    with pytest.raises(PlanError, match="exceeds the budget") as e:
        run_plan(g, tight, env)
    assert e.value.device == "cpu" and e.value.step == simulate(g, eager).peak_step["cpu"]
    other = Plan("0" * 32, {}, homes, (), SolveResult("bad", "heuristic"))
    with pytest.raises(PlanError, match="plan is for graph"):
        run_plan(g, other, env)
    missing = dict(env)
    missing.pop("input:0")
    with pytest.raises(XschedError, match="no tensor given") as e:
        run_plan(g, eager_plan(g, "cpu"), missing)
    assert e.value.value == "input:0"


def test_logical_device_names_map_to_torch_devices():
    assert reference.torch_device("sim:h100") == torch.device("cpu")
    assert reference.torch_device("dev") == torch.device("cpu")
    assert reference.torch_device("cuda:1") == torch.device("cuda:1")
    assert reference.torch_device("gpu0", {"gpu0": "cuda:0"}) == torch.device("cuda:0")


@pytest.mark.gpu
def test_cpu_cuda_plan_matches_eager():
    model, inputs, g = _setup()
    tangents = _tangents()
    # logical names stay; the `devices` mapping puts cpu:1 on the GPU. Random ops stay on the CPU so they
    # draw from the same generator as eager.
    plan = _two_device_plan(g, random_on_home=True)
    torch.manual_seed(7)
    values = run_plan(g, plan, bind_inputs(g, model, inputs, tangents), devices={"cpu:0": "cpu", "cpu:1": "cuda:0"})
    outs, grads, buffers = _eager(model, inputs, tangents)
    got = unpack_outputs(g, {k: v.cpu() for k, v in values.items()})
    for a, b in zip(got.outputs, outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for k in grads:
        torch.testing.assert_close(got.grads[k], grads[k], rtol=1e-4, atol=1e-5)
    for k, b in got.buffers.items():
        torch.testing.assert_close(b, buffers[k], rtol=1e-4, atol=1e-5)


class DeadNoise(nn.Module):
    """Draws a dropout mask nobody uses before the one that matters: the RNG must still advance as in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        F.dropout(x, 0.5, self.training)
        return self.fc(F.dropout(x, 0.5, self.training))


def test_unused_random_op_keeps_eager_rng_order():
    torch.manual_seed(0)
    model, inputs = DeadNoise(), (torch.randn(5, 6),)
    g = capture(model, inputs)
    random_ops = [o for o in g.ops if reference.is_random(o)]
    assert len(random_ops) == 2 and all(o.phase == "fwd" for o in random_ops)
    assert not random_ops[0].outputs and random_ops[0].workspace_bytes == 5 * 6 * 4  # result unused: workspace
    torch.manual_seed(3)
    values = run_plan(g, eager_plan(g, "cpu"), bind_inputs(g, model, inputs))
    torch.manual_seed(3)
    assert torch.equal(unpack_outputs(g, values).outputs[0], copy.deepcopy(model)(*inputs))


def test_wrong_recorded_size_is_caught():
    """The interpreter checks every produced tensor against the graph's bytes (the memory model's ground truth)."""
    model, inputs, g = _setup()
    victim = g.ops[0].outputs[0]
    values = tuple(type(v)(**{**v.__dict__, "nbytes": v.nbytes + 4}) if v.id == victim else v for v in g.values)
    bad = dataclasses.replace(g, values=values)
    with pytest.raises(XschedError, match="the captured shape is wrong") as e:
        run_plan(bad, eager_plan(bad, "cpu"), bind_inputs(bad, model, inputs))
    assert e.value.value == victim and e.value.op == g.ops[0].id


class _TensorBytes(reference.ReferenceRun):
    """Counts the bytes of the tensors held in each store right after each compute (its inputs still there, its
    outputs made) and each copy: the memory rule measured on real tensors, independent of the interpreter's count."""

    def begin(self):
        self.held = {d: sum(t.numel() * t.element_size() for t in s.values()) for d, s in self.stores.items()}

    def _count(self, device):
        n = sum(t.numel() * t.element_size() for t in self.stores[device].values())
        self.held[device] = max(self.held[device], n)

    def on_compute(self, i, s, op):
        super().on_compute(i, s, op)
        self._count(s.device)

    def on_copy(self, i, s):
        super().on_copy(i, s)
        self._count(s.dst)


def test_peak_bytes_equal_the_tensors_held_while_computes_and_copies_run():
    model, inputs, g = _setup()
    assert all(o.workspace_bytes == 0 for o in g.ops)  # CPU captures: the tensors are the whole count
    for plan in (eager_plan(g, "cpu"), _two_device_plan(g)):
        torch.manual_seed(7)
        run = _TensorBytes(g, plan, bind_inputs(g, model, inputs, _tangents()), None)
        trace = run.run()
        assert trace.peak_bytes == run.held == simulate(g, plan).peak_bytes
