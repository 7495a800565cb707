"""Rendering a `Diagnosis`: human text (rich), stable JSON, and a self-contained HTML page."""

from __future__ import annotations

import html
import json
from typing import Any, TypeVar

from rich.console import Console
from rich.markup import escape as escape_markup

from ckptguard.diagnose.engine import Diagnosis, _ranges
from ckptguard.diagnose.kb import FailureClass
from ckptguard.diagnose.mask import Masker
from ckptguard.printable import escape_controls

_T = TypeVar("_T")


def masked(value: _T) -> _T:
    """``value`` (a string, a JSON-like object or a dataclass such as a ``Diagnosis``) with every string
    passed through the masker: secrets in any form, and the values of this process's secret-named
    environment variables. Everything a report writes goes through it."""
    out: Any = Masker().finalize_obj(value)
    return out  # type: ignore[no-any-return]


def escape(value: str) -> str:
    """A data string for rich text: markup and control characters escaped."""
    return escape_markup(escape_controls(value))


_COLORS = {"initiating": "#c0392b", "launcher": "#8e44ad", "collateral": "#7f8c8d", "context": "#2c7fb8"}


def to_json(diag: Diagnosis) -> str:
    """One JSON object, keys in a stable order (the Diagnosis page gives the schema); every string masked."""
    return json.dumps(masked(diag.to_dict()), indent=2, ensure_ascii=False)


def _ranks(ranks: list[int]) -> str:
    return _ranges(ranks) if ranks else "none"


def render_text(diag: Diagnosis, console: Console) -> None:
    """The human report: the answer first, then evidence, fix and alternatives; every string masked."""
    diag = masked(diag)
    p = console.print
    if not diag.found:
        p("[bold]No failure found.[/bold] " + escape(" ".join(diag.notes)))
        p(f"Read {diag.stats.get('lines', 0)} lines from {len(diag.sources)} file(s).")
        return
    p(f"[bold red]{escape(diag.title)}[/bold red]")
    p(
        f"  class        [bold]{diag.failure_class}[/bold] ({escape(class_detail(diag))})   confidence "
        f"{diag.confidence:.2f} ({diag.confidence_label})"
    )
    if diag.initiating_rank is not None:
        host = f" on {escape(diag.initiating_host)}" if diag.initiating_host else ""
        p(f"  initiating   [bold]rank {diag.initiating_rank}[/bold]{host}")
    else:
        p("  initiating   [bold]rank unknown[/bold]")
    p(f"               {escape(diag.rank_attribution)}")
    if diag.ordering_basis:
        p(f"               order: {escape(diag.ordering_basis)}")
    p(f"  collateral   {_ranks(diag.collateral_ranks)}")
    if diag.also_failed_ranks:
        p(f"  also failed  {_ranks(diag.also_failed_ranks)}")
    if diag.world_size:
        p(f"  world size   {diag.world_size}")
    p("\n[bold]Root cause[/bold]")
    p("  " + escape(diag.root_cause))
    p("\n[bold]Evidence[/bold]")
    for e in diag.evidence:
        rank = f"rank {e.rank}" if e.rank is not None else "rank ?"
        p(f"  [dim]{escape(e.file)}:{e.line}[/dim] [{_role_style(e.role)}]{e.role}[/] ({rank})")
        p(f"    {escape(e.text)}", soft_wrap=True)
    p("\n[bold]Fix[/bold]")
    p("  " + escape(diag.fix.split(" ckptguard's Checkpointer prevents")[0]))
    if diag.checkpointer_switch:
        p(
            "  ckptguard's Checkpointer prevents this class (one discovered leader per filesystem, fresh "
            "attempt directories, atomic commit). Switch with two lines:"
        )
        for line in diag.checkpointer_switch.splitlines():
            p(f"    [green]{escape(line)}[/green]")
    if diag.prevention:
        p("\n[bold]Prevention[/bold]")
        for item in diag.prevention:
            p(f"  - {escape(item)}")
    if diag.confirm:
        p("\n[bold]How to confirm[/bold]")
        for item in diag.confirm:
            p(f"  - {escape(item)}")
    p("\n[bold]Verify the fix[/bold]")
    p(f"  $ {escape(diag.verify_command)}")
    if diag.alternatives:
        p("\n[bold]Competing hypotheses[/bold]")
        for a in diag.alternatives:
            ranks = f" ranks {_ranges(a.ranks)}" if a.ranks else ""
            kind = f" ({a.kind.replace('_', ' ')})" if a.kind and a.kind != a.failure_class else ""
            p(f"  - {a.failure_class}{kind} (score {a.score:.2f}){ranks}: {escape(a.why_not)}")
            for e in a.evidence[:2]:
                p(f"      [dim]{escape(e.file)}:{e.line}[/dim] {escape(e.text[:200])}", soft_wrap=True)
    if diag.notes:
        p("\n[bold]Notes[/bold]")
        for n in diag.notes:
            p(f"  - {escape(n)}")
    st = diag.stats
    p(
        f"\n[dim]{len(diag.sources)} file(s), {st.get('lines', 0)} lines, "
        f"{st.get('bytes', 0) / 1e6:.1f} MB in {st.get('seconds', 0)} s. "
        f"Explain the class: ckptguard explain {diag.kind or diag.failure_class}[/dim]"
    )


