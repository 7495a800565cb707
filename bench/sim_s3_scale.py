"""S3 at scale, by a deterministic model: the requests a save and a load make, their wall time and the
throttling headroom, at ranks no test bed here reaches (one endpoint on loopback).

The request counts are the code's (``storage/s3/streams.py``, ``dcp/writer.py``'s files per rank,
``protocol/objstore.py``'s size checks), checked against the requests that reach moto through the
test proxy for 2- and 4-rank saves and loads (``tests/storage/test_s3_scale.py`` calls :func:`save_requests`
and :func:`load_requests`). The times are a model with the assumptions printed above the table.

    python bench/sim_s3_scale.py            # the table of docs/performance.md ("S3 at scale")
    python bench/sim_s3_scale.py --json     # the same rows as JSON
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.support

from tests.support.s3_requests import (
    GB,
    HEAD_THREADS,
    MIB,
    THROTTLE_ROUNDS,
    file_sizes,
    load_requests,
    most_gets_per_rank,
    parts,
    save_requests,
)


# -- the model of time -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Assumptions:
    ranks_per_node: int = 8
    node_gbit_s: float = 100.0  # NIC per node, all of it the checkpoint's, shared by its ranks
    connection_mb_s: float = 100.0  # one HTTP connection to S3 (a part or a range in flight)
    write_latency_s: float = 0.050  # a PUT/UploadPart/Create/Complete, besides its bytes on the wire
    read_latency_s: float = 0.020  # a HEAD, or a ranged GET's first byte
    max_concurrency: int = 16  # requests in flight per rank (S3Options.max_concurrency)
    put_per_prefix_s: int = 3_500  # S3: PUT/COPY/POST/DELETE per second per partitioned prefix
    get_per_prefix_s: int = 5_500  # S3: GET/HEAD per second per partitioned prefix
    prefixes: int = 1  # partitions serving one save's keys: 1 until S3 splits them (see the docs)


@dataclass(frozen=True)
class Config:
    name: str
    part_size: int
    io_threads: int


CONFIGS = [
    Config("default: part_size 16 MiB, io_threads=4", 16 * MIB, 4),
    Config("part_size 64 MiB, io_threads=1", 64 * MIB, 1),
]
# bf16 weights + fp32 master weights and Adam moments: 2 + 4 + 4 + 4 bytes per parameter, fully sharded
MODELS = {"7B": 7e9 * 14, "70B": 70e9 * 14}
ITEMS_PER_RANK = 64


@dataclass(frozen=True)
class Row:
    model: str
    ranks: int
    config: str
    per_rank_mib: float
    files_per_rank: int
    save_writes: int  # PUT, Create, UploadPart, Complete: every rank's
    save_requests: int  # with the control requests
    load_requests: int
    wire_s: float  # every byte through the ranks' share of the NICs, requests overlapped
    rank_requests_s: float  # one rank's writes, max_concurrency at a time, at write_latency_s
    prefix_rate_s: float  # every rank's writes at the prefixes' PUT rate
    load_checks_s: float  # a load's HEAD of every data object, shared by the ranks (and the GET rate)
    save_s: float  # max(wire, rank requests, prefix rate): writes paced at the prefix's rate
    save_backoff_s: float  # the same, the writes sent at once and retried with backoff (:func:`throttle`)
    headroom: float  # the prefixes' PUT rate / the rate the save asks for (< 1: throttled)
    load_s: float


def row(model: str, total_bytes: float, ranks: int, config: Config, a: Assumptions) -> Row:
    per_rank = int(total_bytes / ranks)
    items = [per_rank // ITEMS_PER_RANK] * ITEMS_PER_RANK
    part = config.part_size
    save = save_requests(ranks, items, part, config.io_threads)
    load = load_requests(ranks, items, part, config.io_threads)
    pieces = sum(max(1, parts(f, part)) for f in file_sizes(items, config.io_threads))  # parts or whole objects
    streams = min(a.max_concurrency, pieces)
    rank_bytes_s = min(a.node_gbit_s / 8 * GB / a.ranks_per_node, streams * a.connection_mb_s * 1e6)
    wire = per_rank / rank_bytes_s
    writes_per_rank = sum(save.per_rank.values())
    rank_requests = math.ceil(writes_per_rank / a.max_concurrency) * a.write_latency_s
    prefix_rate = writes_per_rank * ranks / (a.put_per_prefix_s * a.prefixes)
    heads = max(
        math.ceil(load.shared_heads / ranks / HEAD_THREADS) * a.read_latency_s,
        load.shared_heads / (a.get_per_prefix_s * a.prefixes),
    )
    unthrottled = max(wire, rank_requests)
    backoff = throttle(writes_per_rank * ranks, a.put_per_prefix_s * a.prefixes, latency_s=a.write_latency_s)
    reads_per_rank = sum(load.per_rank.values())
    load_s = heads + max(
        wire,
        math.ceil(reads_per_rank / a.max_concurrency) * a.read_latency_s,
        reads_per_rank * ranks / (a.get_per_prefix_s * a.prefixes),
    )
    return Row(
        model,
        ranks,
        config.name,
        round(per_rank / MIB, 1),
        len(file_sizes(items, config.io_threads)),
        writes_per_rank * ranks,
        save.count(),
        load.count(),
        round(wire, 2),
        round(rank_requests, 2),
        round(prefix_rate, 2),
        round(heads, 2),
        round(max(unthrottled, prefix_rate), 1),
        round(max(unthrottled, backoff.done_s), 1),
        round(a.put_per_prefix_s * a.prefixes / (writes_per_rank * ranks / unthrottled), 3),
        round(load_s, 1),
    )


@dataclass(frozen=True)
class Throttled:
    writes: int
    done_s: float  # when the last write landed (or gave up)
    requests: int  # with the refused tries
    refused: int  # 503 SlowDown answers
    failed: int  # writes refused max_attempts times: the save fails


def throttle(
    writes: int,
    rate: float,
    max_attempts: int = 10,
    rounds: int = THROTTLE_ROUNDS,
    latency_s: float = 0.05,
    seed: int = 0,
) -> Throttled:
    """``writes`` sent at once to one prefix that accepts ``rate`` per second (a token bucket holding a
    tenth of a second's worth), each refused one retried as botocore's standard mode does: after
    rand(0, 1) * min(2 ** (attempt - 1), 20) s (SlowDown is a throttling error: a 1 s base), at most
    ``max_attempts`` tries; then, as storage/s3/client.py's ``call_throttled`` does, after
    rand(0, 1) * min(2 ** round, 20) s, another round of botocore's tries, ``rounds`` more at most
    (0: botocore's retries alone). Deterministic (seeded)."""
    rng = random.Random(seed)
    events = [(rng.random() * latency_s, 1, 0) for _ in range(writes)]  # (arrival, attempt, round)
    heapq.heapify(events)
    burst = rate / 10
    tokens, last, done, requests, refused, failed = burst, 0.0, 0.0, 0, 0, 0
    while events:
        t, attempt, round_ = heapq.heappop(events)
        tokens = min(burst, tokens + (t - last) * rate)
        last = t
        requests += 1
        if tokens >= 1:
            tokens -= 1
            done = max(done, t + latency_s)
            continue
        refused += 1
        if attempt == max_attempts and round_ == rounds:
            failed += 1
            done = max(done, t + latency_s)
            continue
        if attempt == max_attempts:
            delay = rng.random() * min(2.0**round_, 20.0)
            heapq.heappush(events, (t + latency_s + delay, 1, round_ + 1))
        else:
            delay = rng.random() * min(2.0 ** (attempt - 1), 20.0)
            heapq.heappush(events, (t + latency_s + delay, attempt + 1, round_))
    return Throttled(writes, round(done, 1), requests, refused, failed)


def table(a: Assumptions) -> list[Row]:
    return [row(m, total, ranks, c, a) for m, total in MODELS.items() for ranks in (1_024, 16_384) for c in CONFIGS]


def small(ranks: int) -> dict[str, dict[str, int]]:
    """The model at the tests' size (tests/storage/test_s3_scale.py: 6 MiB + 4,000 bytes per rank, 5 MiB parts),
    op by op: what the proxy counted."""
    part = 5 * MIB
    elems = (part + part // 5) // 4
    items = [4 * elems, 4 * 1000]
    s, ld = save_requests(ranks, items, part), load_requests(ranks, items, part)
    return {
        "save data": s.data(),
        "save control": s.control,
        "load data": ld.data(),
        "load control": ld.control,
        "load GetObject at most": {"GetObject": ranks * most_gets_per_rank(items, part)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--prefixes", type=int, default=1, help="partitions serving one save's keys")
    args = p.parse_args()
    a = Assumptions(prefixes=args.prefixes)
    rows = table(a)
    if args.json:
        throttled = [
            asdict(throttle(n, a.put_per_prefix_s * a.prefixes, latency_s=a.write_latency_s))
            for n in sorted({r.save_writes for r in rows})
        ]  # with call_throttled's rounds
        print(
            json.dumps(
                {
                    "assumptions": asdict(a),
                    "rows": [asdict(r) for r in rows],
                    "throttled": throttled,
                    "tests": {str(n): small(n) for n in (2, 4)},
                },
                indent=1,
            )
        )
        return
    print("assumptions:", ", ".join(f"{k}={v}" for k, v in asdict(a).items()))
    print(
        f"state: {ITEMS_PER_RANK} equal tensors per rank, fully sharded; "
        + ", ".join(f"{m}: {t / GB:,.0f} GB" for m, t in MODELS.items())
    )
    print()
    for n in (2, 4):
        print(f"{n} ranks (tests/storage/test_s3_scale.py):", json.dumps(small(n)))
    print()
    print(
        "| model | ranks | config | MiB/rank | files/rank | save writes | save requests | load requests "
        "| wire (s) | rank requests (s) | prefix rate (s) | load size checks (s) | save, paced (s) "
        "| save, backoff (s) | headroom | load (s) |"
    )
    print("|" + " --- |" * 16)
    for r in rows:
        print(
            f"| {r.model} | {r.ranks:,} | {r.config} | {r.per_rank_mib:,} | {r.files_per_rank} | {r.save_writes:,} "
            f"| {r.save_requests:,} | {r.load_requests:,} | {r.wire_s} | {r.rank_requests_s} | {r.prefix_rate_s} "
            f"| {r.load_checks_s} | {r.save_s} | {r.save_backoff_s} | {r.headroom} | {r.load_s} |"
        )
    print()
    print(
        f"A save's writes sent at once to {a.prefixes} prefix(es) ({a.put_per_prefix_s * a.prefixes:,} PUT/s), "
        f"retried by botocore (max_attempts=10) alone, and with {THROTTLE_ROUNDS} more rounds of it:"
    )
    print("| writes | rounds | last landed (s) | requests | 503 SlowDown | writes that gave up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in sorted({r.save_writes for r in rows}):
        for rounds in (0, THROTTLE_ROUNDS):
            t = throttle(n, a.put_per_prefix_s * a.prefixes, rounds=rounds, latency_s=a.write_latency_s)
            print(f"| {n:,} | {rounds} | {t.done_s} | {t.requests:,} | {t.refused:,} | {t.failed:,} |")


if __name__ == "__main__":
    main()
