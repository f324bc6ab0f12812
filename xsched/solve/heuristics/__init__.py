"""The heuristics: each method in a file named after it, `(graph, profile, budgets, devices, homes) -> Plan`."""
