"""Where a compiled region over its budget is cut (xsched.execute.compiled_cuts), on hand-written wrappers of a
hand-built region: before the compute whose output makes the code's peak, else inside the kernel run at the peak,
the longest first part that fits; without code, before the compute with the highest per-op count."""

from __future__ import annotations

import torch

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Free
from xsched.execute.compiled_code import CodePeak, code_peak, code_peak_at
from xsched.execute.compiled_cuts import peak_cut

# inputs w, y, x (64 B each, resident before the region); every op's output 256 B
GRAPH = Graph.from_dict(
    {
        "schema": "xsched.graph/1",
        "name": "cuts",
        "values": [
            *({"id": v, "nbytes": 64, "kind": "input"} for v in ("w", "y", "x")),
            *({"id": v, "nbytes": 256} for v in "abcdef"),
        ],
        "ops": [
            {"id": "op0", "target": "f", "inputs": ["w"], "outputs": ["a"]},
            {"id": "op1", "target": "g", "inputs": ["a", "y"], "outputs": ["b"]},
            {"id": "op2", "target": "h", "inputs": ["b"], "outputs": ["c"]},
            {"id": "op3", "target": "k", "inputs": ["c", "x"], "outputs": ["d"]},
            {"id": "op4", "target": "m", "inputs": ["d"], "outputs": ["e"]},
            {"id": "op5", "target": "n", "inputs": ["e", "b"], "outputs": ["f"]},
        ],
        "outputs": ["b", "f"],
    }
)
STEPS = [
    Compute("op0", "cpu"),  # 0
    Compute("op1", "cpu"),  # 1
    Free("a", "cpu"),  # 2
    Compute("op2", "cpu"),  # 3
    Compute("op3", "cpu"),  # 4
    Free("c", "cpu"),  # 5
    Free("x", "cpu"),  # 6: an input the region lets go of
    Compute("op4", "cpu"),  # 7
    Free("d", "cpu"),  # 8
    Compute("op5", "cpu"),  # 9
    Free("e", "cpu"),  # 10
]
REGION = tuple(range(len(STEPS)))
NBYTES = {v.id: v.nbytes for v in GRAPH.values}
IO = (("w", "y", "x"), ("b", "f"))  # the region's inputs in order of first read; what it keeps, as returned
ARGS = [torch.empty(16) for _ in range(3)]  # 64 B each
DYING = [False, False, True]  # x is freed in the region

# the peak is the allocation of what op5 writes (f, returned second): 256 (b) + 256 (d) - 64 (x, deleted) + 256 (f)
PEAK_AT_AN_OUTPUT = """
def call(self, args):
    arg0_1, arg1_1, arg2_1 = args
    args.clear()
    buf0 = empty_strided_cpu((64, ), (1, ), torch.float32)
    cpp_fused_0(arg0_1, arg1_1, buf0)
    del arg0_1
    del arg1_1
    buf1 = empty_strided_cpu((64, ), (1, ), torch.float32)
    cpp_fused_1(buf0, arg2_1, buf1)
    del arg2_1
    buf2 = empty_strided_cpu((64, ), (1, ), torch.float32)
    cpp_fused_2(buf1, buf0, buf2)
    del buf1
    return (buf0, buf2, )
"""

# one kernel for op0..op3 (it reads w, y and x) peaks at a scratch buffer it frees: 256 (b) + 512 (scratch)
PEAK_IN_A_KERNEL = """
def call(self, args):
    arg0_1, arg1_1, arg2_1 = args
    args.clear()
    buf0 = empty_strided_cpu((64, ), (1, ), torch.float32)
    buf1 = empty_strided_cpu((128, ), (1, ), torch.float32)
    assert_size_stride(arg2_1, (16, ), (1, ), 'input')
    cpp_fused_0(arg0_1, arg1_1, arg2_1, buf0, buf1)
    del arg0_1
    del arg1_1
    del arg2_1
    del buf1
    buf2 = empty_strided_cpu((64, ), (1, ), torch.float32)
    cpp_fused_1(buf0, buf2)
    return (buf0, buf2, )
"""


def test_the_code_peak_says_what_it_allocated_and_read_there_counted_by_hand() -> None:
    at = code_peak_at(PEAK_AT_AN_OUTPUT, ARGS, DYING)
    assert at == CodePeak(256 + 256 - 64 + 256, frozenset({0, 1, 2}), frozenset({0, 1}), 1, frozenset())
    assert code_peak(PEAK_AT_AN_OUTPUT, ARGS, DYING) == at.bytes
    at = code_peak_at(PEAK_IN_A_KERNEL, ARGS, DYING)
    # b allocated before the peak, f after; nothing deleted yet; the kernel after the peak reads all three inputs
    assert at == CodePeak(256 + 512, frozenset(), frozenset({0}), None, frozenset({0, 1, 2}))


def test_a_region_is_cut_before_the_compute_whose_output_makes_its_peak() -> None:
    at = code_peak_at(PEAK_AT_AN_OUTPUT, ARGS, DYING)
    assert peak_cut(GRAPH, STEPS, NBYTES, REGION, IO, at) == 9  # op5, which writes f
    tried: list[int] = []
    assert peak_cut(GRAPH, STEPS, NBYTES, REGION, IO, at, lambda c: tried.append(c) or True) == 9
    assert tried == [9]  # one candidate, and its first part fits: one cut


def test_a_peak_inside_a_kernel_is_cut_at_its_latest_compute_whose_first_part_fits() -> None:
    """The kernel at the peak reads w (op0), y (op1) and x (op3): the cut goes inside it, before op3 or op1 (never
    before the region's first compute), the latest whose part before fits (by `fits`, here a hand table)."""
    at = code_peak_at(PEAK_IN_A_KERNEL, ARGS, DYING)
    for fitting, want, want_tried in (({4, 1}, 4, [4]), ({1}, 1, [4, 1]), (set(), 1, [4, 1])):
        tried: list[int] = []
        got = peak_cut(GRAPH, STEPS, NBYTES, REGION, IO, at, lambda c, f=fitting, t=tried: t.append(c) or c in f)
        assert (got, tried) == (want, want_tried)
    assert peak_cut(GRAPH, STEPS, NBYTES, REGION, IO, at) == 4  # nothing to try: the kernel's latest compute


def test_a_region_without_code_is_cut_before_its_highest_per_op_compute() -> None:
    """Bytes the plan counts during each compute, above the region's start, by hand: op0 256, op1 512, op2 512
    (a freed), op3 768, op4 704 (c and x freed: 768 - 256 - 64 + 256), op5 704 (d freed): op3 the most."""
    assert peak_cut(GRAPH, STEPS, NBYTES, REGION) == 4
    # the first compute is never the cut: a region whose most is at its start is cut after it
    assert peak_cut(GRAPH, STEPS, NBYTES, (0, 1)) == 1
