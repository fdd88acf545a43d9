"""Tests of retrain/serve/openai/."""
