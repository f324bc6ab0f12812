"""`--optimizer-split auto` (xsched.train.split_auto) on cpu:0 computing and cpu:1 holding the parameters, with
AdamW's rates given (not measured): it moves parameters where the budget leaves room and the host's AdamW is what
the step waits for, none where nothing fits; the plan it keeps fits its budget with the moved state beside it (the
simulator's peak plus the state counted by hand); training equals eager AdamW; a plan that does not fit halves the
allowance; and the one-line refusals."""

from __future__ import annotations

import dataclasses
import re

import pytest
from test_param_offload_modes import MLP, eager, offloaded
from torch.testing import assert_close

from xsched.capture.torch import capture
from xsched.cli import main
from xsched.contracts.plan import Plan
from xsched.errors import BudgetError, XschedError
from xsched.execute.param_home import param_homes
from xsched.pipeline import plan_profile
from xsched.simulate import simulate
from xsched.train import train
from xsched.train.checkpoint import read_checkpoint
from xsched.train.placement import numel
from xsched.train.plans import cached_plan
from xsched.train.split_auto import choose_auto

pytestmark = pytest.mark.usefixtures("one_thread")

SLOW_HOST = (1e6, 1e9)  # parameters/s: the host's update (66k parameters: 66 ms) dwarfs the modelled run
DEVICES = ["cpu:0", "cpu:1"]


