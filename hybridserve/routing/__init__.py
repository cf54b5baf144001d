"""Routing requests across engine replicas (see docs/scale-out.md)."""
