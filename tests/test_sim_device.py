"""Simulated devices: spec files, the roofline against hand-computed numbers, instances and copy links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.profile import Profile
from xsched.devices import DeviceError, get_device
from xsched.devices.energy import modelled_energy
from xsched.devices.spec import all_specs, load_spec, spec_files

SHIPPED = {
    "h100-sxm",
    "h200",
    "a100-40gb",
    "rtx4090",
    "l4",
    "t4",
    "xeon-8480",
    "iris-xe-max",
    "i9-10920x",
    "uhd-p630",
    "xeon-e2176g",
}


def mm_graph(m: int, k: int, n: int, dtype: str = "float32", call: bool = True) -> Graph:
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    values = (
        Value("a", m * k * size, "input", (m, k), dtype),
        Value("b", k * n * size, "param", (k, n), dtype),
        Value("c", m * n * size, "activation", (m, n), dtype),
    )
    enc = {"args": [{"ref": "a"}, {"ref": "b"}], "kwargs": {}, "outs": [[]]} if call else None
    return Graph("mm", values, (Op("op0", "aten.mm.default", ("a", "b"), ("c",), call=enc),), ("c",))


def sim_time(device: str, g: Graph) -> float:
    return get_device(device).measure_op(g, g.op["op0"]).time_s


def test_every_spec_ships_and_cites_its_source():
    files = spec_files()
    assert SHIPPED <= set(files)
    for name in SHIPPED:
        text = files[name].read_text()
        assert re.search(r"^#.*(Source|ARK|datasheet).*", text, re.M | re.I), name
        assert re.search(r"^#.*https?://", text, re.M), f"{name}: no source URL in a comment"
        spec = load_spec(name)
        assert spec.peak("float32") > 0 and spec.memory_bandwidth > 0 and spec.max_power_w > spec.idle_power_w >= 0


def test_matmul_matches_the_hand_computed_roofline():
    m, k, n = 4096, 4096, 4096  # compute-bound on an H100: 2mnk / 67 TFLOP/s
    flops, nbytes = 2 * m * n * k, 4 * (m * k + k * n + m * n)
    expect = max(flops / 67e12, nbytes / 3.35e12) + 5e-6
    m_ = get_device("sim:h100").measure_op(mm_graph(m, k, n), mm_graph(m, k, n).op["op0"])
    assert m_.flops == flops and m_.time_s == pytest.approx(expect) and m_.energy_source == "model"
    m, k, n = 8192, 8, 8192  # memory-bound: bytes / 3.35 TB/s
    flops, nbytes = 2 * m * n * k, 4 * (m * k + k * n + m * n)
    assert nbytes / 3.35e12 > flops / 67e12
    assert sim_time("sim:h100", mm_graph(m, k, n)) == pytest.approx(nbytes / 3.35e12 + 5e-6)


def test_dtype_picks_the_peak_and_unlisted_dtypes_run_at_float32():
    g = mm_graph(4096, 4096, 4096, "bfloat16")
    assert sim_time("sim:h100", g) == pytest.approx(2 * 4096**3 / 989e12 + 5e-6, rel=1e-6)
    assert "bfloat16" not in load_spec("t4").peak_flops
    assert sim_time("sim:t4", g) == pytest.approx(2 * 4096**3 / 8.1e12 + 5e-6, rel=1e-6)


def test_time_is_monotone_in_size():
    times = [sim_time("sim:a100", mm_graph(s, s, s)) for s in (1, 8, 64, 256, 1024, 2048, 4096)]
    assert times == sorted(times) and times[0] == pytest.approx(5e-6, rel=0.01)


def test_energy_is_power_times_time_at_roofline_utilisation():
    dev = get_device("sim:l4")
    g = mm_graph(2048, 2048, 2048)
    m = dev.measure_op(g, g.op["op0"])
    busy = m.time_s - dev.spec.launch_overhead_s
    assert m.energy_j == pytest.approx(modelled_energy(m.time_s, dev.spec.power, busy / m.time_s))


def test_ops_without_a_call_get_a_bandwidth_only_roofline():
    g = mm_graph(1024, 1024, 1024, call=False)
    m = get_device("sim:h100").measure_op(g, g.op["op0"])
    assert m.flops == 0.0 and m.time_s == pytest.approx(3 * 1024 * 1024 * 4 / 3.35e12 + 5e-6)


def test_an_input_read_through_a_view_counts_the_bytes_the_view_exposes():
    # a chunked loss's log_softmax reads one row block of the logits: 1/8 of them, not all (hand count)
    rows, vocab = 8192, 50257
    values = (
        Value("x", rows * vocab * 4, "input", (rows, vocab), "float32"),
        Value("y", rows // 8 * vocab * 4, "activation", (rows // 8, vocab), "float32"),
    )
    block = {"ref": "x", "view": [["aten.slice.Tensor", [0, 1024, 2048]]]}
    call = {"args": [block, 1, False], "kwargs": {}, "outs": [[]]}
    g = Graph("chunk", values, (Op("op0", "aten._log_softmax.default", ("x",), ("y",), call=call),), ("y",))
    assert sim_time("sim:h100", g) == pytest.approx(2 * 1024 * vocab * 4 / 3.35e12 + 5e-6)
    # read whole by a second ref: all of it counts
    both = {**call, "args": [[block, {"ref": "x"}], 0]}
    g2 = Graph("both", values, (Op("op0", "aten.cat.default", ("x",), ("y",), call=both),), ("y",))
    assert get_device("sim:h100").measure_op(g2, g2.op["op0"]).time_s == pytest.approx(
        (rows * vocab * 4 + rows // 8 * vocab * 4) / 3.35e12 + 5e-6
    )
    # a transposed operand is read whole, and an expanded one no more than its base
    t = mm_graph(2048, 8, 2048)
    t_call = {"args": [{"ref": "a"}, {"ref": "b", "view": [["aten.t.default", []], ["aten.t.default", []]]}]}
    t = Graph(
        "mm",
        t.values,
        (Op("op0", "aten.mm.default", ("a", "b"), ("c",), call={**t_call, "kwargs": {}, "outs": [[]]}),),
        ("c",),
    )
    assert sim_time("sim:h100", t) == pytest.approx(sim_time("sim:h100", mm_graph(2048, 8, 2048)))
    e_values = (
        Value("r", 4 * 2048, "input", (1, 2048), "float32"),
        Value("o", 4 * 2048 * 2048, "activation", (2048, 2048), "float32"),
    )
    e_call = {"args": [{"ref": "r", "view": [["aten.expand.default", [[2048, 2048]]]]}], "kwargs": {}, "outs": [[]]}
    e = Graph("exp", e_values, (Op("op0", "aten.clone.default", ("r",), ("o",), call=e_call),), ("o",))
    assert sim_time("sim:h100", e) == pytest.approx((4 * 2048 + 4 * 2048 * 2048) / 3.35e12 + 5e-6)


def test_instances_share_a_spec_and_talk_over_the_peer_link():
    a, b, c = get_device("sim:h100"), get_device("sim:h100#1"), get_device("sim:a100")
    assert a.name != b.name and a.fingerprint == b.fingerprint != c.fingerprint
    assert (a.instance, b.instance) == (0, 1) and a.spec.name == "h100-sxm"
    n = 1 << 30
    assert a.copy_seconds(b, n, outgoing=True) == pytest.approx(5e-6 + n / 450e9)
    staged = a.copy_seconds(c, n, outgoing=True)
    assert staged == pytest.approx(10e-6 + n / 64e9 + 10e-6 + n / 32e9)  # through host memory, both PCIe links
    cpu = get_device("cpu")
    assert a.copy_seconds(cpu, n, outgoing=True, pinned=True) == pytest.approx(10e-6 + n / 64e9)
    assert a.copy_seconds(cpu, n, outgoing=False, pinned=False) == pytest.approx(10e-6 + n / 25e9)
    xeon = get_device("sim:xeon")
    assert xeon.copy_seconds(a, n, outgoing=True) == pytest.approx(10e-6 + n / 64e9)  # the GPU's link
    assert xeon.copy_seconds(cpu, n, outgoing=True) == pytest.approx(1e-6 + n / 153.6e9)  # a host memcpy


def test_bad_sim_names_and_specs(tmp_path):
    with pytest.raises(DeviceError, match="no device spec named 'h999'.*h100-sxm"):
        get_device("sim:h999")
    with pytest.raises(DeviceError, match="needs a spec"):
        get_device("sim:")
    with pytest.raises(DeviceError, match="instance after '#'"):
        get_device("sim:h100#x")
    bad = tmp_path / "bad.toml"
    bad.write_text(
        'kind = "gpu"\nmemory_bytes = 1\n[peak_flops]\nfloat32 = 1e12\n[link]\nbandwidth = 1e9\nlatency_s = 0\n'
    )
    with pytest.raises(DeviceError, match="lacks field 'memory_bandwidth'"):
        get_device(f"sim:{bad}")
    bad.write_text('kind = "gpu"\n[peak_flops]\nfloat16 = 1e12\n[link]\n')
    with pytest.raises(DeviceError, match="lacks peak_flops.float32"):
        get_device(f"sim:{bad}")
    bad.write_text("name = [unclosed\n")
    with pytest.raises(DeviceError, match="cannot read device spec"):
        get_device(f"sim:{bad}")


def test_spec_from_a_path_and_from_the_search_path(tmp_path, monkeypatch):
    text = load_spec("t4").path
    spec = tmp_path / "mygpu.toml"
    spec.write_text(open(text).read().replace('name = "t4"', 'name = "mygpu"'))
    assert get_device(f"sim:{spec}").spec.name == "mygpu"
    monkeypatch.setenv("XSCHED_DEVICES_PATH", str(tmp_path))
    assert get_device("sim:mygpu").spec.peak("float32") == 8.1e12
    assert "mygpu" in all_specs()
    (tmp_path / "broken.toml").write_text("kind = \n")
    assert "broken" not in all_specs() and "mygpu" in all_specs()  # one broken file does not hide the others
    with pytest.raises(DeviceError, match="broken.toml"):
        get_device("sim:broken")


def test_a_devices_folder_in_the_working_directory_comes_before_the_packaged_specs(tmp_path, monkeypatch):
    monkeypatch.delenv("XSCHED_DEVICES_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    packaged = load_spec("t4")
    assert Path(packaged.path).parent.name == "specs"
    (tmp_path / "devices").mkdir()
    edited = open(packaged.path).read().replace("8.1e12", "9.9e12")
    assert edited != open(packaged.path).read()
    (tmp_path / "devices" / "t4.toml").write_text(edited)
    assert get_device("sim:t4").spec.peak("float32") == 9.9e12  # the user's edited copy wins
    assert Path(load_spec("t4").path) == tmp_path / "devices" / "t4.toml"
    assert Path(load_spec("l4").path).parent.name == "specs"  # the rest still come from the package


def test_a_simulated_cpu_leaves_a_real_accelerator_link_to_its_plugin():
    from xsched.devices.base import Device
    from xsched.profiling.measure import copy_seconds

    class Accel(Device):
        kind = "accel"
        memory_bytes = 1
        description = "a real accelerator"

        def fingerprint_parts(self):
            return {}

        def measure_op(self, graph, op, policy=None):
            raise NotImplementedError

        def copy_seconds(self, other, nbytes, *, outgoing, pinned=True):
            return 1.0 + outgoing if other.is_host else None

    xeon, accel = get_device("sim:xeon"), Accel("accel:0")
    assert xeon.is_host and not accel.is_host and not get_device("sim:t4").is_host
    assert copy_seconds(xeon, accel, 10) == 1.0 and copy_seconds(accel, xeon, 10) == 2.0
    with pytest.raises(DeviceError, match="neither the accel nor the accel plugin"):
        copy_seconds(accel, Accel("accel:1"), 10)


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_the_checkouts_devices_folder_holds_the_measured_machines(gpu, monkeypatch):
    """devices/ at the checkout's root is found from there (and through XSCHED_DEVICES_PATH from anywhere); its
    measured specs agree with the profiles and link fits they cite (benchmarks/gpu/)."""
    import gzip
    import json

    monkeypatch.delenv("XSCHED_DEVICES_PATH", raising=False)
    monkeypatch.chdir(ROOT)
    spec = get_device(f"sim:{gpu}-measured").spec
    assert Path(spec.path) == ROOT / "devices" / f"{gpu}-measured.toml"
    assert Path(load_spec("h100").path).parent.name == "specs"  # the package's own still found beside them
    with gzip.open(ROOT / "benchmarks" / "gpu" / f"gpt2-full_n_layer6.{gpu}.profile.json.gz", "rt") as f:
        profile = json.load(f)
    assert spec.memory_bytes == profile["devices"]["cuda:0"]["memory_bytes"]
    links = [c["bytes_per_s"] for c in profile["copy"].values()]
    # the H100 profile holds its fitted links; the H200's were fitted separately (README: 56.4-58.6 GB/s)
    slowest = min(links) if links else 56.4e9
    assert spec.link_bandwidth == pytest.approx(slowest, rel=0.01)
    monkeypatch.chdir(ROOT / "benchmarks")
    assert f"{gpu}-measured" not in spec_files()
    monkeypatch.setenv("XSCHED_DEVICES_PATH", str(ROOT / "devices"))
    assert spec_files()[f"{gpu}-measured"] == ROOT / "devices" / f"{gpu}-measured.toml"


def test_a_loss_reads_the_rows_its_targets_pick_and_its_backward_only_the_shape():
    n, v = 8192, 50257
    values = (
        Value("x", n * v * 4, "input", (n, v), "float32"),
        Value("t", n * 8, "input", (n,), "int64"),
        Value("loss", 4, "activation", (), "float32"),
        Value("w0", 4, "activation", (), "float32"),
        Value("w", 4, "input", (), "float32"),
        Value("g", 4, "input", (), "float32"),
        Value("dx", n * v * 4, "activation", (n, v), "float32"),
    )
    fwd = {"args": [{"ref": "x"}, {"ref": "t"}, None, 1, -100], "kwargs": {}, "outs": [[], []]}
    bwd = {"args": [{"ref": "g"}, {"ref": "x"}, {"ref": "t"}, None, 1, -100, {"ref": "w"}], "kwargs": {}, "outs": [[]]}
    ops = (
        Op("op0", "aten.nll_loss_forward.default", ("x", "t"), ("loss", "w0"), call=fwd),
        Op("op1", "aten.nll_loss_backward.default", ("g", "x", "t", "w"), ("dx",), call=bwd),
    )
    g = Graph("nll", values, ops, ("loss", "w0", "dx"))
    h100 = get_device("sim:h100")
    # one float32 per target picked, the targets, the two scalars out
    assert h100.measure_op(g, g.op["op0"]).time_s == pytest.approx((n * 4 + n * 8 + 8) / 3.35e12 + 5e-6)
    # the gradient written whole; of `x` only its shape is used
    assert h100.measure_op(g, g.op["op1"]).time_s == pytest.approx((4 + n * 8 + 4 + n * v * 4) / 3.35e12 + 5e-6)


def h100_stored(name: str) -> tuple[Graph, Profile]:
    """GPT-2 (6 layers, b8, T1024) as the H100 ran it on 2026-11-27, and its measured profile (benchmarks/gpu/;
    `name`: "" for the loss whole, "-chunk8" for it in 8 row blocks)."""
    stem = ROOT / "benchmarks" / "gpu" / f"gpt2-full_n_layer6{name}.h100-20261127"
    return Graph.load(f"{stem}.graph.json.gz"), Profile.load(f"{stem}.profile.json.gz")


def test_masked_fill_and_layer_norm_backward_pass_twice_over_what_their_kernels_read_again():
    """masked_fill (out of place) is ATen's clone, then a fill in place: the output is read and written again. The
    layer norm backward's weight and bias gradients come from a second kernel that reads the output's gradient and
    the input again; without those gradients (its output mask) there is no second kernel."""
    b, t, c = 4, 1024, 768
    big, mask, stats, w = b * t * c * 4, t * c, b * t * 4, c * 4
    values = (
        Value("s", big, "input", (b, t, c), "float32"),
        Value("m", mask, "input", (t, c), "bool"),
        Value("f", big, "activation", (b, t, c), "float32"),
        Value("dy", big, "input", (b, t, c), "float32"),
        Value("x", big, "input", (b, t, c), "float32"),
        Value("mean", stats, "input", (b, t, 1), "float32"),
        Value("rstd", stats, "input", (b, t, 1), "float32"),
        Value("w", w, "input", (c,), "float32"),
        Value("bias", w, "input", (c,), "float32"),
        Value("dx", big, "activation", (b, t, c), "float32"),
        Value("dw", w, "activation", (c,), "float32"),
        Value("db", w, "activation", (c,), "float32"),
    )

    def ln_call(out_mask: list[bool]) -> dict:
        refs = [{"ref": r} for r in ("dy", "x")] + [[c]] + [{"ref": r} for r in ("mean", "rstd", "w", "bias")]
        return {"args": [*refs, out_mask], "kwargs": {}, "outs": [[0], [1], [2]]}

    fill = {"args": [{"ref": "s"}, {"ref": "m"}, 0.0], "kwargs": {}, "outs": [[]]}
    ln_in = ("dy", "x", "mean", "rstd", "w", "bias")

    def graph(out_mask: list[bool]) -> Graph:
        ops = (
            Op("op0", "aten.masked_fill.Scalar", ("s", "m"), ("f",), call=fill),
            Op("op1", "aten.native_layer_norm_backward.default", ln_in, ("dx", "dw", "db"), call=ln_call(out_mask)),
        )
        return Graph("passes", values, ops, ("f", "dx", "dw", "db"))

    h100 = get_device("sim:h100")
    g = graph([True, True, True])
    # the clone: s read, f written; the fill: m and f read, f written
    assert h100.measure_op(g, g.op["op0"]).time_s == pytest.approx((big + mask + 3 * big) / 3.35e12 + 5e-6)
    once = 3 * big + 2 * stats + 4 * w  # dy, x and dx, the statistics, w, bias and their gradients, each once
    assert h100.measure_op(g, g.op["op1"]).time_s == pytest.approx((once + 2 * big) / 3.35e12 + 5e-6)
    g = graph([True, False, False])
    assert h100.measure_op(g, g.op["op1"]).time_s == pytest.approx(once / 3.35e12 + 5e-6)


def test_masked_fill_costs_what_the_h100_measured(monkeypatch):
    """GPT-2's attention masked_fill (forward and backward, 12 ops on [8, 12, 1024, 1024] scores) measured 6.93 ms
    on the H100 (benchmarks/gpu/, 2026-11-27); priced as one pass over its bytes the model gave 3.58 ms."""
    g, p = h100_stored("")
    monkeypatch.chdir(ROOT)
    sim = get_device("sim:h100-measured")
    fills = [o for o in g.ops if o.target == "aten.masked_fill.Scalar"]
    measured = sum(p.op_cost(o.id, "cuda:0").time_s for o in fills)
    assert len(fills) == 12 and measured == pytest.approx(6.93e-3, rel=0.01)
    assert sum(sim.measure_op(g, o).time_s for o in fills) == pytest.approx(measured, rel=0.1)


def test_a_row_block_costs_its_share_as_the_h100_measured(monkeypatch):
    """The H100 measured a chunked loss's log_softmax on one of 8 row blocks at 0.236 ms, the whole at 2.058 ms
    (benchmarks/gpu/, 2026-11-27): the model prices the block at its share too, not at the whole input's bytes."""

    def log_softmax(name: str) -> tuple[Graph, Op, float]:
        g, p = h100_stored(name)
        op = next(o for o in g.ops if o.target == "aten._log_softmax.default")
        return g, op, p.op_cost(op.id, "cuda:0").time_s

    monkeypatch.chdir(ROOT)
    sim = get_device("sim:h100-measured")
    (gw, w, w_s), (gb, b, b_s) = log_softmax(""), log_softmax("-chunk8")
    assert gb.value[b.inputs[0]].shape == gw.value[w.inputs[0]].shape  # the block reads a view of the whole
    assert b_s / w_s == pytest.approx(0.115, abs=0.01)
    assert sim.measure_op(gb, b).time_s / sim.measure_op(gw, w).time_s == pytest.approx(b_s / w_s, rel=0.25)