@pytest.fixture
def mlp(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(MLP)
    return path


def mlp_graph(bf16: bool = False):
    """The graph `xsched train` captures of the MLP (the plan's graph: the fingerprints are compared)."""
    import torch

    ns: dict = {}
    exec(MLP, ns)
    model, (x, _), _, _ = ns["factory"]()
    if not bf16:
        return capture(model, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return capture(model.to(torch.bfloat16), (x,))


def moved_state_bytes(graph, plan: Plan) -> int:
    """AdamW's bytes beside each parameter homed on cpu:0, counted by hand: the two fp32 moments, and for a bf16
    weight its fp32 master and fp32 gradient buffer."""
    total = 0
    for v, d in plan.homes.items():
        value = graph.value[v]
        if d == "cpu:0" and value.kind == "param":
            n = numel(value.shape or ())
            total += n * (16 if value.nbytes == 2 * n else 8)
    return total


@pytest.mark.parametrize(("bf16", "delayed"), [(False, False), (True, True)])
def test_auto_moves_parameters_where_there_is_room_and_trains_like_eager_adamw(
    mlp, tmp_path, capfd, bf16, delayed
) -> None:
    """cpu:0 at 1 MiB leaves about 700 KiB beside the all-home plan's peak and the host is slow: auto moves some
    parameters, not all (the room is full), and says so; the simulator's peak of the plan kept plus the moved state
    fits the 1 MiB; 3 steps equal the eager rule's losses and weights (fp32, and bf16 with the delayed update)."""
    precision = "bf16" if bf16 else "fp32"
    config = offloaded(mlp, tmp_path, steps=3, precision=precision, delayed_update=delayed)
    config = dataclasses.replace(
        config,
        budgets={"cpu:0": "1MiB", "cpu:1": "1GiB"},
        optimizer_split="auto",
        adamw_rates=SLOW_HOST,
        checkpoint_dir=str(tmp_path / "ck"),
    )
    got = train(config)
    notice = [line for line in capfd.readouterr().err.splitlines() if "optimizer split auto" in line]
    assert len(notice) == 1 and "the room is full" in notice[0], notice
    plan = Plan.load(got.plan_path)
    on0 = [v for v, d in plan.homes.items() if v.startswith("param:") and d == "cpu:0"]
    on1 = [v for v, d in plan.homes.items() if v.startswith("param:") and d == "cpu:1"]
    assert on0 and on1, plan.homes
    share = float(re.search(r"share (\S+) of", notice[0]).group(1))
    assert 0 < share < 1
    graph = mlp_graph(bf16)
    assert graph.fingerprint == plan.graph
    profile = plan_profile(graph, DEVICES, "model", str(tmp_path / "cache"), stores=["cpu:1"])
    peak = simulate(graph, plan, profile).peak_bytes["cpu:0"]
    assert peak + moved_state_bytes(graph, plan) <= 2**20, (peak, moved_state_bytes(graph, plan))
    want, model, _ = eager(3, bf16=bf16, delayed=delayed)
    assert_close(got.losses, want, rtol=1e-5, atol=1e-6)
    ck = read_checkpoint(tmp_path / "ck", 3)
    for n, p in model.named_parameters():
        assert_close(ck["model"][n], p.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("budget", "rates", "why"),
    [
        ("280KiB", SLOW_HOST, "holds no group"),  # the all-home plan's peak is 279.03 KiB: no group fits beside it
        (
            "1MiB",
            (1e12, 1e9),
            "no group's move lowers the predicted step",
        ),  # room, but the device's update is slower than the host's
    ],
)
def test_auto_moves_nothing_where_nothing_fits_or_helps(mlp, tmp_path, capfd, budget, rates, why) -> None:
    """Nothing moves where the room beside the all-home plan holds no group, or where the host's AdamW is faster
    than the device's; the plan is the all-home one, and the notice says why."""
    config = offloaded(mlp, tmp_path, steps=1, optimizer_split="auto", adamw_rates=rates)
    got = train(dataclasses.replace(config, budgets={"cpu:0": budget, "cpu:1": "1GiB"}))
    err = capfd.readouterr().err
    assert "share 0 of cpu:0's budget, 0 of 10 parameters" in err and why in err, err
    plan = Plan.load(got.plan_path)
    assert all(d == "cpu:1" for v, d in plan.homes.items() if v.startswith("param:"))


def test_a_resumed_run_whose_auto_split_differs_continues_bit_for_bit(mlp, tmp_path, capfd) -> None:
    """bf16 with the delayed update: 2 steps with a slow host (parameters move), then resumed to 4 with a fast host
    (none move: the master weights and AdamW state come back from the checkpoint into the other homes) give the
    losses and weights of 4 steps straight."""
    config = offloaded(mlp, tmp_path, steps=4, precision="bf16", delayed_update=True, optimizer_split="auto")
    config = dataclasses.replace(config, budgets={"cpu:0": "1MiB", "cpu:1": "1GiB"}, adamw_rates=SLOW_HOST)
    whole = train(dataclasses.replace(config, checkpoint_dir=str(tmp_path / "a")))
    split = dataclasses.replace(config, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=2)
    first = train(dataclasses.replace(split, steps=2))
    second = train(dataclasses.replace(split, resume=True, adamw_rates=(1e12, 1e9)))
    shares = re.findall(r"optimizer split auto: share (\S+) of", capfd.readouterr().err)
    assert float(shares[1]) > 0 and float(shares[2]) == 0, shares
    assert first.losses + second.losses == whole.losses
    want, again = read_checkpoint(tmp_path / "a", 4), read_checkpoint(tmp_path / "b", 4)
    for name, t in want["model"].items():
        assert t.equal(again["model"][name]), name


def test_a_split_without_a_plan_halves_the_allowance(tmp_path) -> None:
    """The first re-solve is refused (as a plan over budget would be): the next split takes at most half the bytes
    of the first and is solved (then grown into the room its plan leaves); the split kept is one that was solved,
    better than nothing moved, and its plan fits with the state beside it (simulated)."""
    graph = mlp_graph()
    homes = param_homes(graph, "cpu:1")
    budgets = {"cpu:0": "1MiB", "cpu:1": "1GiB"}

    def solve(limits, placed):
        return cached_plan(graph, limits, DEVICES, "park", "model", None, tmp_path, print, ["cpu:1"], placed)

    asked: list[int] = []

    def refuse_first(limits, placed):
        asked.append(sum(1 for d in placed.values() if d == "cpu:0"))
        if len(asked) == 1:
            raise BudgetError("refused by the test", stage="solve", device="cpu:0")
        return solve(limits, placed)

    auto = choose_auto(graph, solve(budgets, homes), "cpu:0", "cpu:1", budgets, homes, SLOW_HOST, refuse_first)
    assert len(asked) >= 2 and 0 < asked[1] < asked[0], asked
    assert "no plan (refused by the test), halved" in auto.stopped, auto.stopped
    assert auto.step_s < auto.before_s and len(auto.split.params) in asked[1:]
    plan = auto.planned.plan
    peak = simulate(graph, plan, auto.planned.profile).peak_bytes["cpu:0"]
    assert peak + moved_state_bytes(graph, plan) <= 2**20


def test_auto_with_no_parameter_on_the_home_is_one_line(tmp_path) -> None:
    """A plan whose parameters all live on cpu:0 has none on cpu:1 to move."""
    graph = mlp_graph()
    budgets = {"cpu:0": "1MiB", "cpu:1": "1GiB"}
    on0 = param_homes(graph, "cpu:0")

    def solve(limits, placed):
        return cached_plan(graph, limits, DEVICES, "park", "model", None, tmp_path, print, ["cpu:1"], placed)

    with pytest.raises(XschedError, match="no parameter with a gradient is homed on cpu:1, so none can move"):
        choose_auto(graph, solve(budgets, on0), "cpu:0", "cpu:1", budgets, on0, SLOW_HOST, solve)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--optimizer-split", "auto"], r"^xsched.*--optimizer-split auto needs --param-home"),
        (
            ["--optimizer-split", "auto", "--param-home", "cpu:0"],
            r"--optimizer-split auto: no parameter can move, no device computes but --param-home cpu:0",
        ),
        (["--optimizer-split", "half", "--param-home", "cpu:1"], r"in \(0, 1\) or auto, got half"),
        (["--optimizer-split", "1.5", "--param-home", "cpu:1"], r"in \(0, 1\) or auto, got 1.5"),
    ],
)
def test_bad_auto_flags_are_one_line_and_exit_2(mlp, tmp_path, capsys, extra, message) -> None:
    args = [f"{mlp}:factory", "--budget", "cpu:0=1MiB", "--budget", "cpu:1=1GiB", "--store", "cpu:1"]
    args += ["--profile", "model", "--cache-dir", str(tmp_path / "cache"), *extra]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_the_setup_bench_prints_each_split_and_its_predicted_step(tmp_path) -> None:
    """scripts/bench_setup_plan.py --split on the MLP priced on the H100 spec: no split moves nothing; auto with a
    slow host moves some parameters and predicts a shorter step than no split."""
    import sys

    from train_support import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_setup_plan as bench

    from xsched.solve import SolverOptions

    graph = mlp_graph()
    profile = plan_profile(graph, [bench.GPU, bench.HOST], "measure", str(tmp_path), stores=[bench.HOST])
    runs = {
        share: bench.split_once(graph, profile, "park", "1MiB", share, SLOW_HOST, SolverOptions(time_limit_s=10))
        for share in ("0", "0.3", "auto")
    }
    step = {k: float(re.search(r"predicted step (\S+) ms", v).group(1)) for k, v in runs.items()}
    assert runs["0"].startswith("share 0.000, 0 parameters moved"), runs
    assert re.match(r"share 0\.[1-9]\d*, [1-9]\d* parameters moved", runs["auto"]) and "stopped: " in runs["auto"]
    assert step["auto"] < step["0"] and step["auto"] <= step["0.3"], runs
