"""Reading a committed ckptguard checkpoint the way DCP reads: :class:`DCPReader` and :func:`read_checkpoint`.

Every byte is verified against its checksum before it is placed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ckptguard.dcp.codec import metadata_from_json
from ckptguard.dcp.drive import read_locally
from ckptguard.dcp.planners import SafeLoadPlanner
from ckptguard.dcp.reader import GuardedReader
from ckptguard.dcp.values import decode_value, unflatten
from ckptguard.errors import (
    CorruptCheckpointError,
    StepNotFoundError,
    StepRetiredError,
)
from ckptguard.protocol import layout
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import Manifest
from ckptguard.protocol.read import allocate_whole
from ckptguard.protocol.root import Root, open_root
from ckptguard.storage import open_storage


def resolve_checkpoint(
    path: str | os.PathLike[str], step: int | None = None, storage_options: Mapping[str, Any] | None = None
) -> tuple[Root, CheckpointName]:
    """A committed checkpoint from its own directory, or from a root (``step``, else the newest), on any
    backend (a local path, ``file://``, ``s3://``...)."""
    storage = open_storage(path, storage_options)
    where = storage.root
    name = CheckpointName.parse(where.rstrip("/").rsplit("/", 1)[-1])
    if name is not None and storage.size(storage.join(where, layout.MANIFEST)) is not None:
        if step is not None and step != name.step:
            raise ValueError(f"{where} is step {name.step}, not step {step}")
        return open_root(open_storage(storage.parent(where), storage_options)), name
    root = open_root(storage)
    current = root.current()
    if not current:
        raise StepNotFoundError(f"{where} holds no committed ckptguard checkpoint", path=where)
    if step is None:
        step = max(current)
    if step not in current:
        raise StepNotFoundError(
            f"step {step} is not a committed checkpoint in {where}; committed steps: {sorted(current)}", path=where
        )
    return root, current[step]


class DCPReader(GuardedReader):
    """DCP ``StorageReader`` for a committed ckptguard checkpoint (its directory, or a root and ``step``).

    Every byte is verified against its checksum; a corrupt one fails the load (DCP wraps the
    ``CorruptCheckpointError`` in its ``CheckpointException``). The names are DCP's
    (``model.fc.weight``); values ckptguard had to encode for an exact round trip (int keys, numpy
    arrays) keep their encoded names here: use ``Checkpointer.read`` for those.

    Example:
        ```python
        import torch.distributed.checkpoint as dcp
        dcp.load(state, storage_reader=ckptguard.DCPReader("/shared/ckpts"))  # the step committed last
        ```

    Args:
        path: A root (a path, ``file://`` or ``s3://bucket/prefix``) or one committed step's directory.
        step: The step to read from a root; default: the one committed last.
        io_threads: Reading threads.
        storage_options: Options of the storage backend (S3: ``endpoint_url``, ...).

    Raises:
        StepNotFoundError: ``step`` is not committed in the root, or the root holds none.
        StepRetiredError: The step was retired (retention, ``delete``) between the reader's creation and
            its read; the state is untouched.
        CorruptCheckpointError: The manifest or a file does not match its checksum or size.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        step: int | None = None,
        *,
        io_threads: int = 4,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        root, name = resolve_checkpoint(path, step, storage_options)
        self._root, self._name = root, name
        self.manifest: Manifest = root.read_manifest(name)
        root.check_files(name, self.manifest)
        metadata = metadata_from_json(
            self.manifest.dcp, self.manifest.items, root.dir(name), domain_count=self.manifest.domain_count
        )
        metadata.storage_meta = StorageMeta()
        super().__init__(
            root.storage,
            root.data_dir(name, self.manifest),
            metadata,
            self.manifest.checksum_algorithm,
            rank=0,
            io_threads=io_threads,
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.path.isfile(os.path.join(checkpoint_id, layout.MANIFEST))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """DCP's contract: the values are in place when the future completes. Everything is verified
        first, then placed (one process: nothing to agree on in between)."""
        try:
            super().read_data(plan, planner).wait()
            self.apply(planner)
        except CorruptCheckpointError as e:
            # Its files are read by path after the manifest: a step retired (retention, delete) since is
            # gone, not corrupt. Nothing was placed: the caller's state is as it was.
            if self._root.still_committed(self._name, self.manifest.commit_seq):
                raise
            raise StepRetiredError(
                f"step {self._name.step} of {self._root.path} was retired (retention or a "
                "delete) while it was being read; nothing of it was loaded",
                path=self._root.dir(self._name),
            ) from e
        finally:
            self.close()
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut


def read_checkpoint(
    path: str | os.PathLike[str],
    step: int | None = None,
    *,
    decode: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole stored state dict of a committed checkpoint, in this process (every rank's
    ``PerRank`` values under their ``key@rankNNNNN`` names). ``decode=False``: as DCP stores it."""
    reader = DCPReader(path, step, storage_options=storage_options)
    assert reader.metadata is not None
    flat = allocate_whole(reader.manifest, dict(reader.metadata.state_dict_metadata), reader.checkpoint_dir)
    return read_all(reader, reader.metadata, decode, flat)


def read_all(reader: Any, metadata: Metadata, decode: bool, flat: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every entry of ``metadata`` read into ``flat`` (fresh tensors; by default one per tensor entry, for
    metadata whose sizes were bounded by the bytes stored: importing._check_dcp_metadata), nested."""
    if flat is None:
        flat = {
            fqn: torch.empty(e.size, dtype=e.properties.dtype) if isinstance(e, TensorStorageMetadata) else None
            for fqn, e in metadata.state_dict_metadata.items()
        }
    planner = SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    reader.metadata = metadata
    read_locally(flat, reader, planner, is_coordinator=True)  # DCPReader.read_data verifies, then places
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    nested = unflatten(planner.state_dict, paths)
    return {k: decode_value(v) for k, v in nested.items()} if decode else nested
