"""Errors of the HE layer."""

from __future__ import annotations


class HEError(ValueError):
    """An HE object or parameter set was rejected (insecure, wrong params, corrupted)."""
