"""Python stubs generated from the kvserve .proto files (see scripts/gen_protos.py)."""
