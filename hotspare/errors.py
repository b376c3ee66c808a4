"""One error tree for hotspare.

Rule (borrowed from torchtitan): a user or configuration mistake raises ``ConfigError``
(also a ``ValueError``) with a message that says how to fix it; ``assert`` is reserved for
internal invariants. Everything hotspare raises on purpose derives from ``HotspareError``.
"""


class HotspareError(Exception):
    """Base class of every error hotspare raises on purpose."""


class ConfigError(HotspareError, ValueError):
    """A bad flag, config value, API call or injection spec. The message says what to fix."""


class ProtocolError(HotspareError):
    """A control message that is malformed, of an unknown version, or from a stale generation."""


class PeerFailure(HotspareError):
    """A collective of the current generation failed because a peer died, hung or was fenced.

    Raised (or recognised) inside a step; the runtime turns it into a recovery, never a crash.
    """


class StateMismatch(HotspareError):
    """Transferred state does not fit the receiver (different model, shapes or checksum)."""


class StateTrackingError(HotspareError):
    """A rank's state differed from its peers' right after it received theirs: the script keeps
    state hotspare was not told about (``job.track``). A bug in the script, not the hardware."""


class JobFailed(HotspareError):
    """The job cannot continue; the message says why (e.g. a bug in the training script)."""


class InvalidTransition(HotspareError, ValueError):
    """A device lifecycle move the table does not allow (``hotspare.health.lifecycle``).

    The message names the move asked for, the state it was asked from and the moves allowed.
    """
