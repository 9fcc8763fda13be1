"""Attention backends behind one interface (base.AttentionBackend)."""
