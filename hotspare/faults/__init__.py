"""Fault injection for tests and ``hotspare chaos``: a plug-in, never on the production path."""
