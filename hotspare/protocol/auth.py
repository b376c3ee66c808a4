"""Who may speak on a control channel: a per-job secret and a challenge-response at connect.

Every listener (the coordinator's node endpoint, each agent's worker port, the launcher's control
port) opens a connection by sending ``challenge`` with a fresh random nonce. The client's first
message (``agent_hello``, ``hello`` or ``inject``) carries ``proof`` = HMAC-SHA256(key, role,
identity, nonce); the listener recomputes it and compares in constant time. A connection that
fails the proof, or says nothing in time, is refused and logged; one that passes is bound to
that identity for its life (nothing else can write into an established TCP connection without
root), so later messages need no MAC of their own and the step path costs nothing extra.

Keys, all derived from the job secret (``new_secret`` in the launcher, or ``--secret-file`` for a
secret shared by many hosts):

- a node agent proves it holds the secret itself (``node_key``);
- a worker holds only its own token, HMAC(secret, worker id) (``worker_token``), handed to it
  in its environment by the agent that spawns it: one worker cannot pose as another to an agent;
- the job's workers share one peer key (``peer_key``), handed to each the same way, that their
  buddy links prove (transfer/links.py): a worker of the job can speak to another, nobody else;
- an operator (``hotspare inject``) holds the operator token from the launcher's run file,
  which only the job's user can read (``write_private``).

Threat model and limits: docs/SECURITY.md.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Callable

from hotspare.errors import ConfigError, ProtocolError
from hotspare.protocol.channel import Channel
from hotspare.protocol.messages import Message, VersionError, make

ENV_WORKER_TOKEN = "HOTSPARE_WORKER_TOKEN"
ENV_PEER_KEY = "HOTSPARE_PEER_KEY"
SECRET_BYTES = 32
MIN_SECRET_CHARS = 32             # a secret file holds at least this many characters
SECRET_FILE_MAX = 4096            # ... and at most this many bytes
HELLO_TIMEOUT_S = 5.0             # a connection must prove itself within this time
HELLO_MAX_LINE = 16 * 1024        # before the proof, no line may be longer
CHALLENGE_WAIT_S = 30.0           # a client waits this long for a busy listener's challenge

NODE, WORKER, OPERATOR, CLIENT = "node", "worker", "operator", "client"
# role -> (the first message's type, the field naming who speaks)
HELLOS = {NODE: ("agent_hello", "node"), WORKER: ("hello", "worker"), OPERATOR: ("inject", "operator"),
          CLIENT: ("request", "operator")}


class AuthError(ProtocolError):
    """A connection that could not prove who it is, or spoke out of its role."""


# ---------------------------------------------------------------------- keys
def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def _derive(secret: bytes, label: str) -> str:
    return hmac.new(secret, label.encode(), hashlib.sha256).hexdigest()


def node_key(secret: bytes) -> str:
    return _derive(secret, "hotspare node")


def worker_token(secret: bytes, worker: str) -> str:
    return _derive(secret, f"hotspare worker\n{worker}")


def peer_key(secret: bytes) -> str:
    """What a job's workers prove to one another on their buddy links (transfer/links.py): one
    key for the whole job, handed to every worker by its agent beside its own token."""
    return _derive(secret, "hotspare peer")


def peer_key_from_env() -> str:
    key = os.environ.get(ENV_PEER_KEY)
    if not key:
        raise ConfigError(f"{ENV_PEER_KEY} is not set: a managed worker is started by a hotspare agent "
                          "(hotspare run), which hands it the key its buddy links are proven with")
    return key


def operator_token(secret: bytes) -> str:
    return _derive(secret, "hotspare operator")


def client_token(secret: bytes) -> str:
    """What `hotspare submit`, `status` and `cancel` prove to the coordinator service."""
    return _derive(secret, "hotspare client")


def proof(key: str, role: str, identity: str, nonce: str) -> str:
    return hmac.new(key.encode(), f"hotspare-v1\n{role}\n{identity}\n{nonce}".encode(),
                    hashlib.sha256).hexdigest()


def verify(key: str, role: str, identity: str, nonce: str, given: str) -> bool:
    """Whether ``given`` is the proof, compared in constant time. Compared as bytes: a proof
    that is not ASCII (which ``compare_digest`` of two strings would raise on) is simply wrong."""
    return hmac.compare_digest(proof(key, role, identity, nonce).encode(), given.encode("utf-8", "replace"))


# ---------------------------------------------------------------------- secret files
def load_secret(path: str | os.PathLike) -> bytes:
    """The secret in ``path``: a file of the job's user that nobody else can read."""
    p = Path(path).expanduser()
    try:
        st, raw = _read_small(p)
        text = raw.decode().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--secret-file {p}: cannot read it ({e}); create one with "
                          f"`python -c 'import secrets; print(secrets.token_hex(32))' > {p}; chmod 600 {p}`") from None
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"--secret-file {p}: others can read or own it (mode {stat.filemode(st.st_mode)}); "
                          f"it must belong to you and be private: chmod 600 {p}")
    if len(text) < MIN_SECRET_CHARS:
        raise ConfigError(f"--secret-file {p}: holds {len(text)} characters, at least {MIN_SECRET_CHARS} are "
                          "needed (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return text.encode()


def _read_small(p: Path) -> tuple[os.stat_result, bytes]:
    """The stat and bytes of the regular file ``p``, at most ``SECRET_FILE_MAX`` of them: a FIFO
    or device is refused, never waited on, and a huge file is refused by its size, unread."""
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if st.st_size > SECRET_FILE_MAX:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, more than the {SECRET_FILE_MAX} a secret file holds")
        return st, os.read(fd, SECRET_FILE_MAX)
    finally:
        os.close(fd)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable and writable by this user only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)          # whatever the umask, or an older file of that name
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and make it this user's only (0700)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


