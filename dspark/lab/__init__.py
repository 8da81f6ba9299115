"""Tools built on the serving runtime, never imported by it: timing (clocks, lockstep), profiling sweeps and
cost-model judging, STS recording and fitting, the demo, and the trace replay (the policy lab)."""
