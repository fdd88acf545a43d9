"""Tests of retrain/backends/local/sampling/."""
