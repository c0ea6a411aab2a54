"""The invariants, checked over everything a :class:`tests.chaos.harness.ChaosRun` saw (its report)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from agent_dispatch.models import WorkState
from tests.chaos.harness import TERMINAL, ChaosRun, _retry
from tests.chaos.kafka_support import fresh_accepts_without_quorum, replicated_figures, topic_messages


def verify(run: ChaosRun) -> dict[str, Any]:
    """Check every invariant; returns the report (``violations`` lists what failed)."""
    violations: list[str] = list(run.crashes)
    items = {item.id: item for item in run.all_items()}
    accepted = {job for stats in run.clients for job in stats.accepted.values()}
    submitted = sum(len(stats.submitted_keys) for stats in run.clients)

    # 1. Every accepted turn reached a terminal state (checked by _settle for every item).
    missing = sorted(accepted - items.keys())
    if missing:
        violations.append(f"{len(missing)} accepted turns are not in the store, e.g. {missing[:3]}")
    not_terminal = [i.id for i in items.values() if i.state not in TERMINAL]
    if not_terminal:
        violations.append(f"{len(not_terminal)} turns not terminal: {not_terminal[:3]}")

    # 2. Exactly one terminal outcome, and fencing held: per item, its records and the sink.
    by_owner: Counter[str] = Counter()
    superseded = 0
    stale_accepted: list[str] = []
    for item in items.values():
        records = _retry(lambda item=item: run.store.outcomes(item.id))
        commits = [r for r in records if r.event == "commit"]
        succeeded = [r for r in commits if r.outcome == "succeeded"]
        if len(succeeded) > 1:
            violations.append(f"{item.id}: {len(succeeded)} succeeded commits")
        if len(commits) > 1:
            violations.append(f"{item.id}: {len(commits)} terminal commits {[c.outcome for c in commits]}")
        for record in succeeded:
            by_owner[(record.owner or "").split("/")[0]] += 1
        effects = run.sink.accepted_at.get(item.id, [])
        if item.state is WorkState.SUCCEEDED:
            if not succeeded or succeeded[0].fencing_token != item.fencing_token:
                violations.append(f"{item.id}: succeeded without a commit record for its final token")
            if run.sink.highest.get(item.id) != item.fencing_token:
                violations.append(
                    f"{item.id}: committed with token {item.fencing_token} but the sink's highest "
                    f"accepted token is {run.sink.highest.get(item.id)}"
                )
        elif effects and max(t for t, _ in effects) > item.fencing_token:
            violations.append(f"{item.id}: an effect with a token above the item's final token")
        # An effect accepted after a newer lease had been issued came from a stale lease.
        claims = sorted((r.fencing_token, r.at.timestamp()) for r in records if r.event == "claim")
        for token, at in effects:
            newer = [c_at for c_token, c_at in claims if c_token > token]
            if newer and min(newer) < at - 0.05:
                stale_accepted.append(
                    f"{item.id}: token {token} accepted {at - min(newer):.2f}s after a newer claim"
                )
            if token != item.fencing_token:
                superseded += 1
    if stale_accepted:
        violations.append(f"{len(stale_accepted)} effects of stale leases accepted: {stale_accepted[:3]}")

    # 3. The bound held (sampled), and every delivery acknowledged at the end. The store's
    # unfinished count is what admission compares on every transport; on the database queues the
    # queue's depth must hold too, while Kafka's lag (re-drives, uncommitted offsets) is a signal.
    if run.unfinished_samples == 0:
        violations.append("the store's unfinished count was never sampled (check 3 asserts nothing)")
    if run.unfinished_over:
        violations.append(
            f"unfinished turns above the bound {run.settings.max_depth}: {run.unfinished_over[:5]}"
        )
    if run.depth_over and not run.name.startswith("kafka"):
        violations.append(f"depth above the bound {run.settings.max_depth}: {run.depth_over[:5]}")
    if run.final_depth != 0:
        violations.append(f"depth is {run.final_depth} at the end, not 0")

    # 4. Metrics add up: each surviving worker's counter equals the store's commits it owns.
    live = {w.worker_id: w for w in run.workers if not w.killed}
    killed = [w.worker_id for w in run.workers if w.killed]
    metric_total = 0
    for worker_id, worker in live.items():
        counted = int(worker.last_scrape.get("succeeded", -1))
        metric_total += counted
        if counted != by_owner.get(worker_id, 0):
            violations.append(
                f"{worker_id}: metrics say {counted} succeeded, the store has {by_owner.get(worker_id, 0)}"
            )
    killed_commits = sum(by_owner.get(w, 0) for w in killed)
    states = Counter(item.state.value for item in items.values())
    if metric_total + killed_commits != states.get("succeeded", 0):
        violations.append(
            f"succeeded: metrics of live workers {metric_total} + commits of killed workers "
            f"{killed_commits} != {states.get('succeeded', 0)} succeeded turns"
        )
    unexpected = [u for stats in run.clients for u in stats.unexpected]
    if unexpected:
        violations.append(f"{len(unexpected)} unexpected HTTP answers, e.g. {unexpected[:3]}")
    refused = sum(len(v) for v in run.sink.refused.values())
    statuses: Counter[str] = Counter()
    for stats in run.clients:
        statuses.update(stats.statuses)
    answered: Counter[str] = Counter()
    for stats in run.clients:
        answered.update(stats.answered_states)
    accepted_cancelled = sum(
        1 for job in accepted if job in items and items[job].state is WorkState.CANCELLED
    )
    messages = topic_messages(run.backend.env, run.seed) if run.name.startswith("kafka") else None
    # 5. Replicated Kafka: no fresh 202 for a turn that no quorum of in-sync replicas could hold.
    undurable = fresh_accepts_without_quorum(run)
    if undurable:
        violations.append(
            f"{len(undurable)} turns accepted (202, created) while fewer than min.insync.replicas "
            f"brokers ran: {undurable[:3]}"
        )
    replicated = replicated_figures(run)
    if replicated and replicated["topic_replication_factors"] != [run.services.kafka.replication_factor]:
        violations.append(
            f"the transport created its topic with replication factors {replicated['topic_replication_factors']}, "
            f"not the cluster's {run.services.kafka.replication_factor}"
        )
    run.report = {
        "transport": run.name,
        "seed": run.seed,
        "duration_s": run.duration_s,
        "faults": dict(sorted(run.faults.items())),
        "turns_submitted": submitted,
        "turns_accepted": len(accepted),
        "turns_in_store": len(items),
        "turns_completed": states.get("succeeded", 0),
        "terminal_states": dict(sorted(states.items())),
        "stale_effects_refused": refused,
        "superseded_effects": superseded,
        "depth_max": run.depth_max,
        "depth_bound": run.settings.max_depth,
        "depth_samples": run.depth_samples,
        "depth_unavailable_samples": run.depth_unavailable,
        "depth_errors": dict(run.depth_errors.most_common(3)),
        "unfinished_max": run.unfinished_max,
        "unfinished_samples": run.unfinished_samples,
        "http_statuses": dict(sorted(statuses.items())),
        "accepted_answers": dict(sorted(answered.items())),
        "accepted_then_cancelled": accepted_cancelled,
        "workers_started": len(run.workers),
        # Kafka: every message ever produced, re-driven duplicates included (each ran at most once).
        "topic_messages": messages,
        "worker_starts_refused": run.refused_starts,
        "worker_stop_s_max": max(run.stop_seconds.values(), default=None),
        "recovered_in_s": run.recovered_in_s,
        "violations": violations,
        **replicated,
        "fault_log": run.fault_log,
    }
    return run.report
