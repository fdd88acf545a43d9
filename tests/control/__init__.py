"""Tests of retrain/control/."""
