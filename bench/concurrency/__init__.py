"""The campaign's API concurrency controller measured: in simulation (sim) and on a campaign
(campaign).
May import retrain and bench.serve."""
