"""Campaigns measured: the runner's overhead, the tiny campaign, a Ray campaign, the race's
simulation and the algorithms race.
May import retrain and each other."""
