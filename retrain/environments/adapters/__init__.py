"""Kinds that adapt a task or game library to the Environment protocol: reasoning_gym,
textarena and verifiers. Each imports its library lazily, so a missing extra costs nothing
until its kind is used (then `MissingExtra` names the pip command)."""
