"""The gateway: one Inference address in front of a fleet of model services (workers)."""
