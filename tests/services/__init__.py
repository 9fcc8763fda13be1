"""Tests for the shared server plumbing in services/."""
