"""Tests of retrain/config/."""
