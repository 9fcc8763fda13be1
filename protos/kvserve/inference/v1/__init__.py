"""Generated stubs for kvserve.inference."""
