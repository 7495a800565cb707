"""Crash states: the disk contents a power cut may leave, built from a recording under a crash model.

A crash state is fixed by a crash point ``k`` (operations ``ops[:k]`` were issued, none after)
and by which of the issued operations reached the disk. Two models say which may be lost:

**A (ext4 ``data=ordered``-like).** Entry operations (create, mkdir, link, unlink, rmdir,
rename, symlink) persist as an in-order prefix of those issued; every one issued before
the last ``fsync``/``fsyncdir`` is in it (a journal commit carries all earlier metadata).
File data not covered by an ``fsync`` of that file may be lost or torn: each 4 KiB block
holds the last synced or the newest bytes, and the size is the last synced or the newest.

**B (weakest POSIX reading).** An operation survives only if an fsync covers it: file data
by a later ``fsync``/``fdatasync`` of the file, a directory entry by a later ``fsyncdir``
of its parent (for a rename, of the destination's parent; a rename is one atomic unit).
``fsync`` of a file does *not* persist its directory entry. Anything not covered may be
lost in any combination (data as in A, at 4 KiB granularity).

The state before the recording started is durable. Operations act on inodes (ids the
recorder assigned), so an entry whose parent's own entry was lost lands in an unreachable
directory, as on a real disk.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .bed import Recording

BLOCK = 4096
ENTRY_OPS = frozenset({"create", "mkdir", "symlink", "link", "unlink", "rmdir", "rename"})
MODELS = ("A", "B")


@dataclass(frozen=True)
class Choice:
    """How one crash state was made (enough to rebuild it: a regression test keeps this)."""

    model: str
    point: int  # ops[:point] were issued
    persisted: frozenset[int]  # indices of the entry operations that reached the disk
    data: str  # "latest", "synced" or "mix:<seed>"

    def describe(self) -> str:
        return f"model {self.model}, crash after op {self.point}, data {self.data}"


@dataclass
class State:
    choice: Choice
    files: dict[str, bytes | None]  # path -> bytes (None: a directory), reachable from the root
    symlinks: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for p in sorted(self.files):
            c = self.files[p]
            h.update(p.encode() + b"\0" + (b"D" if c is None else b"F" + hashlib.sha256(c).digest()))
        for p in sorted(self.symlinks):
            h.update(b"L" + p.encode() + b"\0" + self.symlinks[p].encode())
        return h.hexdigest()

    def write(self, dest: str) -> None:
        """Materialise the state under ``dest`` (a tmpfs is fine)."""
        os.makedirs(dest, exist_ok=True)
        for p in sorted(self.files):
            full = os.path.join(dest, p)
            c = self.files[p]
            if c is None:
                os.makedirs(full, exist_ok=True)
            else:
                with open(full, "wb") as f:
                    f.write(c)
        for p, t in self.symlinks.items():
            os.symlink(t, os.path.join(dest, p))


class CrashModel:
    """Builds crash states of one recording."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        self.ops = rec.ops
        self.root = int(rec.initial["root"])
        self.initial: dict[int, dict[str, Any]] = {int(k): v for k, v in rec.initial["inodes"].items()}
        self.entry_idx = [i for i, o in enumerate(self.ops) if o["op"] in ENTRY_OPS]
        self.sync_idx = [i for i, o in enumerate(self.ops) if o["op"] in ("fsync", "fsyncdir")]
        # For model B: the index of the first fsyncdir that covers each entry operation.
        self.covered_at: dict[int, int] = {}
        pending: dict[int, list[int]] = {}
        for i, o in enumerate(self.ops):
            if o["op"] in ENTRY_OPS:
                d = o["dparent"] if o["op"] == "rename" else o["parent"]
                pending.setdefault(d, []).append(i)
            elif o["op"] == "fsyncdir":
                for j in pending.pop(o["ino"], []):
                    self.covered_at[j] = i

    def marks(self, prefix: str) -> list[int]:
        """Indices of the marks whose label starts with ``prefix`` (a crash point > index is after it)."""
        return [i for i, o in enumerate(self.ops) if o["op"] == "mark" and o["label"].startswith(prefix)]

    # -- what may be lost at crash point k ---------------------------------------------------
    def issued_entries(self, k: int) -> list[int]:
        return [i for i in self.entry_idx if i < k]

    def a_min_prefix(self, k: int) -> int:
        """Model A: how many of the issued entry operations are certainly durable at k."""
        last_sync = max((i for i in self.sync_idx if i < k), default=-1)
        return sum(1 for i in self.entry_idx if i < last_sync)

    def b_uncovered(self, k: int) -> tuple[list[int], list[int]]:
        """Model B: (covered, uncovered) entry operations issued before k."""
        cov, unc = [], []
        for i in self.issued_entries(k):
            (cov if self.covered_at.get(i, len(self.ops)) < k else unc).append(i)
        return cov, unc

    # -- building ------------------------------------------------------------------------------
    def build(self, choice: Choice) -> State:
        k = choice.point
        dirs: dict[int, dict[str, int]] = {}
        kinds: dict[int, str] = {}
        targets: dict[int, str] = {}
        synced: dict[int, bytes] = {}
        latest: dict[int, bytearray] = {}
        for ino, node in self.initial.items():
            kinds[ino] = node["kind"]
            if node["kind"] == "dir":
                dirs[ino] = dict(node["entries"])
            elif node["kind"] == "symlink":
                targets[ino] = node["target"]
            else:
                synced[ino] = self.rec.blob(node["blob"])
                latest[ino] = bytearray(synced[ino])
        for i in range(k):
            o = self.ops[i]
            op = o["op"]
            if op == "write":
                buf = latest.setdefault(o["ino"], bytearray())
                data = self.rec.blob(o["blob"])
                end = o["off"] + len(data)
                if len(buf) < end:
                    buf.extend(b"\0" * (end - len(buf)))
                buf[o["off"] : end] = data
            elif op == "truncate":
                buf = latest.setdefault(o["ino"], bytearray())
                del buf[o["size"] :]
                buf.extend(b"\0" * (o["size"] - len(buf)))
            elif op == "fsync":
                synced[o["ino"]] = bytes(latest.get(o["ino"], b""))
            elif op in ENTRY_OPS:
                if op == "create":
                    kinds[o["ino"]] = "file"
                    latest.setdefault(o["ino"], bytearray())
                elif op == "mkdir":
                    kinds[o["ino"]] = "dir"
                    dirs.setdefault(o["ino"], {})
                elif op == "symlink":
                    kinds[o["ino"]] = "symlink"
                    targets[o["ino"]] = o["target"]
                if i not in choice.persisted:
                    continue
                if op in ("create", "mkdir", "symlink", "link"):
                    dirs.setdefault(o["parent"], {})[o["name"]] = o["ino"]
                elif op in ("unlink", "rmdir"):
                    dirs.setdefault(o["parent"], {}).pop(o["name"], None)
                elif op == "rename":
                    src = dirs.setdefault(o["sparent"], {})
                    if src.get(o["sname"]) == o["ino"]:
                        del src[o["sname"]]
                    dirs.setdefault(o["dparent"], {})[o["dname"]] = o["ino"]
        rng = random.Random(choice.data) if choice.data.startswith("mix:") else None
        contents: dict[int, bytes] = {}
        for ino, buf in latest.items():
            new, old = bytes(buf), synced.get(ino, b"")
            if choice.data == "latest" or new == old:
                contents[ino] = new
            elif choice.data == "synced":
                contents[ino] = old
            else:
                assert rng is not None
                contents[ino] = _mix(old, new, rng)
        files: dict[str, bytes | None] = {}
        links: dict[str, str] = {}
        seen: set[int] = set()

        def walk(ino: int, rel: str) -> None:
            if ino in seen:  # a cycle (only a weird model B state could make one): cut it
                return
            seen.add(ino)
            for name, child in sorted(dirs.get(ino, {}).items()):
                p = f"{rel}/{name}" if rel else name
                kind = kinds.get(child, "file")
                if kind == "dir":
                    files[p] = None
                    walk(child, p)
                elif kind == "symlink":
                    links[p] = targets[child]
                else:
                    files[p] = contents.get(child, b"")
            seen.discard(ino)

        walk(self.root, "")
        return State(choice, files, links)

    # -- enumeration ------------------------------------------------------------------------
    def candidates(self, model: str, seed: int) -> Iterator[Choice]:
        """Crash states of ``model``, most telling first: the extremes at every crash point
        (everything issued persisted; only what is certainly durable), then every single
        optional operation lost or kept, then seeded random combinations (without end:
        the caller stops on its budget or when new states stop appearing)."""
        rng = random.Random(f"{seed}:{model}")
        n = len(self.ops)
        points = list(range(n + 1))
        rng.shuffle(points)
        for k in points:
            if model == "A":
                issued = self.issued_entries(k)
                yield Choice("A", k, frozenset(issued), "latest")
                yield Choice("A", k, frozenset(issued[: self.a_min_prefix(k)]), "synced")
            else:
                cov, unc = self.b_uncovered(k)
                yield Choice("B", k, frozenset(cov + unc), "latest")
                yield Choice("B", k, frozenset(cov), "synced")
        rng.shuffle(points)
        for k in points:
            if model == "A":
                issued = self.issued_entries(k)
                for m in range(self.a_min_prefix(k), len(issued)):
                    yield Choice("A", k, frozenset(issued[:m]), "latest")
            else:
                cov, unc = self.b_uncovered(k)
                for u in unc:
                    yield Choice("B", k, frozenset(cov + [x for x in unc if x != u]), "latest")
                    yield Choice("B", k, frozenset([*cov, u]), "synced")
        while True:
            k = rng.randrange(n + 1)
            mix = f"mix:{rng.getrandbits(48)}"
            if model == "A":
                issued = self.issued_entries(k)
                m = rng.randint(self.a_min_prefix(k), len(issued))
                yield Choice("A", k, frozenset(issued[:m]), mix)
            else:
                cov, unc = self.b_uncovered(k)
                yield Choice("B", k, frozenset(cov + [u for u in unc if rng.random() < 0.5]), mix)


def _mix(old: bytes, new: bytes, rng: random.Random) -> bytes:
    """Each 4 KiB block from the synced or the newest bytes; the size is one of the two."""
    size = rng.choice((len(old), len(new)))
    out = bytearray()
    for start in range(0, size, BLOCK):
        src = rng.choice((old, new))
        block = src[start : start + BLOCK]
        out += block + b"\0" * (min(BLOCK, size - start) - len(block))
    return bytes(out[:size])
