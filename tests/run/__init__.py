"""Tests of retrain/run/."""
