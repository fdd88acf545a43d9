"""Tests of retrain/backends/."""
