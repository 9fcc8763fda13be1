"""The page hash is a public spec: check it against an independent rendering of it."""

import hashlib
import struct

from kvserve.kvcache_service.contract.hashing import ROOT_HASH, iter_page_hashes, page_hashes


def reference(tokens, page_size, extra_key=""):
    out, parent = [], 0
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size:(i + 1) * page_size]
        data = struct.pack("<Q", parent) + struct.pack(f"<{page_size}i", *page) + extra_key.encode()
        parent = struct.unpack("<Q", hashlib.sha256(data).digest()[:8])[0]
        out.append(parent)
    return out


def test_matches_the_spec():
    tokens = [0, 1, 2**31 - 1, 7, 128000, 5, 6, 9, 3]
    assert ROOT_HASH == 0
    assert page_hashes(tokens, 4) == reference(tokens, 4)
    assert page_hashes(tokens, 2, "rev-ä") == reference(tokens, 2, "rev-ä")


def test_known_value_is_stable_across_processes():
    # Pinned so a change to the spec is a visible, deliberate change.
    assert page_hashes([1, 2, 3, 4], 4) == reference([1, 2, 3, 4], 4)
    assert page_hashes([1, 2, 3, 4], 4) == [0x30238DD4B4B13F9C]


def test_resuming_a_chain_gives_the_same_hashes():
    tokens = list(range(40))
    full = page_hashes(tokens, 4)
    assert page_hashes(tokens, 4, parent=full[3], start_page=4) == full[4:]
    assert list(iter_page_hashes(tokens, 4, max_pages=3)) == full[:3]
    assert page_hashes(tokens[:3], 4) == []


def test_the_longest_key_a_worker_builds_is_one_the_manager_takes():
    """A deployment's salt, a tenant and a request's cache_salt at their limits fit the manager's
    bound on extra_key; a longer --cache-salt is refused where it is given."""
    import pytest

    from kvserve.kvcache_service.contract.hashing import (MAX_CACHE_SALT_BYTES, MAX_DEPLOYMENT_SALT_BYTES,
                                                           request_extra_key)
    from kvserve.kvcache_service.core.validation import MAX_EXTRA_KEY_BYTES, check_extra_key
    from kvserve.model_service.config import ModelServiceConfig
    from kvserve.services.gateway.config import GatewayConfig
    from kvserve.services.plumbing.api_keys import MAX_TENANT_CHARS

    longest = request_extra_key("é" * (MAX_DEPLOYMENT_SALT_BYTES // 2), "t" * MAX_TENANT_CHARS,
                                "s" * MAX_CACHE_SALT_BYTES) + "\x00" + "0" * 32   # prefix caching off
    assert len(longest.encode()) <= MAX_EXTRA_KEY_BYTES
    check_extra_key(longest, "admit")
    for config in (ModelServiceConfig, GatewayConfig):
        with pytest.raises(ValueError, match="--cache-salt has 1,025 bytes of UTF-8; at most 1,024"):
            config(cache_salt="s" * 1025)
