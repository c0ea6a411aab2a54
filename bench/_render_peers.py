"""The peers' parts of ``docs/benchmarks.md``: every peer at two settings (``bench/_peers.py``).

A peer's rows are named by ``_peers.LABELS``: its plain name at the fairness setting, and
"<name> (its throughput settings)" at its own documented throughput settings. A saved run from
before the two settings (no ``settings`` in its peers) reads as the fairness setting only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench import _peers
from bench._common import CONCURRENCY, OURS

Med = Callable[[str, int], "float | None"]

SETTING_NAMES = {
    _peers.FAIR: f"the fairness setting ({CONCURRENCY} workers per process; River 100, its quick start's)",
    _peers.THROUGHPUT: "each peer's own documented throughput settings",
}


def settings(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every (peer name, setting) of the run, in run order; a setting has key, label, workers, notes."""
    out: list[tuple[str, dict[str, Any]]] = []
    for p in data.get("peers") or []:
        saved = p.get("settings") or [
            {"key": _peers.FAIR, "label": p["name"], "workers": p.get("concurrency") or CONCURRENCY}
        ]
        for s in saved:
            notes = _peers.NOTES.get(p["name"], {}).get(s["key"]) or s.get("notes") or p.get("notes", "")
            out.append((p["name"], {**s, "notes": notes}))
    return out


def labels(data: dict[str, Any], key: str) -> list[str]:
    return [s["label"] for _, s in settings(data) if s["key"] == key]


def throughput_labels(data: dict[str, Any]) -> set[str]:
    return set(labels(data, _peers.THROUGHPUT))


def _procs_text(procs: list[int]) -> str:
    names = [str(k) for k in procs]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def goal_lines(data: dict[str, Any], procs: list[int], med: Med) -> list[str]:
    """The goal "PostgreSQL end to end >= 1.0x every peer at 1, 2 and 4 processes, at both peer
    settings", then the same at each setting alone, with the lowest ratio and every miss."""

    def verdict(keys: list[str]) -> tuple[str, str]:
        cells: list[tuple[str, int, float | None]] = []
        for key in keys:
            for label in labels(data, key):
                for k in procs:
                    ours, theirs = med(OURS, k), med(label, k)
                    cells.append((label, k, ours / theirs if ours and theirs else None))
        known = [c for c in cells if c[2] is not None]
        if not cells:
            return "no peer ran", "n/a"
        if not known:
            return "n/a (no figures)", "n/a"
        low = min(known, key=lambda c: c[2] or 0.0)
        misses = [c for c in known if (c[2] or 0.0) < 1.0]
        text = (
            f"lowest {low[2]:.2f}x ({low[0]}, {low[1]} proc); {len(known) - len(misses)} of {len(cells)} met"
        )
        if misses:
            text += "; below: " + ", ".join(f"{c[0]} {c[1]} proc {c[2]:.2f}x" for c in misses)
        if len(known) < len(cells):
            text += f"; {len(cells) - len(known)} without figures"
        status = "**missed**" if misses else ("n/a" if len(known) < len(cells) else "**met**")
        return text, status

    goal = f"PostgreSQL end to end >= 1.0x every peer at {_procs_text(procs)} processes"
    keys = [key for key in (_peers.FAIR, _peers.THROUGHPUT) if labels(data, key)]
    lines = []
    if len(keys) > 1:
        text, status = verdict(keys)
        lines.append(f"| {goal}, at both peer settings | {text} | {status} |")
    for key in keys:
        text, status = verdict([key])
        lines.append(f"| {goal}, at {SETTING_NAMES[key]} | {text} | {status} |")
    return lines


def settings_text(batch: int) -> str:
    """The line of the run's description that says how every system is set up."""
    return (
        f"Every peer runs at two settings in the same interleaved rounds: the fairness setting, "
        f"{CONCURRENCY} workers per process as ours (River: 100, its quick start's setting), and its own "
        'documented throughput settings (rows marked "(its throughput settings)"; what each one is, and '
        f"which page of its docs it comes from, is under Peers). Every system submits in batches of {batch} "
        "with its own batch-insert API, from a separate process, at both settings"
    )


def peers_section(w: Callable[[str], None], data: dict[str, Any], scrub: Callable[[str], str]) -> None:
    w("### Peers")
    w("")
    w(
        "Harnesses: `bench/peers/` (our code, calling each peer's public API; the setting is an argument "
        "of its `work` command). Each peer at two settings:"
    )
    w("")
    by_peer: dict[str, list[dict[str, Any]]] = {}
    for name, s in settings(data):
        by_peer.setdefault(name, []).append(s)
    versions = {p["name"]: p["version"] for p in data.get("peers") or []}
    for name, saved in by_peer.items():
        parts = []
        for s in saved:
            what = "fairness setting" if s["key"] == _peers.FAIR else "its throughput settings"
            parts.append(f"*{what}* ({s['workers']:,} workers per process): {s['notes']}")
        w(f"- **{name}** {versions.get(name, '')}: " + "; ".join(parts) + ".")
    if data.get("peers") is not None and not data.get("peers_missing"):
        w("")
        w("Every peer installed from its own registry and ran; none had to be left out.")
    for p in data.get("peers_missing", []):
        w(f"- **{p['name']}** could not be installed: `{scrub(p['command'])}` failed with:")
        w("")
        w("  ```")
        for line in scrub(p["error"]).splitlines()[-8:]:
            w(f"  {line}")
        w("  ```")
    w("")
