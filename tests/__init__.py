"""The suite: tests/<package>/ mirrors retrain/<package>/; the shared helpers, conftest and
data sit here."""
