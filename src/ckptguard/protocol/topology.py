"""Which ranks share the checkpoint storage: discovered by a probe, never assumed
(*one leader per storage domain, discovered*).

Every rank creates a uniquely named file in a fresh probe directory; after a
barrier, ranks look for each other's files. Ranks that see each other share a
storage domain; the lowest rank of each domain is its leader. Fresh names matter
on NFS-like filesystems: a name this node never looked up cannot be in its
negative lookup cache, so the answer comes from the server.

To keep the probe cheap at scale, hostnames are used only to pick who lists
what: the first rank of each host lists the probe directory, the other ranks of
that host look up just that rank's file. A rank that cannot see its host's first
rank (containers with different mounts, say) lists the directory itself. The
decision is always made from what ranks actually saw.
"""

from __future__ import annotations

import functools
import os
import uuid
from dataclasses import dataclass
from typing import Any

from ckptguard.comm import Comm, hostname
from ckptguard.errors import StorageError
from ckptguard.protocol import layout
from ckptguard.storage import StorageBackend

Ranges = list[tuple[int, int]]  # sorted half-open [start, end) ranges of ranks


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    domains: tuple[tuple[int, ...], ...]  # each sorted; ordered by leader
    hosts: tuple[str, ...]  # per rank

    @property
    def domain_index(self) -> int:
        return self.domain_of(self.rank)

    @property
    def domain(self) -> tuple[int, ...]:
        return self.domains[self.domain_index]

    @property
    def leader(self) -> int:
        return self.domain[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def leaders(self) -> list[int]:
        return [d[0] for d in self.domains]

    def domain_of(self, rank: int) -> int:
        return self._index()[rank]

    def _index(self) -> dict[int, int]:
        cache = self.__dict__.get("_idx")
        if cache is None:
            cache = {r: i for i, d in enumerate(self.domains) for r in d}
            object.__setattr__(self, "_idx", cache)
        return cache

    def describe(self) -> str:
        if len(self.domains) == 1:
            return f"all {self.world_size} ranks share one storage domain (leader rank 0)"
        parts = [f"[{_fmt_ranks(d)}] leader {d[0]}" for d in self.domains]
        return f"{len(self.domains)} storage domains: " + "; ".join(parts)


def _fmt_ranks(ranks: tuple[int, ...] | list[int]) -> str:
    out: list[str] = []
    for start, end in to_ranges(sorted(ranks)):
        out.append(str(start) if end == start + 1 else f"{start}-{end - 1}")
    return ",".join(out)


def to_ranges(ranks: list[int]) -> Ranges:
    out: Ranges = []
    for r in ranks:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def from_ranges(ranges: Ranges) -> set[int]:
    return {r for a, b in ranges for r in range(a, b)}


def host_domains(comm: Comm) -> Topology:
    """Domains by hostname, for read-only roots where nothing can be written to probe."""
    hosts = _all_hosts(comm)
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    domains = tuple(sorted((tuple(v) for v in by_host.values()), key=lambda d: d[0]))
    return Topology(comm.rank, comm.world_size, domains, tuple(hosts))


def _all_hosts(comm: Comm) -> list[str]:
    hosts: list[str] = comm.step("report its host name", hostname, lambda names: names)
    return hosts


def probe_storage_domains(
    comm: Comm, storage: StorageBackend, attempts: int = 3, probe_prefix: str = layout.PROBE + "/"
) -> Topology:
    """Run the probe (collective). Raises CheckpointError if a rank cannot write to the root.

    Probe directories are ``ROOT/<probe_prefix><nonce>``.
    """
    hosts = _all_hosts(comm)
    host_first = {h: r for r, h in reversed(list(enumerate(hosts)))}
    my_first = host_first[hosts[comm.rank]]
    last_problem = ""
    for _ in range(attempts):
        nonce: str = comm.step("start a storage probe", decide_fn=lambda _: uuid.uuid4().hex)
        probe_dir = storage.path(probe_prefix + nonce)
        # 1. every rank leaves a mark; the agreement means every mark is written
        comm.step(
            "write a probe file into the checkpoint root",
            functools.partial(_leave_mark, storage, probe_dir, comm.rank, nonce),
            where=storage.root,
        )
        # 2. look
        domains, problem = comm.step(
            "look for the other ranks' probe files",
            functools.partial(_look, storage, probe_dir, comm.rank, my_first, nonce),
            lambda reports: _decide(reports, hosts, host_first),
            where=storage.root,
        )
        # 3. clean up: each domain leader removes the probe directory it sees
        if domains and comm.rank in (d[0] for d in domains):
            storage.remove_tree(probe_dir)
        if domains:
            return Topology(comm.rank, comm.world_size, tuple(tuple(d) for d in domains), tuple(hosts))
        last_problem = problem
    raise StorageError(
        f"ranks disagree about which of them share the checkpoint root {storage.root} "
        f"after {attempts} probes: {last_problem}. This happens when a shared filesystem's "
        "caches are inconsistent for longer than the probe; check the mount options."
    )


def _leave_mark(storage: StorageBackend, probe_dir: str, rank: int, nonce: str) -> None:
    storage.makedirs(probe_dir)
    stream = storage.open_new(os.path.join(probe_dir, f"rank-{rank}"))
    try:
        stream.write([memoryview(f"{nonce}:{rank}".encode())])
        stream.sync()
    finally:
        stream.close()


def _look(storage: StorageBackend, probe_dir: str, rank: int, host_first: int, nonce: str) -> dict[str, Any]:
    """Its host's first rank (or a rank that cannot see that one's mark) lists; the others just look it up."""
    if rank == host_first or not _sees(storage, probe_dir, host_first, nonce):
        return {"lister": True, "seen": to_ranges(_list_marks(storage, probe_dir))}
    return {"lister": False, "sees_host_first": True}


def _sees(storage: StorageBackend, probe_dir: str, rank: int, nonce: str) -> bool:
    try:
        data = storage.read_bytes(os.path.join(probe_dir, f"rank-{rank}"))
    except FileNotFoundError:
        return False
    return data == f"{nonce}:{rank}".encode()


def _list_marks(storage: StorageBackend, probe_dir: str) -> list[int]:
    seen = []
    for name in storage.listdir(probe_dir):
        if name.startswith("rank-") and name[5:].isdigit():
            seen.append(int(name[5:]))
    return sorted(seen)


def _decide(
    reports: list[dict[str, Any]], hosts: list[str], host_first: dict[str, int]
) -> tuple[tuple[tuple[int, ...], ...], str]:
    """From what every rank saw, the storage domains; or () and the inconsistency found.

    Ranks sharing storage must all see the same set of marks, so listers are
    grouped by what they saw (kept as rank ranges: O(ranks), not O(ranks^2), at
    scale). Every other rank joins the group of its host's first rank, which it
    saw. A group is a domain if its members are exactly the ranks its listers saw.
    """
    groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
    group_of: dict[int, tuple[tuple[int, int], ...]] = {}
    for r, rep in enumerate(reports):
        if rep["lister"]:
            key = tuple((int(a), int(b)) for a, b in rep["seen"])
            if not any(a <= r < b for a, b in key):
                return (), f"rank {r} cannot see its own probe file"
            groups.setdefault(key, []).append(r)
            group_of[r] = key
    for r, rep in enumerate(reports):
        if not rep["lister"]:
            key = group_of[host_first[hosts[r]]]
            if not any(a <= r < b for a, b in key):
                return (), f"rank {r} sees rank {host_first[hosts[r]]}'s probe file but not the reverse"
            groups[key].append(r)
    domains = []
    for key, members in groups.items():
        members.sort()
        if tuple(to_ranges(members)) != key:
            seen = from_ranges(list(key))
            extra = sorted(seen - set(members))[:5]
            missing = sorted(set(members) - seen)[:5]
            return (), (
                f"ranks {_fmt_ranks(members[:5])}... see ranks {extra} whose own view differs, "
                f"and are seen by none of {missing}"
            )
        domains.append(tuple(members))
    return tuple(sorted(domains, key=lambda d: d[0])), ""


def probe_object_store(comm: Comm, storage: StorageBackend, write: bool = True) -> Topology:
    """All ranks form one storage domain on an object store: checked, without listing (collective).

    A bucket is one namespace for every client that reaches the same endpoint, so
    there is no per-node storage to discover; what can differ is the endpoint or
    credentials a rank was given. Every rank writes a mark (so a rank that may not
    write fails now, by name), then every rank reads rank 0's mark back (a GET, which
    is consistent, where a listing may be stale). A rank that cannot see it reaches
    another store, and is refused. Read-only roots skip the marks.
    """
    hosts = _all_hosts(comm)
    topo = Topology(comm.rank, comm.world_size, (tuple(range(comm.world_size)),), tuple(hosts))
    if not write or comm.world_size == 1:
        return topo
    nonce: str = comm.step("start a storage probe", decide_fn=lambda _: uuid.uuid4().hex)
    probe_dir = storage.path(layout.PROBE + "/" + nonce)
    mark = os.path.join(probe_dir, f"rank-{comm.rank}")
    comm.step(
        "write a probe object into the checkpoint root",
        functools.partial(_leave_mark, storage, probe_dir, comm.rank, nonce),
        where=storage.root,
    )

    def look() -> None:
        if not _sees(storage, probe_dir, 0, nonce):
            raise StorageError(
                f"rank {comm.rank} cannot see the probe object rank 0 wrote to {storage.root}: the ranks reach "
                "different object stores (check AWS_ENDPOINT_URL, storage_options and credentials on every node)",
                rank=comm.rank,
                path=probe_dir,
            )

    try:
        comm.step("read rank 0's probe object", look, where=storage.root)
    finally:
        storage.delete(mark)
    return topo
