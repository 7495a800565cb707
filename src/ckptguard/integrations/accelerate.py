"""Accelerate: ``save_state`` / ``load_state`` committed through ckptguard.

    from ckptguard.integrations.accelerate import CkptguardAccelerator
    accelerator = CkptguardAccelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir="/shared/run1", automatic_checkpoint_naming=True, total_limit=3))
    ...
    accelerator.save_state()          # unchanged calls: committed before checkpoint_<i> appears
    accelerator.load_state()          # the newest committed, verified checkpoint; sets the iteration

or, with a plain ``Accelerator``, the functions ``save_state(accelerator)`` and ``load_state(accelerator)``.

Accelerate's own ``save_state`` deletes the oldest checkpoints *before* writing the new one
(``total_limit``) and writes straight into ``checkpoint_<i>``; its ``load_state()`` takes the
highest-numbered folder unchecked. Here, per save:

1. Accelerate's own code writes the whole checkpoint (models, optimizers, schedulers, samplers,
   every process's RNG file, registered objects; FSDP/DeepSpeed files too) into a staging
   directory ``.ckptguard-accelerate-staging/checkpoint_<i>.<attempt>/checkpoint_<i>``;
2. all processes meet; the main process commits it as step ``i`` of the ckptguard root
   ``.ckptguard-accelerate`` (checksummed, fsynced, one atomic commit);
3. only then ``<dir>/checkpoint_<i>`` appears (one rename), and only then are old checkpoints
   rotated out (``total_limit``): the visible folder first, then the committed step.

``<dir>`` is ``project_dir/checkpoints`` with ``automatic_checkpoint_naming`` (``i`` is
``accelerator.save_iteration``; the root and staging directory are then in ``project_dir``, so that
``checkpoints/`` holds only ``checkpoint_<i>`` folders), else the parent of ``output_dir`` (``i`` is
``step=``, or the number at the end of the folder's name). ``load_state`` loads the newest committed step (or
``step=``), restoring its files, verified, into a private temporary directory per process
(``restore_dir``) from which Accelerate's own ``load_state`` reads; with automatic naming it sets
``project_configuration.iteration`` to the step after it (Accelerate leaves it at 0, so the next
``save_state`` would fail on an existing folder).

Costs: data stored twice (committed copy and visible folder; ``publish=False`` keeps only the
committed copy) and written twice per save. The checkpoint directory must be shared by all
processes (``save_on_each_node=True`` is refused).

Tested with accelerate 1.15.0 (from a clone: ``pip install -e '.[accelerate]'``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import uuid
from typing import Any

from ckptguard.integrations._extra import missing_extra

try:
    from accelerate import Accelerator  # type: ignore[import-untyped]
except ImportError as e:  # the framework is an extra
    raise missing_extra("accelerate", "accelerate", e) from e


from ckptguard.checkpointer import Checkpointer
from ckptguard.discover import ACCELERATE_ROOT, FRAMEWORK_KEY
from ckptguard.integrations import _dirs
from ckptguard.ranks import broadcast, one_rank_acts

log = logging.getLogger(__name__)

ROOT_NAME = ACCELERATE_ROOT
STAGING_NAME = ".ckptguard-accelerate-staging"
_NUMBER_AT_END = re.compile(r"(\d+)$")

# One rank-local writer per (accelerator, root): the lease is taken once per job, not per save.
_WRITERS: dict[tuple[int, str], Checkpointer] = {}


def _where(
    accelerator: Accelerator, output_dir: str | os.PathLike[str] | None, step: int | None
) -> tuple[str, str, int, str]:
    """(checkpoints directory, folder name, step, home) of the save asked for; the ckptguard root and
    the staging directory live in home (project_dir with automatic naming, so that nothing but
    ``checkpoint_<i>`` folders is in ``checkpoints/``, which Accelerate's own load_state parses)."""
    pc = accelerator.project_configuration
    if pc.save_on_each_node:
        raise ValueError(
            "ckptguard's Accelerate integration needs a checkpoint directory shared by all "
            "processes: save_on_each_node=True is not supported"
        )
    if pc.automatic_checkpoint_naming:
        if pc.project_dir is None:
            raise ValueError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)")
        base = os.path.join(os.path.abspath(pc.project_dir), "checkpoints")
        s = int(pc.iteration) if step is None else int(step)
        return base, f"checkpoint_{s}", s, os.path.abspath(pc.project_dir)
    if output_dir is None:
        raise ValueError("pass output_dir (or use ProjectConfiguration(automatic_checkpoint_naming=True))")
    path = os.path.abspath(os.fspath(output_dir))
    name = os.path.basename(os.path.normpath(path))
    if step is None:
        m = _NUMBER_AT_END.search(name)
        if m is None:
            raise ValueError(f"pass step=: the folder name {name!r} does not end in a number")
        step = int(m.group(1))
    base = os.path.dirname(os.path.normpath(path))
    return base, name, int(step), base


