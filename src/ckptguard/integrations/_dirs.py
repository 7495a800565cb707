"""The directory-commit pattern the HF Trainer and Accelerate integrations share.

A framework writes a checkpoint *directory* with its own code; ckptguard commits it:

1. the framework writes into a staging directory (``<staging root>/<name>.<attempt>/<name>``);
2. the main process commits it as a step of a ckptguard root, through ``files=`` of a rank-local
   ``Checkpointer`` (every file checksummed and fsynced, one atomic commit);
3. only then ``<base>/<name>`` appears, by one rename (for the framework's and the user's tools),
   and only then are old checkpoints rotated out: the visible directory first, then the step.

Every step here that removes or replaces something a reader can see (a visible directory, a staging
leftover) first checks that the job still holds the root's lease (``Checkpointer.check_lease``): a
job that stalled after its commit while another job took the root over raises LeaseLostError and
removes nothing of the new holder's.

Resume restores a committed step's files, verified, into a private directory per rank.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable

from ckptguard.checkpointer import Checkpointer
from ckptguard.errors import StepNotFoundError
from ckptguard.files import fsync_dir, makedirs_durable
from ckptguard.ranks import one_rank_acts

FILES_KEY = "checkpoint"


def same_dir(a: str, b: str) -> bool:
    """Whether two spellings name one directory (a symbolic link, ``..`` components, a trailing slash):
    by the file's identity where both exist, else by their resolved real paths.

    Args:
        a: a path.
        b: another path.

    Returns:
        True when both name the same directory.
    """
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare what they resolve to
        return os.path.realpath(a) == os.path.realpath(b)


def remove_visible(ck: Checkpointer, base: str, path: str, staging_root: str) -> None:
    """Remove a visible checkpoint directory: gone for every reader at once (a rename into
    ``staging_root``, on the same filesystem), then deleted; only while ``ck`` holds the lease."""
    ck.check_lease(f"remove {path}")
    trash = os.path.join(staging_root, f".trash-{os.path.basename(path)}.{uuid.uuid4().hex[:8]}")
    makedirs_durable(os.path.dirname(trash))
    os.rename(path, trash)
    fsync_dir(base)
    shutil.rmtree(trash, ignore_errors=True)


def publish(ck: Checkpointer, base: str, staging: str, name: str, staging_root: str) -> str:
    """Rename committed ``staging`` to ``base/name`` (replacing a directory of that name: one left by a
    save that never committed, or an older version of the step); only while ``ck`` holds the lease."""
    final = os.path.join(base, name)
    makedirs_durable(base)
    if os.path.lexists(final):
        remove_visible(ck, base, final, staging_root)
    ck.check_lease(f"publish {final}")
    os.rename(staging, final)
    fsync_dir(base)
    return final


def clear_staging(ck: Checkpointer, staging_root: str) -> None:
    """Remove every staging leftover: only while ``ck`` holds the root's lease (then no other save is
    in flight; a job that lost it would remove the new holder's save in progress)."""
    if os.path.isdir(staging_root) and os.listdir(staging_root):
        ck.check_lease(f"clear {staging_root}")
    for entry in os.listdir(staging_root) if os.path.isdir(staging_root) else ():
        shutil.rmtree(os.path.join(staging_root, entry), ignore_errors=True)


def rotate(
    ck: Checkpointer, limit: int | None, protected: set[int], base: str, name_of: dict[int, str], staging_root: str
) -> list[int]:
    """Keep the ``limit`` newest committed steps (and ``protected`` ones, and always the newest): delete the
    others, each visible directory first, then its committed step. Returns the steps deleted."""
    if limit is None or limit <= 0:
        return []
    steps = ck.steps()
    if len(steps) <= limit:
        return []
    keep_always = {steps[-1]} | (protected & set(steps))
    excess = len(steps) - max(limit, len(keep_always))
    deleted = []
    for s in steps:
        if excess <= 0:
            break
        if s in keep_always:
            continue
        visible = os.path.join(base, name_of.get(s, ""))
        if s in name_of and os.path.lexists(visible):
            remove_visible(ck, base, visible, staging_root)
        ck.delete(s)
        deleted.append(s)
        excess -= 1
    return deleted


def restore_step(root: str, wanted: int | None, target: str) -> int | None:
    """Restore committed step ``wanted`` (None: the newest intact one, falling back past a corrupt one
    with a warning) into ``target``; its step, or None if ``root`` holds none."""
    if not os.path.isdir(root):
        if wanted is not None:
            raise StepNotFoundError(f"step {wanted} is not a committed checkpoint in {root}: it does not exist")
        return None
    with Checkpointer(root, process_group="local", read_only=True) as ck:
        return ck.load({}, step=wanted, files={FILES_KEY: target})


def restore_on_every_rank(
    root: str,
    tmp: str,
    is_main: bool,
    restore_on_main: Callable[[str], tuple[int, str] | None],
    what: str = "load from",
) -> tuple[int, str] | None:
    """Restore one committed step into ``tmp/<name>`` on every rank; (step, that directory), or None
    if the root holds none. Collective over the default process group; ``is_main``: this is its rank 0.

    The main process decides: ``restore_on_main(dest)`` restores into ``dest`` and returns the step
    and the directory name the framework expects (falling back past a corrupt newest step). Every
    rank learns the decision, or raises the main process's error as the same class; the main
    process renames its copy, the others restore the same step, verified.
    """
    main_copy = os.path.join(tmp, "main")
    found = one_rank_acts(f"{what} {root}", lambda: restore_on_main(main_copy), where=root)
    if found is None:
        return None
    step, name = found
    target = os.path.join(tmp, name)
    if is_main:
        os.rename(main_copy, target)
    else:
        with Checkpointer(root, process_group="local", read_only=True) as ck:
            ck.load({}, step=step, files={FILES_KEY: target})
    return step, target
