"""Every zoo model at scale "tiny": capture, run the eager plan with the reference interpreter, compare with eager PyTorch."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from oracle import assert_run_counts

from xsched import zoo
from xsched.capture import bind_inputs, capture, unpack_outputs
from xsched.contracts.graph import Graph
from xsched.execute import execute
from xsched.solve.reference import eager_plan


@pytest.mark.parametrize("name", zoo.names())
def test_zoo_model_captures_and_reproduces_eager(name):
    z = zoo.build(name, scale="tiny")
    captured = capture(z.model, z.inputs, name=name)
    # run what the JSON says, strict JSON (no NaN/Infinity literals): the file alone must be executable
    g = Graph.from_dict(json.loads(json.dumps(captured.to_dict(), allow_nan=False)))
    assert g.fingerprint == captured.fingerprint
    phases = [o.phase for o in g.ops]
    assert phases.count("bwd") > 0 and "bwd" not in phases[: phases.index("bwd")]
    # dropout shows up as RNG ops and train-mode batch norm as running-stat updates, exactly when the model has them
    mods = list(z.model.modules())
    dropout = any(
        getattr(m, "p", getattr(m, "dropout", 0))
        for m in mods
        if "Dropout" in type(m).__name__ or "MultiheadAttention" in type(m).__name__
    )
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in mods)
    assert any(o.target == "aten.bernoulli.p" for o in g.ops) == dropout
    bn_stats = {
        k
        for k, _ in z.model.named_buffers()
        if k.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")
    }
    assert set(g.buffer_updates) == bn_stats and bool(bn_stats) == has_bn

    ref = copy.deepcopy(z.model)
    torch.manual_seed(11)
    outs = ref(*z.inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(3)
    tangents = tuple(torch.randn(o.shape, generator=gen) if o.requires_grad else None for o in outs)
    torch.autograd.backward([o for o in outs if o.requires_grad], [t for t in tangents if t is not None])

    plan = eager_plan(g, "cpu")
    torch.manual_seed(11)
    trace = execute(g, plan, bind_inputs(g, z.model, z.inputs, tangents))
    got = unpack_outputs(g, trace.outputs)
    assert_run_counts(g, plan, trace.resident_after, trace.peak_bytes)  # independent counts

    tol = {"rtol": 1e-5, "atol": 1e-6}
    assert len(got.outputs) == len(outs)
    for a, b in zip(got.outputs, outs):
        torch.testing.assert_close(a, b, **tol)
    params = dict(ref.named_parameters())
    assert set(got.grads) == {k for k, p in params.items() if p.grad is not None}
    for k, gr in got.grads.items():
        torch.testing.assert_close(gr, params[k].grad, **tol, msg=lambda m, k=k: f"grad of {k}: {m}")
    buffers = dict(ref.named_buffers())
    for k, b in got.buffers.items():
        torch.testing.assert_close(b, buffers[k], **tol, msg=lambda m, k=k: f"buffer {k}: {m}")
    # buffers the graph does not update are unchanged by eager too (e.g. causal masks)
    for k, b in dict(z.model.named_buffers()).items():
        if k not in got.buffers:
            assert torch.equal(b, buffers[k]), k
