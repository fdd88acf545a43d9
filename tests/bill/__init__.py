"""Tests of retrain/bill/ and what a run spends: tokens, prices, budgets."""
