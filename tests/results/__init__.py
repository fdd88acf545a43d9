"""Tests of retrain/results/."""
