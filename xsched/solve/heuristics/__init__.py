"""The heuristics, one method per file named after it, each `(Problem, SolverOptions, warm) -> Plan` or a BudgetError
naming the device (and op) where it does not fit: `eager`, `greedy`, `fastest`, `sqrt`, `checkpoint`, `offload`,
`gaps`, `park`, and the search `park_search`. Shared: `routing` (computes -> steps, checked), `lean` (the
checkpoint search's last resort), `park_model` (the timeline park decides on)."""
