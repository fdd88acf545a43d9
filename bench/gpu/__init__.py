"""`python -m bench.gpu`: the GPU bench (main), its training and sampling measurements and the
decode profile.
May import retrain and bench's top modules (step_time, timing)."""
