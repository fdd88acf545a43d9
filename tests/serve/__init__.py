"""Tests of retrain/serve/."""
