"""Hierarchical decomposition (HiREmate, on several devices): H-Partition into convex blocks level by level,
options per class of identical blocks (bottom blocks by the flat solvers, the others by the H-ILP over their
children's options), then the H-ILP of the whole graph under the real budgets, flattened into one plan.

| module | owns |
|---|---|
| `partition` | H-Partition on a DAG: dominator candidates, the greedy grouping, contraction, convexity |
| `hierarchy` | the blocks of a graph: forward partition level by level, backward ops assigned to blocks |
| `region` | a block as a problem: its sub-graph, profile and homes; the deferrable gradient ops |
| `canon` | canonical forms of blocks (classes of identical blocks) and their renaming |
| `menu` | options (a block's schedule summarised for the level above), translation, Pareto selection |
| `leaf` | options of bottom blocks from the flat solvers |
| `park` | with a store: blocks' park options, their pricing on the lanes, parked values' frees kept in the flat plan |
| `hindex`, `hilp`, `highs` | the H-ILP: index sets, model (built on the clock), its HiGHS run, extraction; plans without a solver |
| `upper` | options of blocks above the bottom from the H-ILP |
| `blocks` | each block's options, one solve per class of identical blocks, in a pool of worker processes |
| `solver` | `solve_hier`: the levels, the top H-ILP, the refinement |
"""

from xsched.solve.hier.solver import HierSettings, solve_hier

__all__ = ["HierSettings", "solve_hier"]
