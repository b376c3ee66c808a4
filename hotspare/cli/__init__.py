"""Thin command-line edges. Nothing else in hotspare imports this package."""
