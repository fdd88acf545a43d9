"""Tests of retrain/runfiles/."""
