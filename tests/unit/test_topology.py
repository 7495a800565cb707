"""The storage-domain decision from probe reports (pure function: every layout, and inconsistent views)."""

from __future__ import annotations

from ckptguard.protocol.topology import _decide, to_ranges

HOSTS = ["a", "a", "b", "b"]
FIRST = {"a": 0, "b": 2}


def lister(ranks: list[int]) -> dict:
    return {"lister": True, "seen": to_ranges(ranks)}


FOLLOWER = {"lister": False, "sees_host_first": True}


def test_one_shared_filesystem() -> None:
    reports = [lister([0, 1, 2, 3]), FOLLOWER, lister([0, 1, 2, 3]), FOLLOWER]
    assert _decide(reports, HOSTS, FIRST) == (((0, 1, 2, 3),), "")


def test_node_local_disks() -> None:
    reports = [lister([0, 1]), FOLLOWER, lister([2, 3]), FOLLOWER]
    assert _decide(reports, HOSTS, FIRST) == (((0, 1), (2, 3)), "")


def test_mixed_rank_with_private_mount_on_a_shared_host() -> None:
    # rank 1 cannot see its host's first rank: it listed for itself and saw only itself
    reports = [lister([0, 2, 3]), lister([1]), lister([0, 2, 3]), FOLLOWER]
    assert _decide(reports, HOSTS, FIRST) == (((0, 2, 3), (1,)), "")


def test_asymmetric_views_are_refused() -> None:
    # rank 0 sees rank 2's mark but rank 2 does not see rank 0's: a stale cache, not a topology
    reports = [lister([0, 1, 2]), FOLLOWER, lister([2, 3]), FOLLOWER]
    domains, problem = _decide(reports, HOSTS, FIRST)
    assert domains == () and "differs" in problem


def test_rank_that_cannot_see_itself_is_refused() -> None:
    reports = [lister([1]), FOLLOWER, lister([2, 3]), FOLLOWER]
    domains, problem = _decide(reports, HOSTS, FIRST)
    assert domains == () and "its own probe file" in problem


def test_scale_is_linear() -> None:
    n = 16384
    hosts = [f"h{r // 8}" for r in range(n)]
    first = {h: r for r, h in reversed(list(enumerate(hosts)))}
    reports = [lister(list(range(n))) if first[hosts[r]] == r else FOLLOWER for r in range(n)]
    domains, problem = _decide(reports, hosts, first)
    assert problem == "" and domains == (tuple(range(n)),)
