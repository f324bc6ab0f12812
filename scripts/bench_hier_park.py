"""Time-to-plan and predicted makespan of `park` against `hier` (with park options) on a GPT-2 training graph with
the measured H100 spec (the sim plugin) and the host as a store holding the parameters, at tight GPU budgets (issue 30 item 4).

    python scripts/bench_hier_park.py [--scale small:n_layer=48,n_embd=256] [--batch 2] [--budgets 30,20]
        [--time-limit 900]

Each row: the method, the budget (share of the eager peak), seconds to plan (wall, in this process), the plan's
predicted makespan and peak on the GPU, or its error."""

from __future__ import annotations

import argparse
import copy
import time

from xsched import zoo
from xsched.capture.torch import capture
from xsched.errors import XschedError
from xsched.profiling.measure import profile_graph
from xsched.solve import SolverOptions, eager_peak, solve
from xsched.solve.hier import solve_hier
from xsched.solve.problem import Problem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="small:n_layer=48,n_embd=256,dropout=0.0")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--budgets", default="30,20", help="GPU budgets in %% of the eager peak")
    ap.add_argument("--methods", default="park,hier")
    ap.add_argument("--time-limit", type=float, default=900.0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    z = zoo.build("gpt2", batch=args.batch, scale=args.scale)
    g = capture(copy.deepcopy(z.model), z.inputs, name="gpt2")
    t1 = time.perf_counter()
    prof = profile_graph(g, ["sim:h100-measured"], stores=["cpu"])
    t2 = time.perf_counter()
    dev = next(d for d in prof.devices if d != "cpu")
    peak = eager_peak(g)
    print(
        f"{args.scale} batch {args.batch}: {len(g.ops)} ops, eager peak {peak / 2**20:.1f} MiB; capture {t1 - t0:.1f} s, "
        f"profile {t2 - t1:.1f} s",
        flush=True,
    )
    # --param-home cpu: parameters and buffers live on the host (the store), fetched for their reads
    homes = {v: "cpu" if g.value[v].kind in ("param", "buffer") else dev for v in g.inputs}
    for pct in (int(x) for x in args.budgets.split(",")):
        budgets = {dev: peak * pct // 100}
        for method in args.methods.split(","):
            s = time.perf_counter()
            try:
                if method == "hier":  # its own plan, alone: through solve, every heuristic (park too) runs first
                    opts = SolverOptions(time_limit_s=args.time_limit, hier_processes=1)
                    plan = solve_hier(Problem(g, prof, budgets, [dev, "cpu"], homes), opts)
                else:
                    plan = solve(
                        g, prof, budgets, [dev, "cpu"], method, SolverOptions(time_limit_s=args.time_limit), homes=homes
                    )
                what = (
                    f"makespan {plan.predicted.makespan_s * 1e3:.2f} ms, peak "
                    f"{plan.predicted.peak_bytes.get(dev, 0) / 2**20:.1f} MiB, by {plan.solver.found_by or plan.solver.method}"
                )
            except XschedError as e:
                what = f"{type(e).__name__}: {e.detail[:300]}"
            print(f"{method:5s} @{pct}%: {time.perf_counter() - s:7.1f} s  {what}", flush=True)


if __name__ == "__main__":
    main()
