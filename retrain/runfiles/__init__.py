"""The files a run leaves behind (floor 2): metrics.jsonl, state.json and atomic writes
(`runlog`), and reading JSON another process wrote, with limits (`safejson`).
Imports only the standard library and `retrain.errors`."""
