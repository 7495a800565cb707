"""How many S3 requests a save and a load make, from the code (files per rank, parts, control
requests): the model `bench/sim_s3_scale.py` scales to 16,384 ranks and `tests/storage/test_s3_scale.py`
checks op by op against what reaches the endpoint through the test proxy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIB = 1 << 20
GB = 10**9
MIN_BYTES_PER_FILE = 32 * MIB  # dcp/writer.py: a rank's state is cut into more files only above this
HEAD_THREADS = 16  # protocol/objstore.py: a rank's parallel HEADs of its share of the data objects
THROTTLE_ROUNDS = 8  # storage/s3/client.py: rounds of botocore's retries a throttled data request gets

# Control requests of one save and one load on an s3:// root whose index and lease exist (not the
# first save), counted through the test proxy (tests/storage/test_s3_scale.py checks them): the lease read
# before each act of the leader, the index read and compare-and-swapped (intent, commit), the
# manifest's conditional create, `latest` read and moved, the garbage listings of a save.
SAVE_CONTROL = {"GetObject": 11, "PutObject": 4, "ListObjectsV2": 3, "ListMultipartUploads": 1}
LOAD_CONTROL = {"GetObject": 2}
# Lease renewals (not counted here): a GET and a conditional PUT of lease.json every lease_ttl_s / 4.
# Once per job, when a writing Checkpointer opens the root, every rank: HeadBucket, a PUT of its probe
# object, a GET of rank 0's, a DELETE of its own (protocol/topology.py's probe_object_store).
OPEN_PER_RANK = {"HeadBucket": 1, "PutObject": 1, "GetObject": 1, "DeleteObject": 1}


@dataclass(frozen=True)
class Requests:
    """The requests of one save or load, by S3 operation: to data objects by every rank (``per_rank``, the
    same on each), the HEADs of every data object that a load's ranks share before reading
    (``shared_heads``; a save checks nothing: on S3 a completed upload is visible to every reader); to
    control objects (index, lease, manifest, `latest`, listings) by the leader (``control``)."""

    ranks: int
    per_rank: dict[str, int]
    shared_heads: int
    control: dict[str, int]

    def data(self) -> dict[str, int]:
        out = {k: v * self.ranks for k, v in self.per_rank.items()}
        out["HeadObject"] = out.get("HeadObject", 0) + self.shared_heads
        return {k: v for k, v in out.items() if v}

    def count(self) -> int:
        return sum(self.data().values()) + sum(self.control.values())


def files_per_rank(state_bytes: int, items: int, io_threads: int = 4) -> int:
    """dcp/writer.py's ``_balance``: at most io_threads files, none under 32 MiB unless there is only one."""
    return max(1, min(io_threads, items, -(-state_bytes // MIN_BYTES_PER_FILE)))


def file_sizes(items: Sequence[int], io_threads: int = 4) -> list[int]:
    """The sizes of a rank's files: dcp/writer.py's ``_balance`` (largest item first into the lightest file)."""
    sizes = [0] * files_per_rank(sum(items), len(items), io_threads)
    for n in sorted(items, reverse=True):
        sizes[sizes.index(min(sizes))] += n
    return [s for s in sizes if s]


def parts(file_bytes: int, part_size: int) -> int:
    """UploadParts of an object: below one part it is a single PutObject (0 parts)."""
    return 0 if file_bytes < part_size else -(-file_bytes // part_size)


def save_requests(ranks: int, items: Sequence[int], part_size: int = 16 * MIB, io_threads: int = 4) -> Requests:
    """A save where every rank holds tensors of ``items`` bytes (its own shard: nothing replicated)."""
    sizes = file_sizes(items, io_threads)
    n_parts = [parts(s, part_size) for s in sizes]
    multipart = sum(1 for p in n_parts if p)
    per_rank = {
        "PutObject": len(sizes) - multipart,
        "CreateMultipartUpload": multipart,
        "UploadPart": sum(n_parts),
        "CompleteMultipartUpload": multipart,
    }
    return Requests(ranks, per_rank, 0, dict(SAVE_CONTROL))


def load_requests(ranks: int, items: Sequence[int], part_size: int = 16 * MIB, io_threads: int = 4) -> Requests:
    """A load of what :func:`save_requests` saved, by the same number of ranks: each opens its files (a
    HEAD each) and reads them by ranged GETs of at most ``part_size``. The reader reads runs of tensors
    that lie next to each other in a file as one range (up to 64 MiB): ``GetObject`` counts that, and
    :func:`most_gets_per_rank` the other end (a range per tensor)."""
    sizes = file_sizes(items, io_threads)
    per_rank = {"HeadObject": len(sizes), "GetObject": sum(-(-n // part_size) for n in sizes)}
    return Requests(ranks, per_rank, ranks * len(sizes), dict(LOAD_CONTROL))


def most_gets_per_rank(items: Sequence[int], part_size: int = 16 * MIB) -> int:
    """The ranged GETs of a rank's load when no two tensors are read in one range."""
    return sum(max(1, -(-n // part_size)) for n in items)
