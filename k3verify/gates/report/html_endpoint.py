"""The endpoint parts of the HTML report: accepted deviations (shown before anything else), the explanation of a
failing endpoint (catalog conventions ranked by how much of the distance each removes), and what the server is
and offers."""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any


def _e(value: Any) -> str:
    return html.escape(str(value))


def accepted_section(run: Mapping[str, Any]) -> str:
    """The conventions the oracle was evaluated with, each with its released value and who uses it."""
    accepted = (run.get("endpoint") or {}).get("accepted_conventions") or []
    if not accepted:
        return ""
    rows = "".join(
        f"<tr><td><code>{_e(a['convention'])}={_e(a['value'])}</code></td><td>{_e(a['site'])}</td>"
        f"<td><code>{_e(a['released'])}</code></td><td class=\"small\">{_e(', '.join(a['used_by']) or 'none known')}"
        "</td></tr>" for a in accepted)
    return ('<section id="accepted"><h2>Accepted deviations</h2><p>The oracle was evaluated with these conventions '
            "instead of the released code's, because the run asked for it (<code>--accept-convention</code>): the "
            "verdict below holds only with them.</p><table><tr><th>accepted</th><th>site</th><th>released</th>"
            f"<th>known in</th></tr>{rows}</table></section>")


def _num(value: Any, spec: str = ".3g") -> str:
    """A number as `spec` formats it; NaN and Infinity (stored as strings in report.json) and anything that is not a
    number are shown as they are, never formatted into a crash."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _e(value)
    return format(value, spec)


def _share(x: Any) -> str:
    """A share of the distance explained; an alternative that makes it worse shows how much worse."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return _e(x)
    return "0%" if abs(x) < 0.005 else f"{x:.0%}"


def explanation_section(run: Mapping[str, Any]) -> str:
    found = (run.get("endpoint") or {}).get("explanation")
    if not found:
        return ""
    out = [f'<section id="explanation"><h2>Which convention explains the endpoint</h2><p><b>{_e(found["headline"])}'
           "</b></p>"]
    groups = found.get("groups") or []
    if groups:
        out.append(f'<p class="small">distance with the oracle as evaluated: {_num(found["baseline"])} over '
                   f'{_e(found["rows"])} positions ({_num(found["seconds"], ".1f")} s); alternatives in one row '
                   "cannot be told apart by these answers</p><table><tr><th>rank</th><th>alternative</th><th>site</th>"
                   "<th>released</th><th>distance left</th><th>explained</th><th>known in</th></tr>")
        for rank, group in enumerate(groups, start=1):
            for c in group:
                out.append(f"<tr><td>{rank}</td><td><code>{_e(c['assignment'])}</code></td><td>{_e(c['site'])}</td>"
                           f"<td><code>{_e(c['released'])}</code></td><td class=\"num\">{_num(c['distance'])}</td>"
                           f"<td class=\"num\">{_share(c['explained'])}</td>"
                           f'<td class="small" style="overflow-wrap:anywhere;max-width:24em">'
                           f"{_e(', '.join(c['used_by']) or 'none known')}</td></tr>")
        out.append("</table>")
    if found.get("unidentifiable"):
        out.append(f'<p class="small">not identifiable on these answers (they move nothing): '
                   f"{_e(', '.join(found['unidentifiable']))}</p>")
    out.append("</section>")
    return "".join(out)


def endpoint_section(run: Mapping[str, Any]) -> str:
    """The server under test: identity, declared precision, features and why any is missing, traffic."""
    ep = run.get("endpoint")
    if not ep:
        return ""
    caps = ep.get("capabilities") or {}
    rows = "".join(f"<tr><th>{_e(name)}</th><td>{'yes' if f.get('available') else 'no'}</td>"
                   f"<td class=\"small\">{_e(f.get('reason', ''))}</td></tr>"
                   for name, f in caps.items() if isinstance(f, Mapping))
    server = ep.get("server") or {}
    facts = {"url": ep.get("url"), "model": ep.get("model"), "declared precision": ep.get("declared_dtype"),
             "logprobs form": caps.get("logprob_form"), "note": ep.get("note"), "props": server.get("props"),
             "requests": ep.get("requests")}
    fact_rows = "".join(f"<tr><th>{_e(k)}</th><td><code>{_e(v)}</code></td></tr>" for k, v in facts.items() if v)
    return (f'<section id="endpoint"><h2>Endpoint under test</h2><table>{fact_rows}</table>'
            f"<h3>Features (probed)</h3><table>{rows}</table></section>")
