"""Tests of retrain/backends/tinker/."""
