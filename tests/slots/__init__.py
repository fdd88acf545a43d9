"""Tests of retrain/slots/."""
