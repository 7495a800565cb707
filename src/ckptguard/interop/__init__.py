"""ckptguard checkpoints for the rest of the ecosystem, and other checkpoints into ckptguard.

- :class:`DCPReader`: a DCP ``StorageReader`` over a committed ckptguard checkpoint, so that
  ``dcp.load(state, storage_reader=ckptguard.DCPReader(path))`` works (every byte verified).
- :func:`export_checkpoint`: one committed step to a ``torch.save`` file, a ``.safetensors``
  file or a plain DCP directory (``ckptguard export``).
- :func:`import_checkpoint`: a DCP directory or a ``torch.save`` file into a ckptguard root
  (``ckptguard import``). DCP's ``.metadata`` is a pickle: it is read with an unpickler that
  admits DCP's metadata classes and nothing else, so no code from the file runs; objects are
  loaded with ``torch.load(weights_only=True)``.
"""

from ckptguard.interop.export import EXPORT_FORMATS, export_checkpoint, flatten_tensors
from ckptguard.interop.importing import MAX_METADATA_BYTES, import_checkpoint, read_dcp, read_dcp_metadata
from ckptguard.interop.reader import DCPReader, read_all, read_checkpoint, resolve_checkpoint

__all__ = [
    "EXPORT_FORMATS",
    "MAX_METADATA_BYTES",
    "DCPReader",
    "export_checkpoint",
    "flatten_tensors",
    "import_checkpoint",
    "read_all",
    "read_checkpoint",
    "read_dcp",
    "read_dcp_metadata",
    "resolve_checkpoint",
]
