"""Observability of a run: the versioned event stream (schema in hotspare.coordinator.events),
the observer that derives it from the coordinator's events and ledger, its sinks (a JSON-lines
file, Prometheus metrics) and the report's plot. docs/OBSERVABILITY.md describes them.

Nothing in the coordinator imports this package: ``hotspare run`` installs the observer through
the coordinator's listener seam (``Coordinator.listen``) when asked to (``--metrics``,
``--events``, ``--report``)."""
