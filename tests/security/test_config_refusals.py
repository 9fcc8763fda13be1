"""Configurations that would leak are refused at start, with a sentence."""

from __future__ import annotations

import pytest

from kvserve.model_service.config import ModelServiceConfig


@pytest.mark.parametrize("listen", ["0.0.0.0:50051", "10.1.2.3:50051", "[::]:50051"])
def test_a_worker_trusting_tenant_metadata_must_be_reachable_by_its_gateway_alone(listen):
    with pytest.raises(ValueError, match="anyone who reaches it could name any tenant"):
        ModelServiceConfig(listen=listen, trust_tenant_metadata=True)
    ModelServiceConfig(listen=listen, trust_tenant_metadata=True, tls_cert="c.pem", tls_key="k.pem",
                       tls_client_ca="ca.pem")   # mutual TLS: only the gateway's certificate gets in


@pytest.mark.parametrize("http", ["0.0.0.0:8000", "10.1.2.3:8000"])
def test_a_worker_trusting_tenant_metadata_serves_no_open_http(http):
    """Its HTTP front checks no key (the gateway does): on the network it served anyone."""
    with pytest.raises(ValueError, match="would be served with no key"):
        ModelServiceConfig(listen="127.0.0.1:50051", trust_tenant_metadata=True, http_listen=http)
    ModelServiceConfig(listen="127.0.0.1:50051", trust_tenant_metadata=True, http_listen="127.0.0.1:8000")
    ModelServiceConfig(listen="0.0.0.0:50051", trust_tenant_metadata=True, http_listen=http, tls_cert="c.pem",
                       tls_key="k.pem", tls_client_ca="ca.pem")


@pytest.mark.parametrize("listen", ["127.0.0.1:50051", "localhost:0", "[::1]:0", "unix:///tmp/w.sock"])
def test_a_private_worker_may_trust_tenant_metadata(listen):
    ModelServiceConfig(listen=listen, trust_tenant_metadata=True)


def test_the_admin_token_never_crosses_the_network_in_plaintext():
    with pytest.raises(ValueError, match="in plaintext"):
        ModelServiceConfig(kvcache="10.0.0.5:50061", kvcache_token_file="/etc/kvserve/admin/token")
    ModelServiceConfig(kvcache="10.0.0.5:50061", kvcache_token_file="/etc/kvserve/admin/token",
                       kvcache_tls_ca="/etc/kvserve/tls/ca.crt")
    ModelServiceConfig(kvcache="unix:///run/kv.sock", kvcache_token_file="/etc/kvserve/admin/token")


def test_keys_and_trusted_metadata_are_two_roles():
    with pytest.raises(ValueError, match="give one"):
        ModelServiceConfig(api_keys="keys", trust_tenant_metadata=True)


@pytest.mark.parametrize("listen", ["0.0.0.0:50061", "10.1.2.3:50061", "[::]:50061"])
def test_a_manager_takes_its_admin_token_over_tls_alone(listen):
    """A manager on the network with --admin-token-file and no TLS started without a word, and
    took the token from anyone in plaintext: whoever read it could write to the manager."""
    from kvserve.kvcache_service.config import KVCacheServerConfig

    with pytest.raises(ValueError, match="in plaintext"):
        KVCacheServerConfig(listen=("unix:///run/kv.sock", listen), admin_token_file="/etc/kvserve/admin/token")
    KVCacheServerConfig(listen=("unix:///run/kv.sock", listen), admin_token_file="/etc/kvserve/admin/token",
                        tls_cert="c.pem", tls_key="k.pem")
    KVCacheServerConfig(listen=("unix:///run/kv.sock", "127.0.0.1:50061"), admin_token_file="/etc/kvserve/admin/token")
    KVCacheServerConfig(listen=(listen,))   # no token: its write RPCs answer only the pod itself


def test_up_refuses_an_admin_token_its_manager_would_take_in_plaintext():
    from kvserve.services.cli.up import BadFlags, UpConfig, check_together

    with pytest.raises(BadFlags, match="in plaintext"):
        check_together(UpConfig(kvcache_listen="0.0.0.0:50061", admin_token_file="/etc/kvserve/admin/token"),
                       ModelServiceConfig())
    check_together(UpConfig(kvcache_listen="0.0.0.0:50061", admin_token_file="/etc/kvserve/admin/token"),
                   ModelServiceConfig(tls_cert="c.pem", tls_key="k.pem"))


def test_keys_taken_in_plaintext_beyond_this_host_are_said_at_start(caplog):
    """Not refused (TLS may end at an ingress in front), but said: before, nothing was."""
    from kvserve.services.plumbing.server_flags import warn_keys_in_plaintext

    caplog.set_level("WARNING")
    warn_keys_in_plaintext("keys.txt", "", "127.0.0.1:50051", "0.0.0.0:8000")
    assert "--api-keys on 0.0.0.0:8000 without --tls-cert" in caplog.text
    caplog.clear()
    warn_keys_in_plaintext("keys.txt", "cert.pem", "0.0.0.0:50051")
    warn_keys_in_plaintext("keys.txt", "", "unix:///run/w.sock", "127.0.0.1:8000", "")
    warn_keys_in_plaintext("", "", "0.0.0.0:50051")
    assert not caplog.text
