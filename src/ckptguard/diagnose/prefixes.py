"""Line prefixes (which process wrote a line: rank tags, launcher labels, hosts) and timestamps."""

from __future__ import annotations

import re
from dataclasses import dataclass

# ---- prefixes -------------------------------------------------------------------------------

_PREFIX_RE = re.compile(
    r"""
      \[(?P<role>[A-Za-z_][A-Za-z_\-]*?)(?P<num>\d{1,6})\]:[ ]?      # [rank3]: / [default3]:
    | \[rank:[ ]?(?P<lit>\d{1,6})\][ ]                              # Lightning: [rank: 3]
    | \[[Rr]ank[ ]?(?P<sp>\d{1,6})\]:?[ ]                            # print hooks: [rank3] / [Rank 3]
    | rank(?P<lc>\d{1,6}):[ ]                                       # `rank3: `
    | \[\d+,(?P<mpi>\d{1,6})\]<(?:stdout|stderr)>:[ ]?             # mpirun --tag-output
    | \[(?P<hnhost>[A-Za-z][\w\-.]{0,62}):(?P<hn>\d{1,6})\]:?[ ]      # [host:N]
    | [ ]{0,5}(?P<srun>\d{1,6}):[ ]                                 # srun --label
    | (?P<pdsh>[a-z][a-z0-9\-]*\d[a-z0-9.\-]*):[ ](?=\S)             # pdsh / deepspeed: host:
    """,
    re.X,
)


@dataclass
class Prefix:
    """What the line's prefixes say about who wrote it."""

    rank: int | None = None
    local_rank: int | None = None
    host: str | None = None
    lead: str = ""


# What may stand before a rank tag: timestamps, CI step names, a host or container tag, a stream
# tag (`[stderr]`), a quote marker (`> ` of a pasted reply).
_LEAD_RE = re.compile(
    r"(?:[\w\s.:,/+\-()=|>]|\[(?:std)?(?:out|err)\]){1,64}?"
    r"(?=\[(?:rank|default|local_rank|[A-Za-z_]+)\d{1,6}\]:)"
)
_RANK_TAG = re.compile(r"\[[A-Za-z_][A-Za-z_\-]*?\d{1,6}\]:")
_WORD_COLON = re.compile(r"[A-Za-z]{2,}: ")


def strip_prefixes(text: str) -> tuple[Prefix, str]:
    """Remove launcher prefixes (nested ones too) and return what they tell.

    Leading blanks and a short lead of timestamps or tags before a ``[rankN]:`` /
    ``[defaultN]:`` tag (``2024-01-02 10:00:01 [rank2]: ...``, CI runners' time stamps) are
    dropped with it; the lead is returned in ``Prefix.lead`` so that its timestamp still counts.
    """
    info = Prefix()
    lead = ""
    body = text.lstrip()
    if body[:1] == "[" and _RANK_TAG.match(body):
        text = body
    elif "]:" in body[:140]:
        m = _LEAD_RE.match(body)
        if m and _RANK_TAG.match(body, m.end()) and not _WORD_COLON.search(m.group(0)):
            lead, text = body[: m.end()], body[m.end() :]
    for _ in range(4):
        m = _PREFIX_RE.match(text)
        if not m:
            break
        if m.group("num") is not None:
            n = int(m.group("num"))
            if m.group("role").lower() == "rank":
                info.rank = n
            elif info.rank is None:
                info.local_rank = n
        elif m.group("mpi") is not None:
            info.rank = int(m.group("mpi"))
        elif m.group("lit") is not None or m.group("sp") is not None or m.group("lc") is not None:
            info.rank = int(m.group("lit") or m.group("sp") or m.group("lc"))
        elif m.group("hn") is not None:
            info.rank, info.host = int(m.group("hn")), m.group("hnhost")
        elif m.group("srun") is not None:
            if info.rank is None:
                info.rank = int(m.group("srun"))
        elif m.group("pdsh") is not None:
            info.host = m.group("pdsh")
        text = text[m.end() :]
    info.lead = lead
    return info, text


# ---- timestamps -----------------------------------------------------------------------------

_ISO_RE = re.compile(r"(\d{4})-(\d\d)-(\d\d)[T _](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?")
_GLOG_RE = re.compile(r"^\[?[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{1,9})")


def _days(y: int, m: int, d: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (no datetime objects: hot path)."""
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def parse_timestamp(text: str, year_hint: int) -> tuple[float | None, int]:
    """Seconds (naive, no zone) of a timestamp near the start of ``text``, and the year seen."""
    head = text[:80]
    m = _ISO_RE.search(head)
    if m:
        y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
        if 1 <= mo <= 12 and 1 <= d <= 31:
            frac = m.group(7)
            f = int(frac) / 10 ** len(frac) if frac else 0.0
            return _days(y, mo, d) * 86400 + h * 3600 + mi * 60 + s + f, y
    m = _GLOG_RE.match(head)
    if m:
        mo, d, h, mi, s = (int(g) for g in m.groups()[:5])
        if 1 <= mo <= 12 and 1 <= d <= 31:
            frac = m.group(6)
            return (_days(year_hint, mo, d) * 86400 + h * 3600 + mi * 60 + s + int(frac) / 10 ** len(frac)), year_hint
    return None, year_hint
