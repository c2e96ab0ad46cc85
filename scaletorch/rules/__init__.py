"""Pure-Python rules that the runtime (scaletorch.dist, scaletorch.parallel) and the planner
(scaletorch.plan) share: no torch, no process group, so both can import them."""
