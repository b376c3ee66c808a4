"""Coordinator: membership, generations, spare pool, recovery decisions, event log."""
from hotspare.coordinator.coordinator import Coordinator
from hotspare.coordinator.ledger import FailureRecord, Ledger

__all__ = ["Coordinator", "FailureRecord", "Ledger"]
