"""Normalisation before recognition: turn a pasted log back into the lines its processes printed.

Logs reach the diagnosis as users paste them into issues and forums: line breaks lost (a whole
torchrun failure table on one line, records joined with runs of spaces by a wrapped terminal),
long lines re-wrapped at the terminal's width, HTML entities, markdown fences and ``<details>``
tags, ANSI colour codes, CRLF, ``[...]`` cuts, and now and then a few binary bytes. This stage
undoes that before anything else reads the text, so that the recognisers only ever see lines.

Each repair is a small, independent step (``STEPS``, applied in order); line breaks are
restored only in front of a known record start, so a printed log passes through unchanged
except for its colour codes and control bytes.
"""

from __future__ import annotations

import codecs
import html
import io
import re
from collections import Counter
from collections.abc import Callable
from typing import Any, BinaryIO

# A whole source is normalised in memory up to this size (a paste is far smaller: GitHub keeps
# 65536 characters a comment); beyond it the log was printed to a file, not pasted, and only the
# per-line repairs (`clean_line`) apply.
PASTE_MAX = 2 * 1024 * 1024

_ANSI_RE = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
# Control bytes other than tab, newline, carriage return and escape (kept for `_ANSI_RE`).
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1a\x1c-\x1f\x7f\ufffd]+")
_ENTITY_RE = re.compile(r"&(?:[a-zA-Z]{2,8}|#\d{1,7}|#[xX][0-9a-fA-F]{1,6});")
_FENCE_RE = re.compile(r"^\s*(?:>\s*)?(?:```|~~~)[\w+\-. ]*\s*$")
_TAG_RE = re.compile(r"</?(?:details|summary|pre|code|p|br|b|i|em|strong|tt|kbd|samp)\b[^>]{0,200}>", re.I)
_BLOCK_TAG_RE = re.compile(r"<(?:br|/?p|/?details|/?pre)\b[^>]{0,200}>", re.I)
_SUMMARY_RE = re.compile(r"<summary\b[^>]{0,200}>.{0,300}?</summary>", re.I | re.S)

# Where a record starts: a line break belongs in front of each of these when whitespace (or the
# end of a previous record) stands before it instead.
_RECORD_STARTS = [
    r"\[(?:rank|default|local_rank)\d{1,6}\]:",  # torchrun --tee / log prefixes
    r"\[\d{1,6},\d{1,6}\]<std(?:out|err)>:",  # mpirun --tag-output
    r"(?<![\w.:/-])[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{3,9}(?= )",  # glog: E0325 20:57:27.620000
    r"Traceback \(most recent call last\):",
    r"During handling of the above exception, another exception occurred:",
    r"The above exception was the direct cause of the following exception:",
    r"File \"[^\"\n]{1,400}\", line \d+",
    r"(?:WARNING|ERROR|INFO|CRITICAL):(?:torch|__main__|root|deepspeed)[\w.]*:",
    r"(?<![\]:] )Sending process \d+ (?:the )?closing signal",
    r"(?<![\]:] )failed \(exitcode: -?\d+\)",
    r"\[\s*(?:\.\.\.|…)\s*\]",
    r"torch\.distributed\.elastic\.multiprocessing\.errors\.ChildFailedError:",
]
# Record starts that also occur inside messages ("CANCELLED AT 2022-08-12T02:06:12", a logger's
# "[module.func:80]"): a break is restored in front of one only where the log's own lines start
# with it (or the whole paste is one or two lines).
_FORMAT_STARTS = [
    r"\[[A-Za-z][\w\-]{0,62}:\d{1,6}\]:?(?= )",  # [host:N]
    r"(?:\[\s*)?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?(?:\s*\])?(?= )",
]
_FORMAT_RES = [re.compile(r"^\s*" + f, re.M) for f in _FORMAT_STARTS]
# torchrun's failure table, whose fields a paste runs together (only inside the table's line).
_TABLE_FIELDS = (
    r"(?:Root Cause \(first observed failure\):|Failures:|<NO_OTHER_FAILURES>|\[\d{1,6}\]:(?=\s|$)"
    r"|(?:time|host|rank|exitcode|error_file|traceback)\s*:(?= )|={8,}|-{8,})"
)
_TABLE_HINT = re.compile(
    r"Root Cause|Failures:|error_file:|\[\d{1,6}\]:\s+time\s*:"
    r"|(?:time|host|rank|exitcode|traceback)\s*: .*"
    r"(?:time|host|rank|exitcode|traceback|error_file)\s*: "
)
_TABLE_RE = re.compile(r"(?<=\S)[ \t]+(?=" + _TABLE_FIELDS + ")")
_RECORD_RE = re.compile(r"(?<=\S)[ \t]+(?=(?:" + "|".join(_RECORD_STARTS) + "))")
# A record start right after a prefix stays on the prefix's line: "[rank3]: Traceback ...".
_PREFIX_ONLY_RE = re.compile(
    r"^\s*(?:(?:\[(?:rank|default|local_rank)\d{1,6}\]:|\[\d{1,6},\d{1,6}\]<std(?:out|err)>:"
    r"|\[[A-Za-z][\w\-]{0,62}:\d{1,6}\]:?|\d{1,6}:|[a-z][\w\-]*\d[\w.\-]*:"
    r"|[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{3,9} +\d+ [^\]]{1,80}\]"
    r"|(?:\[\s*)?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?(?:\s*\])?"
    r"|(?:WARNING|ERROR|INFO|CRITICAL):[\w.]*:)\s*)+$"
)
# In a joined traceback: the source line after a frame, and the exception line after it.
_FRAME_TAIL_RE = re.compile(r"(File \"[^\"\n]{1,400}\", line \d+, in [^\s]+)[ \t]+(?=\S)")
_EXC_START_RE = re.compile(
    r"(?<=\S)[ \t]+(?=(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt|Exit|Failure)(?::\s|$))"
)
_CUT = r"\[\s*(?:\.\.\.|…|\.{2,}\s*(?:snip(?:ped)?|cut|truncated)\s*\.{2,}|(?:snip(?:ped)?|cut|truncated))\s*\]"
_CUT_RE = re.compile(_CUT, re.I)
_CUT_BEFORE_RE = re.compile(r"(?<=\S)[ \t]*(?=" + _CUT + ")", re.I)
_CUT_AFTER_RE = re.compile(r"(" + _CUT + r")[ \t]*(?=\S)", re.I)
_SRUN_LABEL_RE = re.compile(r"^ {0,4}(\d{1,6}): ", re.M)
# What follows a task id where a joined record starts: a traceback, a frame, a prefix, a glog
# record, an exception line.
_SRUN_SPLIT_TAIL = r": (?:Traceback|File \"|\[|[IWEF]\d{4} |(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)\b)"
_HOST_LABEL_RE = re.compile(r"^([a-z][\w\-]*\d[\w.\-]*): ", re.M)
_TERMINAL_WIDTHS = frozenset({80, 100, 120, 128, 132, 140, 150, 160, 180, 200, 220, 240})


