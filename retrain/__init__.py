"""retrain: TOML-first reinforcement-learning fine-tuning for language models."""

__version__ = "0.1.0"
