"""Tests of retrain/machine/."""
