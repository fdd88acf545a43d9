"""The bill: what a run spent (tokens, judge tokens, wall time), priced by the [cost] section,
and whether a budget was crossed. Pure: no torch, no SDK, no I/O."""