def checkpoint_root(home: str) -> str:
    """The ckptguard root under ``home`` (``project_dir`` with automatic naming, else the parent of the
    checkpoint folders)."""
    return os.path.join(home, ROOT_NAME)


def _writer(accelerator: Accelerator, home: str, options: dict[str, Any]) -> Checkpointer:
    key = (id(accelerator), checkpoint_root(home))
    ck = _WRITERS.get(key)
    if ck is None:
        ck = _WRITERS[key] = Checkpointer(checkpoint_root(home), process_group="local", **options)
    return ck


def close(accelerator: Accelerator) -> None:
    """Release the roots this accelerator wrote to (also done at exit)."""
    for key in [k for k in _WRITERS if k[0] == id(accelerator)]:
        _WRITERS.pop(key).close()


def save_state(
    accelerator: Accelerator,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    step: int | None = None,
    publish: bool = True,
    checkpointer_options: dict[str, Any] | None = None,
    **save_state_kwargs: Any,
) -> str:
    """``accelerator.save_state(output_dir)``, committed through ckptguard; for a plain ``Accelerator``.

    Called by every process.

    Args:
        accelerator: The ``Accelerator`` whose state to save.
        output_dir: The checkpoint folder (``.../checkpoint_<i>``); None with automatic naming.
        step: The step to commit as; default: Accelerate's iteration, or the number ending the folder's name.
        publish: Make the visible ``checkpoint_<i>`` folder (a rename, after the commit).
        checkpointer_options: More keyword arguments for the ``Checkpointer`` that writes.
        **save_state_kwargs: Passed to Accelerate's own ``save_state``.

    Returns:
        The visible folder (which exists only with ``publish=True``).

    Raises:
        CheckpointError: The commit failed on any process (raised on every process).
    """
    base, name, s, home = _where(accelerator, output_dir, step)
    staging_root = os.path.join(home, STAGING_NAME)
    attempt = broadcast(uuid.uuid4().hex[:12])
    staging = os.path.join(staging_root, f"{name}.{attempt}", name)
    pc = accelerator.project_configuration
    automatic = pc.automatic_checkpoint_naming
    pc.automatic_checkpoint_naming = False  # Accelerate's own rotation and naming stay off: we do them
    try:
        Accelerator.save_state(accelerator, staging, **save_state_kwargs)
    finally:
        pc.automatic_checkpoint_naming = automatic
    accelerator.wait_for_everyone()  # every process's files are in staging

    def commit() -> None:
        ck = _writer(accelerator, home, dict(checkpointer_options or {}))
        ck.save(
            s,
            {"accelerate": {"folder": name}},
            files={_dirs.FILES_KEY: staging},
            overwrite=s in ck.steps(),
            metadata={FRAMEWORK_KEY: "accelerate", "folder": name},
        )  # the step is Accelerate's iteration
        if publish:
            _dirs.publish(ck, base, staging, name, staging_root)
        if automatic:  # Accelerate's total_limit, after the commit
            _dirs.rotate(ck, pc.total_limit, set(), base, {x: f"checkpoint_{x}" for x in ck.steps()}, staging_root)
        _dirs.clear_staging(ck, staging_root)

    one_rank_acts(f"save {name} to {checkpoint_root(home)}", commit, where=checkpoint_root(home))
    return os.path.join(base, name)


