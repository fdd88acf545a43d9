"""Tests of retrain/environments/."""
