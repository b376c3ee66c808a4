"""Placement of a queued job on the service's free hosts (pure)."""
from hotspare.service.placement import Host, place


def hosts(*specs):
    return [Host(name, tuple(f"{name}/cpu{i}" for i in range(n)), spare) for name, n, spare in specs]


def test_ranks_go_to_worker_hosts_with_room_and_spares_to_spare_hosts():
    free = hosts(("b", 2, False), ("a", 2, False), ("c", 1, False), ("s2", 1, True), ("s1", 1, True))
    assert place(free, 2, 2, 2) == (["a", "b"], ["s1", "s2"])
    assert place(free, 2, 2, 1) == (["a", "b"], ["s1"])
    assert place(free, 3, 1, 0) == (["a", "b", "c"], [])


def test_too_few_worker_hosts_waits_and_a_job_without_a_spare_host_starts_without():
    free = hosts(("a", 2, False), ("s", 4, True))
    assert place(free, 2, 2, 1) is None            # a spare host never takes ranks
    assert place(hosts(("a", 1, False)), 1, 2, 0) is None
    assert place(hosts(("a", 2, False)), 1, 2, 3) == (["a"], [])
