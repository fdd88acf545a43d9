"""The pure math of a recipe (floor 1): advantages, the learning rate, the policy losses' names and
bounds, their aggregation. No torch, no I/O."""
