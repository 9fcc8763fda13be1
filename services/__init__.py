"""Shared gRPC server plumbing (addresses, server start-up, health, reflection) and the kvserve CLI."""
