"""The chained page hash, byte-exact as specified in kvcache.proto.

    h(-1) = 0
    h(i)  = uint64_le(SHA-256(uint64_le(h(i-1)) || int32_le(tokens of page i) || utf8(extra_key))[:8])

Any process, any language, any restart computes the same values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from hashlib import sha256
from struct import error as _StructError
from struct import pack as _pack

ROOT_HASH = 0

_from_bytes = int.from_bytes


def token_bytes(tokens: Sequence[int]) -> bytes:
    """The tokens as int32 little-endian bytes; struct.error when one does not fit.
    (struct.pack is faster than array("i", tokens), docs/benchmarks.md, and little-endian everywhere.)"""
    return _pack(f"<{len(tokens)}i", *tokens)


def checked_token_bytes(tokens: Sequence[int]) -> bytes | None:
    """token_bytes(tokens), or None when a token is outside [0, 2^31).

    One C pass, faster than min() and max() over a list: struct rejects what
    does not fit an int32, and a negative int32 is one whose last (little-endian:
    most significant) byte is >= 0x80, so all those bytes are ASCII iff none is."""
    try:
        data = _pack(f"<{len(tokens)}i", *tokens)
    except (_StructError, TypeError):
        return None
    return data if data[3::4].isascii() else None


def hash_pages(data: bytes, page_size: int, extra_key: str = "", parent: int = ROOT_HASH,
               start_page: int = 0) -> list[int]:
    """The chained hashes of the full pages of `data` (token_bytes of some tokens),
    from page start_page on; `parent` is the hash of the page before it."""
    width = page_size * 4
    salt = extra_key.encode("utf-8")
    out: list[int] = []
    append = out.append
    h = parent
    for off in range(start_page * width, len(data) - width + 1, width):
        digest = sha256(h.to_bytes(8, "little"))
        digest.update(data[off : off + width])
        if salt:
            digest.update(salt)
        h = _from_bytes(digest.digest()[:8], "little")
        append(h)
    return out


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
    data = token_bytes(tokens[start_page * page_size : end_page * page_size])
    salt = extra_key.encode("utf-8")
    width = page_size * 4
    h = parent
    for off in range(0, len(data), width):
        digest = sha256(h.to_bytes(8, "little"))
        digest.update(data[off : off + width])
        if salt:
            digest.update(salt)
        h = _from_bytes(digest.digest()[:8], "little")
        yield h


def page_hashes(
    tokens: Sequence[int],
    page_size: int,
    extra_key: str = "",
    parent: int = ROOT_HASH,
    start_page: int = 0,
) -> list[int]:
    """The hashes of every full page of `tokens` from start_page on."""
    end_page = len(tokens) // page_size
    if end_page <= start_page:
        return []
    return hash_pages(token_bytes(tokens[start_page * page_size : end_page * page_size]),
                      page_size, extra_key, parent)


def extra_key_digest(extra_key: str) -> str:
    """16 hex digits naming an extra_key without showing it: a gateway compares its own with a
    worker's (ModelInfo.extra_key_digest) before trusting its hashes to match the worker's."""
    return sha256(extra_key.encode("utf-8")).digest()[:8].hex()


def tenant_extra_key(salt: str, tenant: str) -> str:
    """The extra_key of a tenant's requests: the deployment's salt and the tenant together, so two
    tenants never share a page (a shared page would tell one, through its time to first token,
    what the other sent). The gateway and the worker both call this: their hashes agree."""
    return f"{salt}\x00tenant:{tenant}" if tenant else salt


MAX_CACHE_SALT_BYTES = 256   # hashed into every page of the request


def request_extra_key(salt: str, tenant: str, cache_salt: str = "") -> str:
    """The extra_key of one request: its tenant's, and the request's own cache_salt after it
    (a salt shares pages only with requests of the same salt and tenant). The gateway and the
    worker both call this."""
    key = tenant_extra_key(salt, tenant)
    return f"{key}\x00salt:{cache_salt}" if cache_salt else key


# A deployment's --cache-salt: with a tenant (256 characters) and a request's cache_salt, inside
# the 4,096 bytes of extra_key the manager takes (core/validation.py).
MAX_DEPLOYMENT_SALT_BYTES = 1024


def check_deployment_salt(salt: str) -> None:
    """ValueError for a --cache-salt longer than MAX_DEPLOYMENT_SALT_BYTES, or not text (a
    command line's bytes that are not UTF-8 come as lone surrogates, which no hash can take)."""
    size = _utf8_size(salt, "--cache-salt")
    if size > MAX_DEPLOYMENT_SALT_BYTES:
        raise ValueError(f"--cache-salt has {size:,} bytes of UTF-8; at most {MAX_DEPLOYMENT_SALT_BYTES:,} are allowed")


def check_cache_salt(cache_salt: str) -> None:
    """ValueError for a cache_salt no request may carry (a NUL is what parts an extra_key)."""
    size = _utf8_size(cache_salt, "cache_salt")
    if size > MAX_CACHE_SALT_BYTES:
        raise ValueError(f"cache_salt has {size:,} bytes of UTF-8; at most {MAX_CACHE_SALT_BYTES} are allowed")
    if "\x00" in cache_salt:
        raise ValueError("cache_salt must not contain NUL characters")


def _utf8_size(text: str, what: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not Unicode text (it holds a lone surrogate)") from None
