"""Tests of retrain/environments/judge/."""
