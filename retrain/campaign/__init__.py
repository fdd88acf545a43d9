"""Where runs live (floor 4): a campaign's plan and matrix (pure), the runner's policy (manifest,
resume, retries, stagger, max_workers), its executors (local processes, Ray) and its concurrency
controller. Starts runs; never imported by the trainer or a backend."""
