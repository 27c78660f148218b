"""Attention backends: the only request-aware op in the model."""