# ---------------------------------------------------------------------- server side
def peer(ch: Channel) -> str:
    if not hasattr(ch, "sock"):
        return "in-process"               # protocol/local.py
    try:
        host, port = ch.sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


def accept(ch: Channel, role: str | tuple[str, ...], key_for: Callable[[str], str | None]) -> Message:
    """Challenge a new connection and check its first message: the hello of ``role`` (or of
    one of several roles; ``key_for(identity)`` then gets the role too) whose proof matches the
    key ``key_for(identity)`` (None: nobody of that name may connect). Returns the hello;
    raises AuthError (the caller refuses and logs). The listener (``hotspare.protocol.listen``)
    bounds how long this may take."""
    roles = (role,) if isinstance(role, str) else role
    nonce = secrets.token_hex(16)
    ch.send(make("challenge", nonce=nonce))
    try:
        hello = ch.recv()
    except VersionError as e:
        raise AuthError(f"protocol version {e.theirs!r:.40} is not this listener's {e.ours}: run the same "
                        "hotspare version on every host") from None
    if hello is None:
        raise AuthError("closed before saying who it is")
    role = next((r for r in roles if HELLOS[r][0] == hello["type"]), None)
    if role is None:
        kinds = " or ".join(repr(HELLOS[r][0]) for r in roles)
        raise AuthError(f"a {'/'.join(roles)} connection must begin with {kinds}, got {hello['type']!r}")
    kind, field = HELLOS[role]
    if len(roles) > 1:
        def keyed(identity: str) -> str | None:
            return key_for(role, identity)  # type: ignore[call-arg]
    else:
        keyed = key_for
    identity, given = hello.get(field), hello.get("proof")
    if not isinstance(identity, str) or not isinstance(given, str):
        raise AuthError(f"{kind!r} lacks {field!r} or its proof")
    key = keyed(identity)
    if key is None or not verify(key, role, identity, nonce, given):
        raise AuthError(f"{role} {identity[:64]!r} failed authentication (wrong or missing job secret)")
    return hello


# ---------------------------------------------------------------------- client side
def connect(address: str, role: str, key: str, /, timeout: float = CHALLENGE_WAIT_S, **fields: Any) -> Channel:
    """Connect to ``address`` (host:port), answer its challenge with the hello of ``role``
    (``fields`` must name the identity), and return the authenticated channel."""
    kind, field = HELLOS[role]
    host, port = address.rsplit(":", 1)
    ch = Channel.connect(host, int(port), timeout=timeout)
    try:
        ch.sock.settimeout(timeout)
        challenge = ch.recv(any_version=True)      # a listener of another version refuses our hello
        if challenge is None or challenge["type"] != "challenge":
            why = challenge["message"] if challenge and challenge["type"] == "refused" else challenge
            raise AuthError(f"{address} did not challenge this connection: {why}")
        ch.sock.settimeout(None)
        ch.send(make(kind, proof=proof(key, role, str(fields[field]), challenge["nonce"]), **fields))
    except BaseException:
        ch.close()
        raise
    return ch


def worker_connect(address: str, worker: str, role: str) -> Channel:
    """A managed worker's control channel to its agent, proven with the token its agent gave
    it (``HOTSPARE_WORKER_TOKEN``)."""
    token = os.environ.get(ENV_WORKER_TOKEN)
    if not token:
        raise ConfigError(f"{ENV_WORKER_TOKEN} is not set: a managed worker is started by a hotspare agent "
                          "(hotspare run), which hands it its token")
    return connect(address, WORKER, token, worker=worker, pid=os.getpid(), role=role)
