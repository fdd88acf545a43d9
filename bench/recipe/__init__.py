"""Issue 56: the default recipe measured on several task families, seed by seed."""