def class_detail(diag: Diagnosis) -> str:
    """What the class line adds to the family: the finer kind and its title when the KB class is
    a split of the family ("config error: Configuration or launch-argument error"), else the
    category."""
    if diag.kind and diag.kind != diag.failure_class:
        return f"{diag.kind.replace('_', ' ')}: {diag.title}"
    return diag.category


def _role_style(role: str) -> str:
    return {"initiating": "bold red", "launcher": "magenta", "collateral": "dim", "context": "cyan"}.get(role, "")


def render_explain(fc: FailureClass, console: Console) -> None:
    """A KB entry for `ckptguard explain`."""
    p = console.print
    family = f", reported as {fc.family_id}" if fc.family else ""
    p(
        f"[bold]{escape(fc.title)}[/bold]  ({fc.id}, {fc.category}"
        f"{', usually collateral' if fc.collateral else ''}{family})"
    )
    p("  " + escape(fc.summary))
    sections: list[tuple[str, list[str] | str]] = [
        ("Mechanism", fc.mechanism.strip()),
        ("Symptoms", list(fc.symptoms)),
        ("Affected", list(fc.affected)),
        ("How to confirm", list(fc.confirm)),
        ("Fix", " ".join(fc.fix.split())),
        ("Prevention", list(fc.prevention)),
        ("Verify", fc.verify_command),
        ("Related", list(fc.related)),
    ]
    for title, body in sections:
        p(f"\n[bold]{title}[/bold]")
        if isinstance(body, list):
            for item in body:
                p(f"  - {escape(item)}")
        else:
            for line in body.splitlines():
                p(f"  {escape(line)}")
    if fc.checkpointer_prevents:
        p("\n[bold]ckptguard[/bold]\n  Checkpointer prevents this class.")
    p("\n[bold]Signatures[/bold]")
    for s in fc.signatures:
        p(f"  [{s.on}] w={s.weight:.2f} {escape(s.pattern.pattern)}", soft_wrap=True)


