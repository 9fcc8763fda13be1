"""kvserve test suite."""
