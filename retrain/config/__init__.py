"""The configuration (floor 1, the pure core): typed sections, the TOML loader, schema and bounds,
`--set` overrides, paths anchored to the config's folder, TOML reading and writing.
Imports nothing above the core, no torch and no SDK."""
