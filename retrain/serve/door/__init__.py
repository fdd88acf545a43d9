"""What guards `retrain serve`'s door for both APIs: the shared key, faults and delay (guard),
client input checked once (validate), zstd bodies under a cap (inflate), the sampling backlog's
bound.
May import serve.errors and the floors below; nothing else of serve."""