def load_state(
    accelerator: Accelerator,
    input_dir: str | os.PathLike[str] | None = None,
    *,
    step: int | None = None,
    restore_dir: str | None = None,
    **load_state_kwargs: Any,
) -> int | None:
    """``accelerator.load_state(...)`` from a committed, verified checkpoint; for a plain ``Accelerator``.

    Called by every process. Runs unchanged the first time and after a crash: on a fresh start
    (nothing committed yet) it returns None and one log line says so.

    Args:
        accelerator: The ``Accelerator`` to load into.
        input_dir: None with automatic naming: the newest committed step in ``project_dir/checkpoints``
            (or ``step=``). ``".../checkpoint_7"``: committed step 7 of its directory. The checkpoints
            directory itself: its newest committed step.
        step: The step to load.
        restore_dir: Where each process restores the checkpoint's files before Accelerate reads them
            (default: a private temporary directory).
        **load_state_kwargs: Passed to Accelerate's own ``load_state``.

    Returns:
        The step loaded, or None on a fresh start. With automatic naming it also sets
        ``project_configuration.iteration`` to the step after it.

    Raises:
        StepNotFoundError: A step asked for by ``step=`` or a folder name is not committed.
        ValueError: ``input_dir`` is None without automatic checkpoint naming.
        CheckpointError: The checkpoint failed verification on any process.
    """
    pc = accelerator.project_configuration
    wanted = step
    if input_dir is None:
        if not pc.automatic_checkpoint_naming or pc.project_dir is None:
            raise ValueError("pass input_dir (or use ProjectConfiguration(automatic_checkpoint_naming=True))")
        home = os.path.abspath(pc.project_dir)
    else:
        path = os.path.abspath(os.fspath(input_dir))
        if os.path.isdir(checkpoint_root(path)):  # a directory holding the root: its newest step
            home = path
        else:
            base, _, named = _where_named(path)
            auto_base = os.path.join(os.path.abspath(pc.project_dir), "checkpoints") if pc.project_dir else None
            home = os.path.dirname(base) if pc.automatic_checkpoint_naming and base == auto_base else base
            wanted = named if step is None else step
    root = checkpoint_root(home)
    tmp = tempfile.mkdtemp(prefix="ckptguard-accelerate-", dir=restore_dir)
    try:

        def restore_on_main(dest: str) -> tuple[int, str] | None:
            got = _dirs.restore_step(root, wanted, dest)
            return (got, "checkpoint") if got is not None else None

        restored = _dirs.restore_on_every_rank(root, tmp, accelerator.is_main_process, restore_on_main)
        if restored is None:
            if wanted is not None:
                raise ValueError(f"no committed checkpoint in {root}")
            log.warning("ckptguard: no committed checkpoint in %s: nothing loaded (a fresh start)", root)
            return None
        got, target = restored
        Accelerator.load_state(accelerator, target, **load_state_kwargs)
        accelerator.wait_for_everyone()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if pc.automatic_checkpoint_naming:
        pc.iteration = got + 1
    log.info("ckptguard: loaded committed step %d of %s", got, root)
    return got


def _where_named(path: str) -> tuple[str, str, int]:
    name = os.path.basename(os.path.normpath(path))
    m = _NUMBER_AT_END.search(name)
    if m is None:
        raise ValueError(f"{path} is neither a checkpoints directory nor a folder whose name ends in its step")
    return os.path.dirname(os.path.normpath(path)), name, int(m.group(1))


class CkptguardAccelerator(Accelerator):  # type: ignore[misc]
    """An ``Accelerator`` whose ``save_state`` / ``load_state`` go through ckptguard.

    A drop-in replacement for ``accelerate.Accelerator`` (same arguments): ``save_state()`` commits the
    checkpoint before ``checkpoint_<i>`` appears, then rotates (``total_limit``); ``load_state()`` loads
    the newest committed, verified checkpoint and returns its step (Accelerate's returns None), or None
    on a fresh start. ``end_training()`` also releases the roots it wrote to. See the module's
    description above for the layout on disk.

    Example:
        ```python
        accelerator = CkptguardAccelerator(project_config=ProjectConfiguration(
            project_dir="/shared/run1", automatic_checkpoint_naming=True, total_limit=3))
        step = accelerator.load_state()     # None on a fresh start
        ...
        accelerator.save_state()
        ```
    """

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any
    ) -> str:
        return save_state(self, output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **load_model_func_kwargs: Any
    ) -> int | None:
        return load_state(self, input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)

    def end_training(self) -> None:
        close(self)
        super().end_training()
