"""The transport contract suites' fixtures, shared by every module of the suite."""

from tests.contract._transport_harness import make_scheduling_transport, make_transport, owners

__all__ = ["make_scheduling_transport", "make_transport", "owners"]
