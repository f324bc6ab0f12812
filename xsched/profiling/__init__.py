"""Profiling through the device plugins: the measuring loop (`measure`), the profile store under profiles/ with its
one validating loader (`store`), and modelled costs (`model`). The profile itself is a contract
(`xsched.contracts.profile`)."""
