"""Op encoding (xsched.contracts.torch_ops): JSON round-trips, running encoded ops, realistic random inputs, clear errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from xsched.capture import capture
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.random_ops import RANDOM_TARGETS, TABLE_NAMESPACES, is_random_target
from xsched.contracts.torch_ops import (
    decode,
    encode_literal,
    has_random_tag,
    is_executable,
    op_input_tensors,
    resolve,
    run_op,
)
from xsched.errors import CaptureError, XschedError


def _json(x):
    return json.loads(json.dumps(x, allow_nan=False))


@pytest.mark.parametrize(
    "x",
    [
        3,
        -2.5,
        True,
        None,
        "tanh",
        [1, [2, 3]],
        (4, 5),
        torch.Size([2, 3]),
        torch.float16,
        torch.int64,
        torch.strided,
        torch.channels_last,
        float("-inf"),
    ],
)
def test_literal_round_trip_through_json(x):
    back = decode(_json(encode_literal(x)), {}, torch.device("cpu"))
    want = list(x) if isinstance(x, (tuple, torch.Size)) else x
    assert back == want


def test_nan_and_device_and_constant_round_trip():
    assert math.isnan(decode(_json(encode_literal(float("nan"))), {}, torch.device("cpu")))
    # devices are rewritten to the device the op runs on
    assert decode(_json(encode_literal(torch.device("cuda", 1))), {}, torch.device("cpu")) == torch.device("cpu")
    c = torch.tensor([[1.5, -2.0], [0.25, 4.0]], dtype=torch.float64)
    back = decode(_json(encode_literal(c)), {}, torch.device("cpu"))
    assert torch.equal(back, c) and back.dtype == torch.float64


def test_large_constant_is_an_error():
    with pytest.raises(CaptureError, match="too large"):
        encode_literal(torch.zeros(1000))


def test_unencodable_argument_is_an_error():
    with pytest.raises(CaptureError, match="cannot encode"):
        encode_literal(object())


def _values(*specs):
    return tuple(Value(i, math.prod(s) * 4, k, s, "float32") for i, k, s in specs)


def test_run_op_applies_view_chain_and_picks_outputs():
    x = torch.randn(4, 6)
    w = torch.randn(3, 4)
    # mm(w, x[:, 2:5]) written as a ref into x with a folded slice
    call = {
        "args": [{"ref": "w"}, {"ref": "x", "view": [["aten.slice.Tensor", [1, 2, 5]]]}],
        "kwargs": {},
        "outs": [[]],
    }
    op = Op("o", "aten.mm.default", ("w", "x"), ("y",), call=_json(call))
    (y,) = run_op(op, {"x": x, "w": w})
    assert torch.equal(y, w @ x[:, 2:5])
    # multi-output op: var_mean returns (var, mean); keep only the mean
    call = {"args": [{"ref": "x"}, [1]], "kwargs": {"correction": 0}, "outs": [[1]]}
    op = Op("o2", "aten.var_mean.correction", ("x",), ("m",), call=call)
    (m,) = run_op(op, {"x": x})
    assert torch.equal(m, torch.var_mean(x, 1, correction=0)[1])


def test_run_op_errors_name_the_op_and_value():
    op = Op("o", "aten.relu.default", ("x",), ("y",), call={"args": [{"ref": "x"}], "kwargs": {}, "outs": [[]]})
    with pytest.raises(XschedError, match="not available") as e:
        run_op(op, {})
    assert e.value.stage == "execute" and e.value.op == "o" and e.value.value == "x"
    bare = Op("b", "t.fwd", ("x",), ("y",))  # like an imported bench graph: no call
    assert not is_executable(bare)
    with pytest.raises(XschedError, match="no executable call") as e:
        run_op(bare, {"x": torch.ones(1)})
    assert e.value.stage == "execute" and e.value.op == "b"
    with pytest.raises(XschedError, match="unknown torch op"):
        resolve("aten.no_such_op.default")
    bad = Op(
        "c", "aten.mm.default", ("x",), ("y",), call={"args": [{"ref": "x"}, {"ref": "x"}], "kwargs": {}, "outs": [[]]}
    )
    with pytest.raises(XschedError, match="aten.mm.default failed") as e:
        run_op(bad, {"x": torch.ones(2, 3)})
    assert e.value.op == "c"


class _Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.out = nn.Linear(5, 11)

    def forward(self, idx, tgt):
        h = self.out(self.emb(idx))
        picked = torch.gather(h, 1, tgt.unsqueeze(1).clamp(max=4))
        return nn.functional.cross_entropy(h, tgt) + picked.mean()


def test_op_input_tensors_are_valid_for_indexing_ops():
    g = capture(_Emb(), (torch.randint(0, 7, (64,)), torch.randint(0, 11, (64,))))
    by_packet = {o.target.split(".")[1]: o for o in g.ops}
    checks = {
        "embedding": lambda o, t: t[o.inputs[1]].max() < 7,
        "embedding_dense_backward": lambda o, t: t[o.inputs[1]].max() < 7,
        "nll_loss_forward": lambda o, t: t[o.call["args"][1]["ref"]].max() < 11,
        "gather": lambda o, t: t[o.call["args"][2]["ref"]].max() < 11,
    }
    gen = torch.Generator().manual_seed(0)
    for packet, ok in checks.items():
        op = by_packet[packet]
        tensors = op_input_tensors(g, op, "cpu", gen)
        assert set(tensors) == set(op.inputs)
        ints = [t for t in tensors.values() if not t.is_floating_point()]
        assert ints and all(t.min() >= 0 for t in ints)
        assert ok(op, tensors), packet
        # indices must span more than one value (random, not constant)
        assert all(t.unique().numel() > 1 for t in ints)
        for t in tensors.values():
            if t.is_floating_point():
                assert t.abs().min() > 0 or (t != 0).float().mean() > 0.99
        run_op(op, tensors)  # valid inputs: the op runs


class _Bags(nn.Module):
    def __init__(self, mode: str, last: bool) -> None:
        super().__init__()
        self.bags, self.out = nn.EmbeddingBag(40, 6, mode=mode, include_last_offset=last), nn.Linear(6, 3)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.out(self.bags(indices, offsets))


@pytest.mark.parametrize(("mode", "last"), [("mean", False), ("sum", True), ("max", False)])
def test_op_input_tensors_run_embedding_bags_forward_and_backward(mode: str, last: bool):
    """An embedding bag's offsets must start at 0 and ascend (random ones were an error, so the op "could not run"
    on the CPU and the model could not be planned); its backward's bag of each index is a bag."""
    offsets = torch.arange(0, 33 if last else 32, 4)
    g = capture(_Bags(mode, last), (torch.randint(0, 40, (32,)), offsets))
    bag_ops = [op for op in g.ops if "embedding_bag" in op.target]
    assert len(bag_ops) == 2
    for seed in range(3):
        for op in bag_ops:
            tensors = op_input_tensors(g, op, "cpu", torch.Generator().manual_seed(seed))
            offs = tensors[op.call["args"][2]["ref"]]
            assert offs[0] == 0 and (offs.diff() >= 0).all() and offs.max() <= 32
            run_op(op, tensors)


