"""The back-pressure controller measured: in simulation (sim), on a real run (real), against
`retrain serve` (serve).
May import retrain and bench.serve."""
