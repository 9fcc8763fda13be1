"""KV-cache manager: the core (pure Python) and its gRPC servicer."""
