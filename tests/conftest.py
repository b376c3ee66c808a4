"""Checkpoints are signed with a key file (hotspare/checkpoint/auth.py): the tests use one of
their own, not the user's ~/.config/hotspare/checkpoint.key. Jobs they launch inherit it.

The Slurm integration is off unless a test turns it on (tests/health/test_slurm.py names its
mode): a job of another test must not drain this machine's node, nor wait on a controller that
the Slurm tests started and stopped (auto mode finds /etc/slurm/slurm.conf after them)."""
import os
import tempfile

import pytest

_KEY_DIR = tempfile.mkdtemp(prefix="hotspare-test-key-")
os.environ.setdefault("HOTSPARE_CHECKPOINT_KEY", os.path.join(_KEY_DIR, "checkpoint.key"))
os.environ.setdefault("HOTSPARE_SLURM", "off")


@pytest.fixture(scope="session")
def hotspare_slurm_node():
    """The one node of the tests' real single-machine Slurm (hotspare/testing/slurm.py): started
    if needed, stopped afterwards if this session started it. Without Slurm installed the tests
    that use it fail (they do not skip): run `.ci/slurm-up` as root."""
    from hotspare.testing.slurm import NotTestCluster, SlurmUnavailable, running_cluster
    try:
        with running_cluster() as node:
            yield node
    except SlurmUnavailable as e:
        pytest.fail(str(e), pytrace=False)
    except NotTestCluster as e:
        pytest.skip(str(e))
