"""Tests of retrain/environments/sft/."""