# The bytes of printable ASCII text (with tab, newline, carriage return): the low bytes of a
# mostly-ASCII UTF-16 log.
_ASCII_TEXT = bytes([9, 10, 13, *range(32, 127)])


def utf16_codec(head: bytes) -> str | None:
    """The codec of a UTF-16 log from its first bytes, or None.

    With a byte-order mark (PowerShell's redirect): ``utf-16``, where the high bytes of
    mostly-ASCII text (NULs) follow it (a latin-1 log can start with the same two bytes).
    Without one (some Windows tools write none): ``utf-16-le`` / ``utf-16-be`` where nearly every
    byte of one parity is NUL and nearly every byte of the other printable ASCII, a pattern that
    neither UTF-8 text nor a binary file (whose other bytes are not text) has."""
    if head[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
        high = head[3:4003:2] if head[:2] == codecs.BOM_UTF16_LE else head[2:4002:2]
        return "utf-16" if high and high.count(0) >= len(high) * 0.3 else None
    sample = head[:4000]
    if len(sample) < 8:
        return None
    even, odd = sample[0::2], sample[1::2]
    for nul, text, codec in ((odd, even, "utf-16-le"), (even, odd, "utf-16-be")):
        if nul.count(0) >= len(nul) * 0.8 and len(text.translate(None, _ASCII_TEXT)) <= len(text) * 0.2:
            return codec
    return None


def looks_utf16(head: bytes) -> bool:
    """Whether the first bytes are those of a UTF-16 log (see `utf16_codec`)."""
    return utf16_codec(head) is not None


def decode(data: bytes) -> str:
    """Bytes as text: UTF-16 (with a byte-order mark or recognised without one), else UTF-8
    where it is, each undecodable byte replaced (then dropped)."""
    codec = utf16_codec(data)
    return data.decode(codec or "utf-8", "replace")


def strip_control(text: str) -> str:
    """Drop ANSI escape sequences and control bytes (binary noise in a text log)."""
    if "\x1b" in text:
        text = _ANSI_RE.sub("", text)
    return _CONTROL_RE.sub("", text)


def unify_newlines(text: str) -> str:
    """CRLF and lone CR (a progress bar's redraws, an old Mac editor) become line breaks."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def unescape_html(text: str) -> str:
    """HTML entities (``&lt;``, ``&#39;``) and the markup a web page keeps around a paste."""
    if "<" in text:
        text = _SUMMARY_RE.sub("\n", text)
        text = _BLOCK_TAG_RE.sub("\n", text)
        text = _TAG_RE.sub("", text)
    if "&" in text and _ENTITY_RE.search(text):
        text = html.unescape(text)
    return text


def drop_fences(text: str) -> str:
    """Markdown code fences (```` ``` ````, ``~~~``) on lines of their own."""
    if "```" not in text and "~~~" not in text:
        return text
    return "\n".join(ln for ln in text.split("\n") if not _FENCE_RE.match(ln))


def unwrap(text: str) -> str:
    """Join lines that a terminal or a paste wrapped at a fixed width.

    The width is recognised, not assumed: two different lines (or three copies of one) exactly
    as long as a common terminal width, none longer (printed lines vary in length; wrapped ones
    pile up at the width). A wrapped line is joined to the next unless the next starts a record
    of its own. A paste with a single wrapped line is left as it is: that line is as likely to
    have been printed at that length."""
    lines = text.split("\n")
    lengths = Counter(len(ln) for ln in set(lines))  # distinct lines: a repeated one is printed
    longest = max(lengths) if lengths else 0
    if longest not in _TERMINAL_WIDTHS:
        return text
    if lengths[longest] < 2 and sum(len(ln) == longest for ln in lines) < 3:
        return text  # one line at the width is as likely printed so: left alone
    out: list[str] = []
    join = False
    for ln in lines:
        if join and ln and not _starts_record(ln):
            out[-1] += ln
        else:
            out.append(ln)
        join = len(ln) == longest and bool(set(ln.strip()) - set("=-*#"))
    return "\n".join(out)


_RECORD_START_RE = re.compile("(?:" + "|".join(_RECORD_STARTS) + ")")


def _starts_record(line: str) -> bool:
    return bool(_RECORD_START_RE.match(line.lstrip()))


def split_records(text: str) -> str:
    """Restore line breaks in front of known record starts that a paste ran together."""
    lines = text.split("\n")
    few = len(lines) <= 2
    extra = [
        f for f, fx in zip(_FORMAT_STARTS, _FORMAT_RES, strict=True) if few or len(fx.findall(text, 0, 1 << 20)) >= 2
    ]
    rx = _RECORD_RE if not extra else re.compile(r"(?<=\S)[ \t]+(?=(?:" + "|".join(_RECORD_STARTS + extra) + "))")
    return "\n".join(_split_line(ln, rx) for ln in lines)


def _split_line(line: str, rx: re.Pattern[str]) -> str:
    if len(line) < 12:
        return line
    parts = _split_keep_prefix(rx, line)
    out: list[str] = []
    for part in parts:
        if _TABLE_HINT.search(part):
            out.extend(_split_keep_prefix(_TABLE_RE, part, leads=False))
        else:
            out.append(part)
    final: list[str] = []
    for part in out:
        if 'File "' in part:
            final.extend(_split_traceback(part))
        else:
            final.append(part)
    return "\n".join(final)


def _split_traceback(part: str) -> list[str]:
    """A frame line with its source line and the exception run onto it."""
    m = _FRAME_TAIL_RE.search(part)
    if m is None:
        return [part]
    head, tail = part[: m.end(1)], part[m.end() :]
    lead = _lead_of(part)
    pieces = _EXC_START_RE.split(tail, maxsplit=1)
    return [head, *(lead + "    " + p if i == 0 else lead + p for i, p in enumerate(pieces) if p)]


def _lead_of(part: str) -> str:
    """The launcher prefix a record's line starts with, to repeat on the lines split from it."""
    m = _LEAD_PREFIX_RE.match(part)
    return m.group(0) if m else ""


_LEAD_PREFIX_RE = re.compile(
    r"^\s*(?:\[(?:rank|default|local_rank)\d{1,6}\]:|\[\d{1,6},\d{1,6}\]<std(?:out|err)>:"
    r"|\[[A-Za-z][\w\-]{0,62}:\d{1,6}\]:?)+ ?"
)


# What may stand before a record's prefix on its own line: timestamps, a CI step or container
# name, a stream tag (`[stderr]`), a quote marker (`> ` of a pasted reply).
_LEAD_RE = re.compile(r"^(?!.*(?:NCCL |-> ))[\w\s.:,/+\-()=|>\[\]]{1,60}$")
_WORD_COLON = re.compile(r"[A-Za-z]{2,}: ")
_LETTER_RE = re.compile(r"[A-Za-z]")
_ENDS_WITH_TAG = re.compile(
    r"(?:\[(?:rank|default|local_rank)\d{1,6}\]:|<std(?:out|err)>:"
    r"|\[[A-Za-z][\w\-]{0,62}:\d{1,6}\]:?)\s*$"
)
_EXC_HEAD_RE = re.compile(r"(?:Error|Exception):\s*$")  # an exception whose message is a traceback


def _split_keep_prefix(rx: re.Pattern[str], line: str, leads: bool = True) -> list[str]:
    """Split ``line`` where ``rx`` matches, except right after nothing but a prefix (or the lead
    in front of one). A piece without a prefix of its own gets none: a record that starts
    without a prefix was printed without one (the launcher's own lines in a torchrun log)."""
    pieces: list[str] = []
    last = 0
    for m in rx.finditer(line):
        head = line[last : m.start()]
        if not head.strip() or _PREFIX_ONLY_RE.match(head) or _ENDS_WITH_TAG.search(head):
            continue
        nxt = line[m.end() : m.end() + 10]
        if nxt.startswith("Traceback") and _EXC_HEAD_RE.search(head):
            continue
        if (
            leads
            and last == 0
            and (nxt[:1] == "[" or not _LETTER_RE.search(head))
            and _LEAD_RE.match(head)
            and not _WORD_COLON.search(head)
            and not _LEAD_PREFIX_RE.match(head)
            and "Traceback" not in head
        ):
            continue  # a timestamp, CI step or stream tag in front of the record's own prefix
        pieces.append(head)
        last = m.end()
    if not pieces:
        return [line]
    pieces.append(line[last:])
    return pieces


def split_cuts(text: str) -> str:
    """A ``[...]`` cut (or ``[..snip..]``, ``[truncated]``) on a line of its own, spelled
    ``[...]``: nothing continues across it."""
    if "[" not in text or not _CUT_RE.search(text):
        return text
    text = _CUT_BEFORE_RE.sub("\n", text)
    text = _CUT_AFTER_RE.sub("\\1\n", text)
    return _CUT_RE.sub("[...]", text)  # one spelling for the recognisers


def split_labels(text: str) -> str:
    """``srun --label`` task ids (``3: ``) and pdsh/DeepSpeed host labels (``worker-1: ``) run
    together: split in front of one only where the log shows that label format elsewhere."""
    starts = _SRUN_LABEL_RE.findall(text, 0, 1 << 20)
    labels = set(starts)
    if len(starts) >= 2 and len(labels) <= 4096:
        # only the task ids the log's own lines start with: "sample 118: OSError" inside a
        # message is not task 118's record
        alt = "|".join(sorted(labels, key=len, reverse=True))
        text = re.sub(r"(?<=\S)[ \t]+(?=(?:" + alt + r")" + _SRUN_SPLIT_TAIL + ")", "\n", text)
    hosts = {h for h in _HOST_LABEL_RE.findall(text, 0, 1 << 20)}
    if hosts and len(hosts) <= 64:
        alt = "|".join(re.escape(h) for h in sorted(hosts, key=len, reverse=True))
        text = re.sub(r"(?<=\S)[ \t]+(?=(?:" + alt + r"): )", "\n", text)
    return text


Step = Callable[[str], str]
# Order matters: bytes and escapes first (they hide record starts), then markup, then line
# structure (wrapped lines are joined before joined records are split).
STEPS: tuple[Step, ...] = (
    strip_control,
    unify_newlines,
    unescape_html,
    drop_fences,
    unwrap,
    split_cuts,
    split_records,
    split_labels,
)


def normalize(text: str) -> str:
    """A pasted log as the lines its processes printed (see the module's docstring)."""
    for step in STEPS:
        text = step(text)
    return text


def normalize_bytes(data: bytes) -> bytes:
    """`normalize` over raw bytes (undecodable bytes are dropped), back to UTF-8."""
    return normalize(decode(data)).encode("utf-8")


class _Chain(io.RawIOBase):
    """What was read ahead, then the rest of the stream."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self._head, self._rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        readinto = getattr(self._rest, "readinto", None)
        if readinto is not None:
            return int(readinto(b) or 0)
        data = self._rest.read(len(b))
        b[: len(data)] = data
        return len(data)


def read_normalized(stream: BinaryIO) -> tuple[BinaryIO, bool]:
    """The stream normalised in memory when it is small enough to have been pasted (and
    whether it was); a larger one is returned as it is, positioned at its start."""
    start = stream.tell() if isinstance(stream, io.BufferedReader) and stream.seekable() else None
    head = stream.read(PASTE_MAX + 1)
    if len(head) <= PASTE_MAX:
        return io.BytesIO(normalize_bytes(head)), True
    if start is not None:  # a plain file: read it again from there, not through a copying wrapper
        stream.seek(start)
        return stream, False
    return io.BufferedReader(_Chain(head, stream), 1 << 20), False


def clean_line(text: str) -> str:
    """The repairs that apply to one line of a log too large to have been pasted."""
    if "\x1b" in text or "&" in text:
        text = strip_control(text)
        if "&" in text and _ENTITY_RE.search(text):
            text = html.unescape(text)
    return text
