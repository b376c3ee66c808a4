"""Checkpoints are signed with a key file (hotspare/checkpoint/auth.py): the tests use one of
their own, not the user's ~/.config/hotspare/checkpoint.key. Jobs they launch inherit it."""
import os
import tempfile

_KEY_DIR = tempfile.mkdtemp(prefix="hotspare-test-key-")
os.environ.setdefault("HOTSPARE_CHECKPOINT_KEY", os.path.join(_KEY_DIR, "checkpoint.key"))
