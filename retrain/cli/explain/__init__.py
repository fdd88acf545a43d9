"""`retrain explain FILE`, the dry run (dry_run) and what it reports: data, memory, the race, SFT
rows, warnings.
May import cli.render and every floor below; nothing else of cli."""
