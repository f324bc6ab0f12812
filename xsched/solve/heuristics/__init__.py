"""The heuristics, one method per file named after it, each `(Problem, SolverOptions, warm) -> Plan` or a BudgetError
naming the device (and op) where it does not fit: `eager`, `greedy`, `fastest`, `sqrt`, `checkpoint`, `offload`,
`gaps`, `park`, and the search `park_search`. Shared: `routing` (computes -> steps, checked), `timeline` (the one
timeline of the heuristics that evict or park), `park_model` (that timeline with a store and its copy lanes),
`lean` (the checkpoint search's last resort)."""
