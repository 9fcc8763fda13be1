"""The chained page hash, byte-exact as specified in kvcache.proto.

    h(-1) = 0
    h(i)  = uint64_le(SHA-256(uint64_le(h(i-1)) || int32_le(tokens of page i) || utf8(extra_key))[:8])

Any process, any language, any restart computes the same values.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from hashlib import sha256

ROOT_HASH = 0

_LITTLE_ENDIAN = sys.byteorder == "little"


def _token_bytes(tokens: Sequence[int]) -> memoryview:
    arr = array("i", tokens)
    if not _LITTLE_ENDIAN:
        arr.byteswap()
    return memoryview(arr).cast("B")


def iter_page_hashes(
    tokens: Sequence[int],
    page_size: int,
    extra_key: str = "",
    parent: int = ROOT_HASH,
    start_page: int = 0,
    max_pages: int | None = None,
) -> Iterator[int]:
    """Yields the hashes of the full pages start_page, start_page+1, ...

    `parent` is the hash of page start_page-1 (ROOT_HASH when start_page is 0).
    Lazy, so a prefix match that stops at its first miss hashes no further.
    """
    end_page = len(tokens) // page_size
    if max_pages is not None:
        end_page = min(end_page, start_page + max_pages)
    if end_page <= start_page:
        return
    data = _token_bytes(tokens[start_page * page_size : end_page * page_size])
    salt = extra_key.encode("utf-8")
    width = page_size * 4
    h = parent
    for off in range(0, len(data), width):
        digest = sha256(h.to_bytes(8, "little"))
        digest.update(data[off : off + width])
        if salt:
            digest.update(salt)
        h = int.from_bytes(digest.digest()[:8], "little")
        yield h


def page_hashes(
    tokens: Sequence[int],
    page_size: int,
    extra_key: str = "",
    parent: int = ROOT_HASH,
    start_page: int = 0,
) -> list[int]:
    """The hashes of every full page of `tokens` from start_page on."""
    return list(iter_page_hashes(tokens, page_size, extra_key, parent, start_page))
