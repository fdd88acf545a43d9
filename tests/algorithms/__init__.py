"""Tests of retrain/algorithms/."""
