"""The merge side: the merge driver (driver), label-free selection (selection) and evaluation with
labels (evaluation)."""
