"""kvserve.kvcache.v1: KVCacheManager messages and service stubs (generated)."""
