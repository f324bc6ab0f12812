"""Profiling through the device plugins: the measuring loop (`measure`) with its op rounds (`rounds`), copy
timings (`links`), time cap (`timecap`) and costs for what the cap left unmeasured (`fallback`); the profile store
under profiles/ with its one validating loader (`store`), and modelled costs (`model`). The profile itself is a
contract (`xsched.contracts.profile`)."""
