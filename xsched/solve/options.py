"""Options of the MILP solver: which Pyomo solver, its limits, and the objective's energy terms."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SolverOptions:
    """How `solve_milp` runs. Times in seconds, energies in joules."""

    solver: str = "highs"  # any Pyomo solver name: "highs" (appsi_highs), "gurobi", "cbc", ... when installed
    time_limit_s: float | None = 60.0
    mip_gap: float = 1e-4  # relative gap
    threads: int | None = None
    alpha_energy: float = 0.0  # objective = time + alpha * energy
    energy_cap_j: float | None = None
    fix_homes: bool = True  # False: the solver picks params' home devices
    verbose: bool = False
