"""The local backend's training pass: `plan` (micro-batches from the device's free memory),
`pack` and `forward` (a micro-batch's tensors and its forward, in the prefix or the packed
layout), `logprobs` (the LM head in chunks), `accumulate` (the forward_backward loop),
`diagnostics` (each micro-batch's gradient), and the policy losses' tensor math (shared with
`retrain serve`)."""
