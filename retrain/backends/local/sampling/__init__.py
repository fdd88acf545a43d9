"""The local backend's samplers: `exact` (step by step, torch.Generator draws, a reserved KV
cache) and `fast` (a static KV cache, merged LoRA weights, CUDA graphs, counter-based draws),
with `compiled` ([backend] compile) for the exact sampler's decoding step."""
