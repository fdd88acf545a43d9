"""One run (floor 3): the trainer (the order of the stages), the [sft] stage before it, step
rows, checkpoints and the run lock, stop requests, off-policy overlap, held-out eval, trackers,
progress, seeds.
May import the stages and services (backends' contract, environments, slots, runfiles) and the
core; never a concrete backend at module level, nothing from campaign/ or cli/."""