def test_a_simulated_gpu_types_its_graph_as_a_gpu(tmp_path):
    """What a what-if GPU is profiled on is the graph a GPU runs (fused dropout, one bool mask), a simulated CPU the
    CPU's; a name whose spec cannot be found says so before anything is captured."""
    from xsched.capture.torch import capture
    from xsched.cli import main
    from xsched.contracts.profile import Profile
    from xsched.devices.spec import target_device_type
    from xsched.zoo import build

    assert target_device_type(["cpu", "sim:h100"]) == target_device_type(["sim:l4#1"]) == "cuda"
    assert target_device_type(["cpu", "sim:xeon-8480"]) == target_device_type(["cpu:1"]) == "cpu"
    assert target_device_type(["cuda:1", "sim:xeon-8480"]) == "cuda"
    with pytest.raises(DeviceError, match="no device spec named 'h999'"):
        target_device_type(["cpu", "sim:h999"])
    out = tmp_path / "p.json"
    assert main(["profile", "zoo:gpt2", "--scale", "tiny", "--devices", "sim:h100", "-o", str(out)]) == 0
    z = build("gpt2", scale="tiny")
    for_gpu = capture(z.model, z.inputs, name="zoo:gpt2", device_type="cuda")
    assert Profile.load(out).graph == for_gpu.fingerprint
    assert any(op.target == "aten.native_dropout.default" for op in for_gpu.ops)
