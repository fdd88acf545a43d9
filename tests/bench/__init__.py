"""Tests of bench/: the benchmarks' code runs (tiny shapes), never their speed."""
