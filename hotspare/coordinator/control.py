"""The launcher's control endpoint: operator commands for a running job (``hotspare inject``,
answered only when the job loaded the fault plug-in: ``hotspare run --allow-inject``).

One TCP listener on the launcher's host. The listener challenges each connection; the client
answers with one JSON-lines command (the same versioned, validated protocol as the workers')
proven with the job's operator token (``hotspare.protocol.auth``). The coordinator's event loop
handles it like any other event, logs it with its origin (peer address and the operator's
name), and the reply goes back on the same connection. An unauthenticated connection is refused
and logged; a malformed or refused command gets an error reply and changes nothing.

Each running launcher leaves a run file (``~/.hotspare/runs/<pid>.json``, or under
``$HOTSPARE_RUN_DIR``), readable by the job's user only (0600, in a 0700 folder), naming its
control address and holding the operator token, so ``hotspare inject`` finds and may command
the job without being told where it is; the file goes when the launcher exits.
"""
from __future__ import annotations

import getpass
import json
import os
import queue
import time
from pathlib import Path

from hotspare.coordinator.events import OperatorCommand
from hotspare.errors import ProtocolError
from hotspare.protocol import auth
from hotspare.protocol.channel import Channel
from hotspare.protocol.listen import Listener, bound_server
from hotspare.protocol.messages import Message, make

ENV_RUN_DIR = "HOTSPARE_RUN_DIR"
REPLY_TIMEOUT_S = 10.0
MAX_LINE = 16 * 1024              # a command is one short line


def run_dir() -> Path:
    return Path(os.environ.get(ENV_RUN_DIR) or "~/.hotspare/runs").expanduser()


class ControlServer:
    def __init__(self, events: "queue.Queue", secret: bytes, host: str = "127.0.0.1",
                 describe: dict | None = None):
        self.events = events
        self._token = auth.operator_token(secret)
        server = bound_server(host)
        self.address = f"{host}:{server.getsockname()[1]}"
        self.run_file: Path | None = run_dir() / f"{os.getpid()}.json"
        try:
            auth.private_dir(self.run_file.parent)
            auth.write_private(self.run_file, json.dumps({
                "pid": os.getpid(), "control": self.address, "token": self._token, "started": time.time(),
                **(describe or {})}))
        except OSError:             # a read-only home: `hotspare inject --job ADDRESS --secret-file F`
            self.run_file = None
        self._listener = Listener(server, self._handshake, self._serve, "hotspare-control-server",
                                  max_line=MAX_LINE)

    def close(self) -> None:
        self._listener.close()
        if self.run_file is not None:
            try:
                self.run_file.unlink()
            except OSError:
                pass

    def _handshake(self, ch: Channel) -> Message:
        try:
            return auth.accept(ch, auth.OPERATOR, lambda operator: self._token)
        except ProtocolError as e:
            _reply_error(ch, f"refused: {e}")
            raise

    def _serve(self, ch: Channel, msg: Message) -> None:
        try:
            origin = f"operator {msg['operator'][:64]!r} from {auth.peer(ch)}"
            reply: "queue.Queue[dict]" = queue.Queue(1)
            self.events.put(OperatorCommand(msg, origin, reply.put, time.time()))
            ch.sock.settimeout(REPLY_TIMEOUT_S)
            try:
                ch.send(reply.get(timeout=REPLY_TIMEOUT_S))
            except queue.Empty:
                ch.send(make("control_reply", ok=False, message="the coordinator did not answer in time"))
        except OSError:
            pass
        finally:
            ch.close()


def _reply_error(ch: Channel, message: str) -> None:
    try:
        ch.send(make("control_reply", ok=False, message=message))
    except OSError:
        pass


def token_for(address: str) -> str | None:
    """The operator token of the running job whose control address is ``address``."""
    return next((j.get("token") for j in running_jobs() if j.get("control") == address), None)


def running_jobs() -> list[dict]:
    """The run files of launchers still alive on this machine."""
    out = []
    for f in sorted(run_dir().glob("*.json")):
        try:
            info = json.loads(f.read_text())
            os.kill(int(info["pid"]), 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.append(info)
    return out


def send(address: str, spec: str, token: str) -> dict:
    """Send the command ``inject spec`` to the job at ``address``, proven with ``token``; the reply."""
    ch = auth.connect(address, auth.OPERATOR, token, timeout=REPLY_TIMEOUT_S,
                      spec=spec, operator=f"{getpass.getuser()} pid {os.getpid()}")
    try:
        ch.sock.settimeout(REPLY_TIMEOUT_S + 5)
        reply = ch.recv()
        if reply is None:
            raise ProtocolError("the job closed the connection without answering")
        return reply
    finally:
        ch.close()
