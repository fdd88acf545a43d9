"""One run on several processes (torch.distributed): rank 0 drives the run, every rank samples
and trains its share of each call's prompt groups. May import backends, algorithms, config,
machine and errors; nothing above (run/, cli/) imports back into it but through `lead`,
`follow` and `launch`."""
