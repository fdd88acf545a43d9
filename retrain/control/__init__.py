"""The pure controllers and their math: back-pressure (USL fit, drift, OOM ceiling, roofline,
goodput), gradient noise, step cost and capacity. No torch, no SDK, no I/O."""