def render_html(diag: Diagnosis) -> str:
    """A self-contained page (no external assets) with a per-rank timeline of failure events; every
    string masked."""
    e = html.escape
    d = masked(diag)
    rows = []
    for ev in d.evidence:
        rows.append(
            f"<tr><td>{e(ev.role)}</td><td>{'' if ev.rank is None else ev.rank}</td>"
            f"<td><code>{e(ev.file)}:{ev.line}</code></td><td><pre>{e(ev.text)}</pre></td></tr>"
        )
    alts = "".join(
        f"<li><b>{e(a.failure_class)}</b> (score {a.score:.2f}{', ranks ' + e(_ranges(a.ranks)) if a.ranks else ''})"
        f": {e(a.why_not)}<ul>"
        f"{''.join(f'<li><code>{e(x.file)}:{x.line}</code> {e(x.text[:200])}</li>' for x in a.evidence)}</ul></li>"
        for a in d.alternatives
    )
    lists = {
        k: "".join(f"<li>{e(x)}</li>" for x in v)
        for k, v in (("prevention", d.prevention), ("confirm", d.confirm), ("notes", d.notes))
    }
    switch = (
        (
            f"<p>ckptguard's Checkpointer prevents this class. Switch with two lines:</p>"
            f"<pre class=code>{e(d.checkpointer_switch)}</pre>"
        )
        if d.checkpointer_switch
        else ""
    )
    head = f"<h1>{e(d.title) if d.found else 'No failure found'}</h1>" + (
        f"<table class=kv><tr><th>class</th><td><b>{e(str(d.failure_class))}</b> ({e(class_detail(d))})</td></tr>"
        f"<tr><th>confidence</th><td>{d.confidence:.2f} ({d.confidence_label})</td></tr>"
        f"<tr><th>initiating rank</th><td><b>{'unknown' if d.initiating_rank is None else d.initiating_rank}</b>"
        f"{' on ' + e(d.initiating_host) if d.initiating_host else ''}"
        f"<br><small>{e(d.rank_attribution)}</small></td></tr>"
        f"<tr><th>collateral ranks</th><td>{e(_ranks(d.collateral_ranks))}</td></tr>"
        f"<tr><th>also failed</th><td>{e(_ranks(d.also_failed_ranks))}</td></tr></table>"
        if d.found
        else ""
    )
    body = (
        ""
        if not d.found
        else f"""
<h2>Root cause</h2><p>{e(d.root_cause)}</p>
<h2>Timeline of failure events per rank</h2>{_timeline_svg(d)}
<h2>Evidence</h2><table class=ev><tr><th>role</th><th>rank</th><th>where</th><th>line</th></tr>{"".join(rows)}</table>
<h2>Fix</h2><p>{e(d.fix.split(" ckptguard's Checkpointer prevents")[0])}</p>{switch}
<h2>Prevention</h2><ul>{lists["prevention"]}</ul>
<h2>How to confirm</h2><ul>{lists["confirm"]}</ul>
<h2>Verify the fix</h2><pre class=code>{e(d.verify_command)}</pre>
<h2>Competing hypotheses</h2><ul>{alts or "<li>none with evidence in the log</li>"}</ul>
<h2>Notes</h2><ul>{lists["notes"] or "<li>none</li>"}</ul>"""
    )
    return f"""<!doctype html>
<html lang=en><head><meta charset=utf-8><title>ckptguard diagnose: {e(str(d.failure_class))}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}}
table.kv th{{background:#f6f6f6}} pre{{white-space:pre-wrap;margin:0;font-size:12px}}
pre.code{{background:#f4f4f4;padding:8px}} small{{color:#666}} svg text{{font-size:11px;font-family:monospace}}
</style></head><body>
{head}{body}
<p><small>schema_version 1; {len(d.sources)} file(s), {d.stats.get("lines", 0)} lines. \
Generated offline by ckptguard diagnose.</small></p>
</body></html>
"""


def _timeline_svg(d: Diagnosis, max_rows: int = 64) -> str:
    e = html.escape
    events = d.timeline
    if not events:
        return "<p>no events</p>"
    ranks: list[int | None] = []
    for t in events:
        if t.rank not in ranks:
            ranks.append(t.rank)
    ranks.sort(key=lambda r: (r is None, r if r is not None else 0))
    important = {d.initiating_rank, *d.also_failed_ranks}
    shown = [r for r in ranks if r in important] + [r for r in ranks if r not in important]
    shown = sorted(shown[:max_rows], key=lambda r: (r is None, r if r is not None else 0))
    use_time = sum(t.t is not None for t in events) >= len(events) * 0.8
    xs = [t.t if use_time and t.t is not None else float(t.order) for t in events]
    lo, hi = min(xs), max(xs)
    span = (hi - lo) or 1.0
    width, left, row_h = 900, 90, 18
    height = row_h * len(shown) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}">']
    for i, r in enumerate(shown):
        y = 20 + i * row_h
        label = "rank ?" if r is None else f"rank {r}"
        weight = "bold" if r == d.initiating_rank else "normal"
        parts.append(
            f'<text x="4" y="{y + 4}" font-weight="{weight}">{e(label)}</text>'
            f'<line x1="{left}" y1="{y}" x2="{left + width}" y2="{y}" stroke="#eee"/>'
        )
    for t, x in zip(events, xs, strict=True):
        if t.rank not in shown:
            continue
        y = 20 + shown.index(t.rank) * row_h
        cx = left + (x - lo) / span * width
        color = "#7f8c8d" if t.collateral else "#c0392b"
        parts.append(
            f'<circle cx="{cx:.1f}" cy="{y}" r="5" fill="{color}"><title>'
            f"{e(t.failure_class)} at {e(t.file)}:{t.line}\n{e(t.text)}</title></circle>"
        )
    axis = "time (s, from the first event)" if use_time else "order of appearance in the log"
    parts.append(
        f'<text x="{left}" y="{height - 4}">{e(axis)}; red = primary failure, grey = collateral'
        f"{'; ' + str(len(ranks) - len(shown)) + ' more ranks not drawn' if len(ranks) > len(shown) else ''}"
        "</text>"
    )
    parts.append("</svg>")
    return "".join(parts)
