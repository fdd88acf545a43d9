"""The pure math of a recipe (floor 1): advantages. No torch, no I/O."""
