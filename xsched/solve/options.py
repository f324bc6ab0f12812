"""Options of every solver: which Pyomo solver, its limits, the objective's energy terms and the HiGHS search knobs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SolverOptions:
    """How a solver runs. Times in seconds (`time_limit_s`: the whole solve, for `auto` too), energies in joules."""

    solver: str = "highs"  # any Pyomo solver name: "highs" (appsi_highs), "gurobi", "cbc", ... when installed
    time_limit_s: float | None = 60.0
    # HiGHS's branch-and-bound nodes per run (stage MILP): with one thread and no time limit, a deterministic stop
    node_limit: int | None = None
    mip_gap: float = 1e-4  # relative gap
    solver_threads: int | None = None  # threads of HiGHS and CP-SAT (None: the solver's default)
    alpha_energy: float = 0.0  # objective = time + alpha * energy
    energy_cap_j: float | None = None
    fix_homes: bool = True  # False: the solver picks params' home devices
    verbose: bool = False
    seed: int = 0  # CP-SAT's random seed (one worker: a run is deterministic for a seed); park-search's draws
    hier_processes: int | None = None  # hier: processes solving independent blocks (None: the core count)
    hier_refine: bool = True  # hier: CP-SAT refines its plan in the time left (auto: off, its portfolio follows)
    # stage MILP on HiGHS: LP-guided restricted searches before the full one, as (producer levels around the LP's
    # recomputes, share of the time left); () searches the full model only
    restricted: tuple[tuple[int, float], ...] = ((0, 0.25), (1, 0.5))
    lp_share: float = 0.25  # share of the time left for the LP relaxation guiding the restricted searches (0: none)


DEFAULTS = SolverOptions()  # frozen: the one shared default of every solver's `options`
