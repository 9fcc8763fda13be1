from __future__ import annotations

import pytest

from tests.security.certs import Certs, make_certs


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))