def test_op_input_tensors_positive_variance_bool_masks_and_shapes():
    x = Value("x", 4 * 6 * 4, "input", (4, 6), "float32")
    var = Value("var", 6 * 4, "input", (6,), "float32")
    mask = Value("m", 24, "input", (4, 6), "bool")
    y = Value("y", 96, "activation", (4, 6), "float32")
    ops = (
        Op("o", "aten.rsqrt.default", ("var",), ("r",), call={"args": [{"ref": "var"}], "kwargs": {}, "outs": [[]]}),
        Op("w", "aten.where.self", ("m", "x"), ("y",), call={"args": [{"ref": "m"}, {"ref": "x"}, 0.0], "outs": [[]]}),
    )
    g = Graph("t", (x, var, mask, y, Value("r", 24, "activation", (6,), "float32")), ops, ("y", "r"))
    t = op_input_tensors(g, g.ops[0], "cpu")
    assert (t["var"] > 0).all()
    t = op_input_tensors(g, g.ops[1], "cpu")
    assert t["m"].dtype == torch.bool and 0 < t["m"].sum() < t["m"].numel()
    assert t["x"].shape == (4, 6) and t["x"].std() > 0.5
    # the same generator seed gives the same inputs (profiles are reproducible)
    a = op_input_tensors(g, g.ops[1], "cpu", torch.Generator().manual_seed(5))
    b = op_input_tensors(g, g.ops[1], "cpu", torch.Generator().manual_seed(5))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_op_input_tensors_rejects_non_executable_op():
    g = Graph("t", (Value("x", 4, "input"), Value("y", 4)), (Op("o", "t.fwd", ("x",), ("y",)),), ("y",))
    with pytest.raises(XschedError, match="no executable call"):
        op_input_tensors(g, g.ops[0], "cpu")


