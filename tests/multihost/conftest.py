"""Three hosts on this machine: network namespaces on a bridge (hotspare.testing.netns), made
once per test module and always removed; the tests skip where namespaces cannot be made."""
import os

import pytest

from hotspare.testing.netns import Hosts, unavailable
from hotspare.testing.servicejob import ServiceCluster


@pytest.fixture(scope="module")
def net():
    why = unavailable()
    if why is not None:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    hosts = Hosts(["hosta", "hostb", "hostc"])
    try:
        yield hosts
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "job.secret"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def cluster(net, secret_file, tmp_path):
    """A coordinator service over the three hosts (hotspare.testing.servicejob), closed after the test."""
    c = ServiceCluster(net, secret_file, str(tmp_path / "state"))
    try:
        yield c
    finally:
        c.close()
