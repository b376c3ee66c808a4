"""Fixtures of the coordinator service's tests: a secret file, and the service on loopback
with real agents (``svcloop.Loopback``)."""
import os

import pytest

from svcloop import Loopback


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def loopback(tmp_path, secret_file):
    pool = Loopback(str(tmp_path / "state"), secret_file)
    try:
        yield pool
    finally:
        pool.close()
