"""Python clients for the kvserve gRPC services."""
