"""An S3 endpoint on loopback for tests: moto's server, behind a proxy that injects faults.

* :class:`MotoServer` runs ``python -m moto.server`` (moto 5.2.5) on 127.0.0.1 at a
  port chosen at run time, in its own process. moto honours ``If-None-Match: *``
  and ``If-Match`` on PutObject and ``If-None-Match: *`` on
  CompleteMultipartUpload (checked by ``tests/storage/test_s3.py``), but does not verify
  ``x-amz-checksum-crc32c`` on arrival: the proxy adds that check.
* :class:`FaultProxy` is a small threaded HTTP proxy in front of it (the client
  talks to the proxy only, so faults are real HTTP answers, not client hooks):

  - checks every ``x-amz-checksum-crc32c`` against the body (400 BadDigest, as S3);
  - ``fail_rate``: that fraction of requests is answered 500 or 503 SlowDown
    without reaching moto, answered 500 *after* moto applied them (so a retried
    conditional write meets its own first try), or delayed;
  - ``hide_listing_s``: listings hide every key written through the proxy in the
    last so many seconds (an arbitrarily stale listing);
  - ``strip_conditions``: drops If-None-Match / If-Match (a store that ignores them);
  - ``canned``: bucket name -> a fixed error answer (access denied, wrong region);
  - ``rules`` (:meth:`FaultProxy.add_rule`): chosen requests, picked by a predicate on the
    :class:`Request`, are DELAYED, DROPPED (forwarded and applied by moto, then the
    connection is closed without an answer: a lost reply), FAILED (answered 500 without
    being forwarded), SLOWDOWN (answered 503 SlowDown, S3's throttling error, without being
    forwarded), FAILED-AFTER (forwarded and applied by moto, then answered 500), FROZEN (held, unanswered
    and not forwarded, until :meth:`FaultProxy.thaw`; then forwarded: a stalled writer's
    request that lands late) or RESET (the connection closed at once, nothing forwarded:
    with :meth:`FaultProxy.stop`, an endpoint that refuses connections);
  - ``track``: a predicate on (method, path); ``peak_in_flight`` is the most requests it picked
    that were being handled at once (a client's concurrency, as the endpoint sees it);
  - ``log``: (method, path, query, status) of every request, for assertions;
    :func:`request_kind` names the S3 operation of an entry (what :func:`count_requests` tallies).

Several proxies may front one moto server (:meth:`S3Bed.add_proxy`): one per job, so
that faults hit one job's requests and not another's.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import crc32c

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


class BedUnavailable(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1, in its own process."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        try:
            import moto  # noqa: F401
        except ImportError as e:
            raise BedUnavailable(f"moto is not installed: {e}") from e
        for _ in range(3):
            self.port = _free_port()
            env = {**os.environ, **CREDENTIALS}
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.proc.poll() is None:
                with contextlib.suppress(OSError):
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                    conn.request("GET", "/moto-api/")
                    conn.getresponse().read()
                    conn.close()
                    return
                time.sleep(0.1)
            self.stop()
        raise BedUnavailable("moto server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@dataclass(frozen=True)
class Request:
    """One request as the proxy received it (what a rule's predicate looks at)."""

    method: str
    path: str  # /bucket/key, unquoted
    query: str
    body: bytes

    def key_endswith(self, suffix: str) -> bool:
        return self.path.endswith(suffix)


@dataclass
class Rule:
    match: Callable[[Request], bool]
    action: str  # "delay" | "drop" | "fail" | "slowdown" | "fail-after" | "freeze" | "reset"
    delay_s: float = 0.0
    times: int | None = None  # how many matching requests it applies to (None: all)
    hits: int = 0


@dataclass
class ProxyStats:
    requests: int = 0
    injected: int = 0
    bad_digest: int = 0
    checksummed_puts: int = 0
    unchecksummed_puts: int = 0
    log: list[tuple[str, str, str, int]] = field(default_factory=list)


class _Server(ThreadingHTTPServer):
    """The proxy's listener: a backlog as deep as moto's own (the default 5 overflows when a loaded
    machine delays the accept thread while 16 parts per process connect at once)."""

    request_queue_size = 128
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that gave up on a request (a read timeout on a frozen one) or a connection the
        proxy reset on purpose is part of the test: no traceback for those."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]


class FaultProxy:
    """A threaded HTTP proxy in front of an S3 endpoint (see the module docstring)."""

    def __init__(self, upstream_port: int, seed: int = 0) -> None:
        self.upstream_port = upstream_port
        self.fail_rate = 0.0
        self.kinds = ["500", "503", "500-after", "slow"]  # what an injected fault is, drawn uniformly
        self.slow_s = 0.3
        self.hide_listing_s = 0.0
        self.strip_conditions = False
        self.canned: dict[str, tuple[int, str, dict[str, str]]] = {}
        self.stats = ProxyStats()
        self.written: dict[str, float] = {}  # key (bucket/key) -> when last written through the proxy
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.rules: list[Rule] = []
        self.frozen = 0  # requests held by a freeze rule right now
        self.landing = 0  # requests thawed and not yet answered (being forwarded, late)
        # Requests whose path ``track`` picks: how many are being handled now, and the most at once.
        self.track: Callable[[str, str], bool] = lambda method, path: False
        self.in_flight = 0
        self.peak_in_flight = 0
        self._thawed = threading.Event()
        self._thawed.set()
        self.server: ThreadingHTTPServer | None = None
        self.port = 0

    def add_rule(
        self, match: Callable[[Request], bool], action: str, delay_s: float = 0.0, times: int | None = None
    ) -> Rule:
        """DELAY (``delay_s``), DROP (apply, then lose the reply), FAIL (answer 500, forward nothing),
        SLOWDOWN (answer 503 SlowDown, forward nothing: S3 throttling the request), FAIL-AFTER (apply,
        then answer 500), FREEZE (hold until thaw()) or RESET (close the connection, forward nothing) the
        requests ``match`` picks, the first ``times`` of them (all if None)."""
        assert action in ("delay", "drop", "fail", "slowdown", "fail-after", "freeze", "reset"), action
        rule = Rule(match, action, delay_s, times)
        with self.lock:
            if action == "freeze":
                self._thawed.clear()
            self.rules.append(rule)
        return rule

    def thaw(self) -> None:
        """Forward every frozen request (they land now, late) and freeze no more."""
        with self.lock:
            self.rules = [r for r in self.rules if r.action != "freeze"]
            self._thawed.set()

    def clear_rules(self) -> None:
        self.thaw()
        with self.lock:
            self.rules.clear()

    def _rule_for(self, request: Request) -> Rule | None:
        with self.lock:
            for rule in self.rules:
                if (rule.times is None or rule.hits < rule.times) and rule.match(request):
                    rule.hits += 1
                    return rule
        return None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                proxy.handle(self)

            do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="s3-fault-proxy", daemon=True).start()

    def stop(self) -> None:
        self.thaw()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # -- one request ----------------------------------------------------------------------
    def handle(self, h: BaseHTTPRequestHandler) -> None:
        thawed: list[bool] = []
        tracked = self.track(h.command, urllib.parse.unquote(urllib.parse.urlsplit(h.path).path))
        if tracked:
            with self.lock:
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            self._handle(h, thawed)
        finally:
            with self.lock:
                if thawed:
                    self.landing -= 1
                if tracked:
                    self.in_flight -= 1

    def settled(self, timeout: float = 30.0) -> bool:
        """Wait until no request is frozen and every thawed one has been answered (it landed upstream):
        what the store holds no longer changes behind the clients' backs. False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.frozen == 0 and self.landing == 0:
                    return True
            time.sleep(0.02)
        return False

    def _handle(self, h: BaseHTTPRequestHandler, thawed: list[bool]) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        parsed = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(parsed.path)
        bucket = path.lstrip("/").split("/", 1)[0]
        with self.lock:
            self.stats.requests += 1
            roll = self.rng.random()
            kind = self.rng.choice(self.kinds)
        if bucket in self.canned:
            status, xml, headers = self.canned[bucket]
            self._reply(h, status, xml.encode(), headers, path, parsed.query)
            return
        if h.command == "PUT" and body:
            header = h.headers.get("x-amz-checksum-crc32c")
            if header is None:
                self.stats.unchecksummed_puts += 1
            else:
                self.stats.checksummed_puts += 1
                if base64.b64decode(header) != crc32c.crc32c(body).to_bytes(4, "big"):
                    self.stats.bad_digest += 1
                    self._reply(
                        h,
                        400,
                        _error("BadDigest", "The CRC32C you specified did not match the calculated checksum."),
                        {},
                        path,
                        parsed.query,
                    )
                    return
        rule = self._rule_for(Request(h.command, path, parsed.query, body))
        if rule is not None and rule.action == "reset":
            h.close_connection = True
            with contextlib.suppress(OSError):
                h.connection.shutdown(socket.SHUT_RDWR)
            return
        if rule is not None and rule.action == "delay":
            time.sleep(rule.delay_s)
        if rule is not None and rule.action == "freeze":
            with self.lock:
                self.frozen += 1
            try:
                self._thawed.wait(600)
            finally:
                with self.lock:
                    self.frozen -= 1
                    self.landing += 1
                    thawed.append(True)
        inject = self.fail_rate > 0 and roll < self.fail_rate and not path.startswith("/moto-api")
        if rule is not None and rule.action in ("fail", "slowdown", "fail-after"):
            inject, kind = True, {"fail": "500", "slowdown": "503", "fail-after": "500-after"}[rule.action]
        if inject and kind in ("500", "503"):
            self.stats.injected += 1
            code, message = (
                ("InternalError", "injected by the test proxy")
                if kind == "500"
                else ("SlowDown", "Please reduce your request rate.")
            )
            self._reply(h, int(kind), _error(code, message), {"Content-Type": "application/xml"}, path, parsed.query)
            return
        if inject and kind == "slow":
            self.stats.injected += 1
            time.sleep(self.slow_s)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "connection")}
        if self.strip_conditions:
            headers = {k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")}
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=120)
        try:
            conn.request(h.command, h.path, body=body if body else None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            out_headers = {
                k: v
                for k, v in resp.getheaders()
                if k.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date")
            }
            status = resp.status
            upstream_length = resp.getheader("Content-Length", "0")
        finally:
            conn.close()
        if status < 300 and h.command in ("PUT", "POST") and "/" in path.lstrip("/"):
            with self.lock:
                self.written[path.lstrip("/")] = time.time()
        if status == 200 and h.command == "GET" and "list-type=2" in parsed.query and self.hide_listing_s:
            data = self._stale_listing(data)
        if rule is not None and rule.action == "drop":  # applied upstream, and the answer is lost
            with self.lock:
                self.stats.log.append((h.command, path, parsed.query, 0))
            h.close_connection = True
            with contextlib.suppress(OSError):
                h.connection.shutdown(socket.SHUT_RDWR)
            return
        if inject and kind == "500-after":  # applied upstream, but the client sees a failure
            self.stats.injected += 1
            self._reply(
                h,
                500,
                _error("InternalError", "injected by the test proxy after applying the request"),
                {},
                path,
                parsed.query,
            )
            return
        if h.command == "HEAD":
            out_headers["Content-Length"] = upstream_length
        self._reply(h, status, data, out_headers, path, parsed.query, head=h.command == "HEAD")

    def _stale_listing(self, data: bytes) -> bytes:
        root = ET.fromstring(data)
        bucket = root.findtext(f"{_NS}Name") or ""
        now = time.time()
        with self.lock:
            recent = [
                k for k, t in self.written.items() if now - t < self.hide_listing_s and k.startswith(bucket + "/")
            ]
        recent_keys = {k[len(bucket) + 1 :] for k in recent}
        for c in list(root.findall(f"{_NS}Contents")):
            if c.findtext(f"{_NS}Key") in recent_keys:
                root.remove(c)
        for p in list(root.findall(f"{_NS}CommonPrefixes")):
            prefix = p.findtext(f"{_NS}Prefix") or ""
            if any(k.startswith(prefix) for k in recent_keys):
                root.remove(p)
        count = root.find(f"{_NS}KeyCount")
        if count is not None:
            count.text = str(len(root.findall(f"{_NS}Contents")) + len(root.findall(f"{_NS}CommonPrefixes")))
        return ET.tostring(root, xml_declaration=True, encoding="UTF-8")

    def _reply(
        self,
        h: BaseHTTPRequestHandler,
        status: int,
        data: bytes,
        headers: dict[str, str],
        path: str,
        query: str,
        head: bool = False,
    ) -> None:
        with self.lock:
            self.stats.log.append((h.command, path, query, status))
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if not head:
            h.send_header("Content-Length", str(len(data)))
        elif "Content-Length" not in headers:
            h.send_header("Content-Length", "0")
        h.end_headers()
        if not head and data:
            h.wfile.write(data)


def request_kind(method: str, path: str, query: str) -> str:
    """The S3 operation of a request as the proxy logged it (path-style: /bucket/key)."""
    params = urllib.parse.parse_qs(query, keep_blank_values=True)
    has_key = "/" in path.lstrip("/")
    if method == "PUT":
        return "UploadPart" if "partNumber" in params else "PutObject" if has_key else "CreateBucket"
    if method == "POST":
        if "uploads" in params:
            return "CreateMultipartUpload"
        if "uploadId" in params:
            return "CompleteMultipartUpload"
        return "DeleteObjects" if "delete" in params else "POST"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in params else "DeleteObject"
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    if method == "GET" and not has_key:
        return "ListMultipartUploads" if "uploads" in params else "ListObjectsV2"
    return "GetObject" if method == "GET" else method


def count_requests(
    log: list[tuple[str, str, str, int]], where: Callable[[str], bool] = lambda _: True
) -> dict[str, int]:
    """How many requests of each S3 operation ``log`` holds, of those whose path ``where`` picks."""
    out: dict[str, int] = {}
    for method, path, query, _ in log:
        if where(path):
            kind = request_kind(method, path, query)
            out[kind] = out.get(kind, 0) + 1
    return out


def _error(code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
        f"<RequestId>test</RequestId></Error>"
    ).encode()


def canned_denied() -> tuple[int, str, dict[str, str]]:
    return 403, _error("AccessDenied", "Access Denied").decode(), {"Content-Type": "application/xml"}


def canned_wrong_region(region: str = "eu-west-3") -> tuple[int, str, dict[str, str]]:
    body = _error(
        "PermanentRedirect", "The bucket you are attempting to access must be addressed using the specified endpoint."
    ).decode()
    return 301, body, {"Content-Type": "application/xml", "x-amz-bucket-region": region}


@dataclass
class S3Bed:
    moto: MotoServer
    proxy: FaultProxy
    extra: list[FaultProxy] = field(default_factory=list)

    def add_proxy(self) -> FaultProxy:
        """Another proxy in front of the same moto server (for one job's requests only); stopped with the bed."""
        proxy = FaultProxy(self.moto.port)
        proxy.start()
        self.extra.append(proxy)
        return proxy

    @property
    def endpoint(self) -> str:
        """What clients use: the proxy."""
        return self.proxy.url

    def env(self) -> dict[str, str]:
        """Environment for a process (a torchrun worker, the CLI) to reach the bed and nothing else."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def client(self, direct: bool = True):  # type: ignore[no-untyped-def]
        """A boto3 client straight to moto (``direct``) or through the proxy."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.moto.url if direct else self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
            config=Config(retries={"mode": "standard", "max_attempts": 3}),
        )

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        c = self.client()
        out: list[str] = []
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out.extend(o["Key"] for o in page.get("Contents", []))
        return out

    def open_uploads(self, bucket: str) -> list[str]:
        return [u["Key"] for u in self.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])]

    def reset_faults(self) -> None:
        self.proxy.fail_rate = 0.0
        self.proxy.kinds = ["500", "503", "500-after", "slow"]
        self.proxy.hide_listing_s = 0.0
        self.proxy.strip_conditions = False
        self.proxy.track = lambda method, path: False
        self.proxy.peak_in_flight = 0
        self.proxy.canned.clear()
        self.proxy.clear_rules()
        for proxy in self.extra:
            proxy.stop()
        self.extra.clear()


@contextlib.contextmanager
def s3_bed(seed: int = 0) -> Iterator[S3Bed]:
    """moto on a free loopback port and the fault proxy in front of it, torn down afterwards."""
    moto = MotoServer()
    moto.start()
    proxy = FaultProxy(moto.port, seed)
    bed = S3Bed(moto, proxy)
    try:
        proxy.start()
        yield bed
    finally:
        for extra in bed.extra:
            extra.stop()
        proxy.stop()
        moto.stop()


@contextlib.contextmanager
def s3_bed_in_env(seed: int = 0) -> Iterator[S3Bed]:
    """A bed whose endpoint and test credentials are this process's AWS settings while it lives."""
    with s3_bed(seed) as bed:
        new = bed.env()
        saved = {k: os.environ.get(k) for k in new}
        os.environ.update(new)
        try:
            yield bed
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def key_matches(pattern: str, key: str) -> bool:
    return re.search(pattern, key) is not None
