"""The `kvserve` command: the top layer, above every service it starts."""
