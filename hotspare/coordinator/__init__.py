"""Coordinator: membership, generations, spare pool, recovery decisions, event log."""
from hotspare.coordinator.coordinator import Coordinator, CoordinatorSettings
from hotspare.coordinator.ledger import FailureRecord, Ledger

__all__ = ["Coordinator", "CoordinatorSettings", "FailureRecord", "Ledger"]
