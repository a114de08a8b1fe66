"""The adaptive mode: its actors, placement, step budgets and core lending."""
