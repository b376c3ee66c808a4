"""The pooled agent's side of a host's lifecycle (``hotspare.agent.pooled.ServiceLink``) over a
real TCP link: it takes one job at a time (an ``assign`` while a job still runs there is
refused, the running job kept), and a ``shutdown`` for the job it already left is answered
with ``released`` again, so the service's host never waits on a word that crossed the job's end."""
import socket
import threading

from hotspare.agent.pooled import ServiceLink
from hotspare.protocol.channel import Channel
from hotspare.protocol.messages import make


def tcp_pair():
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    server.close()
    return Channel(a), Channel(b)


def assign(job):
    return make("assign", job=job, script="/x/train.py", args=[], env={}, devices=["hosta/cpu0"],
                telemetry_period=0.0)


def test_one_job_at_a_time_and_a_repeated_shutdown_is_answered_with_released():
    agent_side, service = tcp_pair()
    said = []
    link = ServiceLink("127.0.0.1:9", b"s" * 32, "hosta", ["hosta/cpu0"], False, say=said.append)
    link._channel = agent_side
    link.fenced.set()                  # when the test hangs up, the link does not try to reconnect
    reader = threading.Thread(target=link._read, args=(agent_side, None), daemon=True)
    reader.start()
    try:
        service.sock.settimeout(10)
        service.send(assign("j1"))
        assert link.assignments.get(timeout=10)["job"] == "j1"
        service.send(assign("j2"))                       # a service bug: the host still works for j1
        refused = service.recv()
        assert refused["type"] == "refused" and refused["command"] == "assign" and "j1 still runs" in refused["message"]
        assert link.job.job == "j1" and link.assignments.empty()
        link.end_job()                                   # j1's part ended here
        service.send(make("shutdown", grace=0.0))        # the service asks again
        assert service.recv() == make("released", job="j1")
        service.send(assign("j2"))                       # now it takes the next
        assert link.assignments.get(timeout=10)["job"] == "j2" and link.job.job == "j2"
    finally:
        service.close()
        reader.join(timeout=10)
