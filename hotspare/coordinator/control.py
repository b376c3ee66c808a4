"""The launcher's control endpoint: operator commands for a running job (``hotspare inject``).

One TCP listener on the launcher's host. A client sends one JSON-lines message (the same
versioned, validated protocol as the workers'), the coordinator's event loop handles it like any
other event, and the reply goes back on the same connection. A malformed or refused command gets
an error reply and changes nothing; the job never notices.

Each running launcher leaves a run file (``~/.hotspare/runs/<pid>.json``, or under
``$HOTSPARE_RUN_DIR``) naming its control address, so ``hotspare inject`` finds the job without
being told where it is; the file goes when the launcher exits.
"""
from __future__ import annotations

import json
import os
import queue
import socket
import time
from pathlib import Path

from hotspare.errors import ProtocolError
from hotspare.protocol.channel import Channel, serve
from hotspare.protocol.messages import make

ENV_RUN_DIR = "HOTSPARE_RUN_DIR"
REPLY_TIMEOUT_S = 10.0


def run_dir() -> Path:
    return Path(os.environ.get(ENV_RUN_DIR) or "~/.hotspare/runs").expanduser()


class ControlServer:
    def __init__(self, events: "queue.Queue", host: str = "127.0.0.1", describe: dict | None = None):
        self.events = events
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self.run_file = run_dir() / f"{os.getpid()}.json"
        try:
            self.run_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.run_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "control": self.address, "started": time.time(),
                                       **(describe or {})}))
            os.replace(tmp, self.run_file)
        except OSError:             # a read-only home: `hotspare inject --job ADDRESS` still works
            self.run_file = None
        serve(self._server, self._serve, "hotspare-control-server")

    def close(self) -> None:
        self._server.close()
        if self.run_file is not None:
            try:
                self.run_file.unlink()
            except OSError:
                pass

    def _serve(self, ch: Channel) -> None:
        try:
            ch.sock.settimeout(REPLY_TIMEOUT_S)
            msg = ch.recv()
            if msg is None:
                return
            if msg["type"] != "inject":
                raise ProtocolError(f"the control endpoint takes 'inject', not {msg['type']!r}")
            reply: "queue.Queue[dict]" = queue.Queue(1)
            self.events.put(("control", "", (msg, reply.put), time.time()))
            try:
                ch.send(reply.get(timeout=REPLY_TIMEOUT_S))
            except queue.Empty:
                ch.send(make("control_reply", ok=False, message="the coordinator did not answer in time"))
        except (OSError, ProtocolError) as e:
            try:
                ch.send(make("control_reply", ok=False, message=str(e)))
            except OSError:
                pass
        finally:
            ch.close()


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


def send(address: str, msg: dict) -> dict:
    host, port = address.rsplit(":", 1)
    ch = Channel.connect(host, int(port), timeout=REPLY_TIMEOUT_S)
    try:
        ch.sock.settimeout(REPLY_TIMEOUT_S + 5)
        ch.send(msg)
        reply = ch.recv()
        if reply is None:
            raise ProtocolError("the job closed the connection without answering")
        return reply
    finally:
        ch.close()
