"""Deleting a committed step, and named tags beside step numbers (``best``, ``release``).

A tag is a small JSON file ``ROOT/tags/<name>`` in every storage domain, moved by
compare-and-swap on its version token (two jobs or threads moving one tag cannot
lose an update or tear the file), written by each domain's leader under the lease.
A tagged step is kept by retention; deleting it is refused until the tag moves.

Deleting renames every version of the step into the trash (atomic: it is gone
for every reader at once), moves `latest` back to the newest step left if it
pointed at the deleted one, and then removes the bytes.
"""

from __future__ import annotations

import re
import time
from typing import Any

from ckptguard.errors import CheckpointError, MalformedRecordError, StepNotFoundError
from ckptguard.protocol import layout, records
from ckptguard.protocol.cas import Keep, Put, Remove, swap
from ckptguard.protocol.decisions import DomainListing, Listing, agreed_listing
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.records import TagRecord
from ckptguard.protocol.session import Session

_TAG_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,127}$")

Tags = dict[str, int]


def check_tag_name(name: str) -> str:
    if not isinstance(name, str) or not _TAG_NAME.match(name):
        raise ValueError(
            f"a tag name is 1-128 letters, digits, '_', '-', '.', '=' (not starting with '.' or '-'), got {name!r}"
        )
    return name


def _tag_path(session: Session, name: str) -> str:
    return session.storage.path(layout.TAGS, name)


def leader_tags(session: Session) -> Tags | None:
    """The tags this domain's leader sees (None on other ranks)."""
    if not session.topo.is_leader:
        return None
    storage = session.storage
    out: Tags = {}
    for entry in storage.listdir(storage.path(layout.TAGS)):
        if not _TAG_NAME.match(entry):
            continue
        path = _tag_path(session, entry)
        try:
            out[entry] = records.decode(storage.read_bytes(path), TagRecord, path).step
        except (OSError, CheckpointError):
            continue  # unreadable: not a tag (ls and verify say so)
    return out


def agreed_tags(reports: list[Tags | None]) -> Tags:
    """Tags every domain's leader sees pointing at the same step."""
    views = [r for r in reports if r is not None]
    if not views:
        return {}
    common = set(views[0].items())
    for v in views[1:]:
        common &= set(v.items())
    return dict(common)


def read_tags(session: Session) -> Tags:
    """The tags of the root, agreed across storage domains (collective)."""
    tags: Tags = session.comm.step(f"read the tags of {session.url}", lambda: leader_tags(session), agreed_tags)
    return tags


def set_tag(session: Session, name: str, step: int | None, committed: Listing, expect: Any = ...) -> int | None:
    """Point tag ``name`` at ``step`` (None removes it) in every domain; the step it pointed at before.

    ``expect``: only if the tag points at this step now (None: only if it does not exist),
    else CheckpointError, in every domain alike (collective).
    """
    check_tag_name(name)
    if step is not None and step not in committed:
        raise StepNotFoundError(
            f"cannot tag step {step} as {name!r}: it is not a committed checkpoint in "
            f"{session.url}; committed steps: {sorted(committed) or 'none'}"
        )
    storage = session.storage
    path = _tag_path(session, name)

    def decide(current: TagRecord | None) -> Put[TagRecord, int | None] | Remove[int | None] | Keep[int | None]:
        before = current.step if current is not None and current.step >= 0 else None
        if expect is not ... and before != expect:
            raise CheckpointError(
                f"tag {name!r} in {session.url} points at step {before}, not {expect}: another writer moved it",
                path=path,
            )
        if step is None:
            return Remove(before) if current is not None else Keep(before)
        return Put(
            TagRecord(
                step=step, tag=name, dir=CheckpointName(step, committed[step].version).dirname, updated_at=time.time()
            ),
            before,
        )

    def move() -> int | None:
        if not session.topo.is_leader:
            return None
        assert session.lease is not None
        session.lease.check()
        storage.makedirs(storage.path(layout.TAGS))
        # The fence is checked before every swap, the retries after a conflict included: a job that lost
        # the root between two tries moves nothing.
        moved: int | None = swap(
            storage,
            path,
            decode=_tag_record,
            encode=records.encode,
            decide=decide,
            fence=lambda: session.root.guard(f"move tag {name!r}"),
            what=f"move tag {name!r}",
        )
        return moved

    def first(reports: list[int | None]) -> int | None:
        return next((r for i, r in enumerate(reports) if i in session.topo.leaders), None)

    what = f"tag step {step} as {name!r}" if step is not None else f"remove tag {name!r}"
    before: int | None = session.comm.step(what, move, first, where=session.url)
    return before


def delete_step(session: Session, step: int, committed: Listing, tags: Tags) -> tuple[Listing, list[str]]:
    """Retire every version of ``step`` in every domain (collective); what is committed now, and the
    retired paths (this leader's) whose bytes the caller removes."""
    if step not in committed:
        raise StepNotFoundError(
            f"cannot delete step {step}: it is not a committed checkpoint in {session.url}; "
            f"committed steps: {sorted(committed) or 'none'}"
        )
    holding = sorted(n for n, s in tags.items() if s == step)
    if holding:
        raise CheckpointError(
            f"step {step} is tagged {', '.join(map(repr, holding))}: move or remove the tag "
            f"first (ck.tag(name, other_step) or ck.untag(name))"
        )
    root = session.root
    retired: list[str] = []

    def retire() -> DomainListing | None:
        if not session.topo.is_leader:
            return None
        assert session.lease is not None
        session.lease.check()
        for name in root.committed():
            if name.step == step:
                path = root.retire(root.dir(name))
                if path is not None:
                    retired.append(path)
        left = root.listing()
        root.latest_after_delete(step, left)
        root.prune_quarantine(left)
        return left

    listing: Listing = session.comm.step(f"delete step {step}", retire, agreed_listing, where=session.url)
    return listing, retired


def _tag_record(data: bytes) -> TagRecord:
    try:
        return records.decode(data, TagRecord, layout.TAGS)
    except MalformedRecordError:
        return TagRecord(step=-1)  # unreadable: a tag naming no step, which untag removes


def tagged_step(session: Session, tag: str | None, step: int | None, tags: Tags) -> tuple[int | None, Tags]:
    """The step ``tag`` names (read afresh, collective), or ``step`` when no tag is given; and the tags."""
    if tag is None:
        return step, tags
    if step is not None:
        raise ValueError("pass step= or tag=, not both")
    tags = read_tags(session)
    if tag not in tags:
        raise StepNotFoundError(f"no tag {tag!r} in {session.url}; tags: {sorted(tags) or 'none'}")
    return tags[tag], tags
