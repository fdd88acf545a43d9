"""Tests of retrain/campaign/."""
