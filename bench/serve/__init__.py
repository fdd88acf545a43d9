"""`retrain serve` measured: a stalled client (stall), the tinker backend's overlap against it
(tinker_overlap).
May import retrain."""
