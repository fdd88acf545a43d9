"""Tests of retrain/serve/tinker/."""
