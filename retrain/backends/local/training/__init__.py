"""The local backend's training pass: micro-batch planning and packing, and the policy
losses' tensor math (shared with `retrain serve`)."""
