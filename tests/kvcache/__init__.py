"""Tests of the KV-cache manager core (kvcache_service/core)."""
