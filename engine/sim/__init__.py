"""A simulated engine: the real coordinator, actors, schedulers and block managers over simulated compute
units whose steps take the time a cost model predicts, on an event loop whose clock is virtual
(`pdserve simulate`, `pdserve plan`; docs/planning.md)."""
