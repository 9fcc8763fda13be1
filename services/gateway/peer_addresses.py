"""Peer addresses taken out of words a client reads.

A worker's address is the log's (each log line names it), never a client's: grpc's own error
details name peers ("ipv4:10.0.0.7:50051: Connection refused", "ipv6:%5B::1%5D:50051", "DNS
resolution failed for worker-0.workers:50051"), and a worker's own words may name an address
as plain host:port ("127.0.0.1:50061", "worker-0.workers.ns.svc:50051", "[::1]:50051").
"""

from __future__ import annotations

import re

_PEER_ADDRESS = re.compile(
    r"(?:ipv4:[0-9.]+|ipv6:(?:\[|%5B)[0-9a-fA-F:.%]*?(?:\]|%5D)|unix(?:-abstract)?:[^\s:;,]+)(?::\d+)?"
    r"|(?:(?<=errors resolving )|(?<=resolution failed for ))[^\s:;,]+(?::\d+)?"
    # (an address may end a sentence: a period after it, but no word)
    r"|(?<![\w.:/-])\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?(?!\w|\.\w)"          # 10.0.0.7, 127.0.0.1:50061
    r"|\[[0-9a-fA-F.%]*:[0-9a-fA-F:.%]*\](?::\d+)?"                         # [::1]:50051, not logit_bias[50256]
    r"|(?<![\w.:/-])(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+):\d+(?!\w|\.\w)")   # a name and port


def without_addresses(details: str, instead: str = "the worker") -> str:
    """`details` with every peer address in it replaced by `instead`."""
    return _PEER_ADDRESS.sub(instead, details)
