"""Tests of retrain/backends/local/training/."""
