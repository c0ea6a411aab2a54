"""The external-metrics API server (``external.metrics.k8s.io/v1beta1``) an HPA scales on.

It runs as its own small Deployment (``agent-dispatch metrics-api``), registered with the
aggregator by the chart's APIService, and answers ``agent_dispatch_queue_depth`` for each
AgentDispatch from the ``.status.queueDepth`` the operator keeps fresh: no database credentials,
no extra infrastructure. See docs/operator.md.
"""
