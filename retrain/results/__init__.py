"""After the run: compare a campaign's conditions, plot them, evaluate, sample and export a
checkpoint. Runs are read only through `runlog` and `safejson`; `cli.py` stays thin."""
