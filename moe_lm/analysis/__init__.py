"""Routing analytics: record what the router chose, compute metrics against baselines, draw them."""
