"""kvserve.services: the server plumbing every service uses (plumbing/, the bottom layer) and the
`kvserve` command (cli/, the top layer); the gateway will sit between them."""
