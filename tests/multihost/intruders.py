"""Clients without the job's secret, run inside one host's namespace by test_refusals.py:

    python intruders.py HOST:PORT CASE [CASE ...]

Each case opens a connection of its own (all at once, in threads) and does one wrong thing; for
each, one JSON line on stdout: the case, the client's local port (the listener logs its peer
address) and what came back until the listener hung up (decoded lines, or the socket error).
"""
from __future__ import annotations

import json
import socket
import sys
import threading

WRONG_PROOF = "0" * 64


def _line(msg: dict) -> bytes:
    return json.dumps(msg).encode() + b"\n"


CASES = {
    "garbage": lambda: b"\x16\x03\x01\x00\xff\xfe not a control message at all\n",
    "wrong_proof": lambda: _line({"v": 1, "type": "agent_hello", "node": "intruder", "pid": 4242, "devices": [],
                                  "device_faults": False, "proof": WRONG_PROOF}),
    "silent": lambda: b"",
    "oversized": lambda: b'{"v": 1, "type": "agent_hello", "node": "' + b"x" * 64 * 1024 + b'"}\n',
    "not_hello": lambda: _line({"v": 1, "type": "exited", "worker": "w2", "code": 0}),
    "worker_hello": lambda: _line({"v": 1, "type": "hello", "worker": "w2", "pid": 4242, "role": "active",
                                   "proof": WRONG_PROOF}),
}


def attempt(address: str, case: str, out: list[dict]) -> None:
    host, port = address.rsplit(":", 1)
    got: list = []
    result = {"case": case, "port": None, "got": got, "error": None}
    try:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            result["port"] = sock.getsockname()[1]
            sock.settimeout(20)
            lines = sock.makefile("rb")
            got.append(json.loads(lines.readline()))          # the challenge
            sock.sendall(CASES[case]())
            for raw in lines:
                got.append(json.loads(raw))
    except OSError as e:          # refused, reset while sending, or timed out
        result["error"] = f"{type(e).__name__}: {e}"
    out.append(result)


def main(argv: list[str]) -> int:
    address, cases = argv[0], argv[1:]
    out: list[dict] = []
    threads = [threading.Thread(target=attempt, args=(address, c, out)) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in out:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
