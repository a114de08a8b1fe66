"""Sampling: the per-row parameter table, filters, penalties, seeded draws and the sampler."""
