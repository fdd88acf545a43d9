"""Tests of retrain/backends/local/."""
