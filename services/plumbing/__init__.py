"""Server plumbing every kvserve service uses: addresses, create_server, health, reflection,
signals, logging. Imports no service."""