def test_op_input_tensors_are_made_on_the_device(monkeypatch):
    """On "meta" nothing is drawn (shapes and dtypes only); elsewhere a generator of another device is replaced by
    one on the target device with its seed (a GPU's inputs were drawn on the host and copied: seconds per op)."""
    g = capture(_Emb(), (torch.randint(0, 7, (64,)), torch.randint(0, 11, (64,))))
    op = next(o for o in g.ops if o.target.split(".")[1] == "embedding")
    drawn = []
    monkeypatch.setattr(torch, "randn", lambda *a, **k: drawn.append(a))
    meta = op_input_tensors(g, op, "meta")
    assert not drawn and all(t.device.type == "meta" for t in meta.values())
    assert {k: (tuple(t.shape), str(t.dtype)) for k, t in meta.items()} == {
        v: (tuple(g.value[v].shape), f"torch.{g.value[v].dtype}") for v in op.inputs
    }
    monkeypatch.undo()
    a = op_input_tensors(g, op, "cpu", torch.Generator().manual_seed(3))
    b = op_input_tensors(g, op, torch.device("cpu"), torch.Generator().manual_seed(3))
    assert all(torch.equal(a[k], b[k]) for k in a)


def _tagged_random_targets() -> set[str]:
    """Every op of the table's namespaces that torch tags nondeterministic_seeded, read from torch's registry."""
    import torch._prims.rng_prims  # noqa: F401  registers prims and rngprims (Python-defined ops)

    found = set()
    for full in torch._C._dispatch_get_all_op_names():
        ns, _, rest = full.partition("::")
        if ns not in TABLE_NAMESPACES:
            continue
        name, _, overload = rest.partition(".")
        if ns == "aten":  # thousands of ops: the registry's own lookup, without building each OpOverload
            found_op = torch._C._get_operation_overload(full.partition(".")[0], overload)
            tags = found_op[2] if found_op is not None else ()
        else:  # Python-defined ops keep their tags on the OpOverload
            tags = getattr(getattr(getattr(torch.ops, ns), name), overload or "default").tags
        if torch.Tag.nondeterministic_seeded in tags:
            found.add(f"{ns}.{name}.{overload or 'default'}")
    return found


def test_random_op_table_is_what_torch_tags():
    """The table that lets planning skip torch equals torch's own tags, so it cannot drift from them."""
    # inductor registers its own seed ops (prims.inductor_*) when it loads; captured graphs never hold them
    assert RANDOM_TARGETS == {t for t in _tagged_random_targets() if not t.startswith("prims.inductor_")}
    assert all(is_random_target(t) == has_random_tag(t) for t in ("aten.native_dropout.default", "aten.mm.default"))
    assert not is_random_target("onnx::Dropout")
