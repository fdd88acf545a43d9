"""Tests of retrain/cli/."""
