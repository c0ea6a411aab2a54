"""A PNG of replicas and queue depth over time from one autoscaling run (docs/operator.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_timeline(
    samples: Sequence[tuple[float, int | None, int | None, int | None]],
    events: Mapping[str, float],
    target: Path,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a test machine
    import matplotlib.pyplot as plt

    t = [s[0] for s in samples]
    fig, replicas_ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    replicas_ax.step(t, [s[1] for s in samples], where="post", color="tab:blue", label="Deployment replicas")
    replicas_ax.step(
        t, [s[2] for s in samples], where="post", color="tab:cyan", linestyle="--", label="HPA desired"
    )
    replicas_ax.set_xlabel("seconds since the backlog was submitted")
    replicas_ax.set_ylabel("replicas")
    depth_ax = replicas_ax.twinx()
    depth_ax.plot(t, [s[3] for s in samples], color="tab:orange", label="queue depth (.status.queueDepth)")
    depth_ax.set_ylabel("queued turns")
    for name, when in events.items():
        replicas_ax.axvline(when, color="grey", linewidth=0.6, linestyle=":")
        replicas_ax.annotate(name, (when, 0), rotation=90, fontsize=7, va="bottom", ha="right")
    lines = replicas_ax.get_legend_handles_labels()
    more = depth_ax.get_legend_handles_labels()
    replicas_ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)
    replicas_ax.set_title(title)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target)
    plt.close(fig)
