"""The kvserve.kvcache proto package."""
