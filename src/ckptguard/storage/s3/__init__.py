"""S3 and S3-compatible object stores, through boto3.

What the protocol needs maps onto S3 as follows:

- **exclusive create**: ``PutObject`` / ``CompleteMultipartUpload`` with
  ``If-None-Match: *`` (one of several writers gets 200, the others 412);
- **compare-and-swap**: ``PutObject`` with ``If-Match: <ETag read earlier>``;
- **streamed writes**: parts of ``part_size`` bytes uploaded in parallel, each
  with its CRC32C in ``x-amz-checksum-crc32c`` so the store checks it on
  arrival, then completed with ``If-None-Match: *``;
- **ranged reads**: ``GetObject`` with ``Range``, chunks in parallel, read
  straight into the caller's buffers;
- there are no directories: a "directory" is a key prefix, ``sync_dir`` and
  ``makedirs`` do nothing, and there is no rename (``publish`` is refused: the
  commit on object stores is a conditional create, see
  :mod:`ckptguard.protocol.objstore`).

Retries: botocore's "standard" mode retries throttling, 5xx and dropped
connections with jittered exponential back-off. A conditional write retried
after a 5xx can get 412 because its own first try landed: on 412 we read the
object back and count it as ours when it carries what we wrote (the bytes of a
small object, a per-stream token in the metadata of a data object).

A store reached through a custom endpoint is probed once per process and
bucket: a store that ignores ``If-None-Match`` or ``If-Match`` (on PUT or on
multipart completion) is refused with :class:`UnsupportedStorageError`, never
used unsafely.
"""

from ckptguard.storage.s3.backend import S3Storage
from ckptguard.storage.s3.client import S3Options, _Clients, parse_url
from ckptguard.storage.s3.streams import S3ReadHandle, S3WriteStream

__all__ = ["S3Options", "S3ReadHandle", "S3Storage", "S3WriteStream", "_Clients", "parse_url"]
