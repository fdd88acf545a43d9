"""This machine's own speed: matmul throughput and memory bandwidth measured in process
(`measure`), and a per-machine cache of the peaks (`peaks`) for the roofline hints,
`retrain explain` and `python -m bench.bound`."""
