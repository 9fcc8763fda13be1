"""The engine: request state, scheduling policy, the manager client, the step loop."""
