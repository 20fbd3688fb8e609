"""The data floor's error, in a module of its own: what reads records, tokenizers and chat
templates raises it without importing the Grain pipeline."""

from __future__ import annotations

from trainrun.errors import UserError


class DataError(UserError):
    """Data that cannot be used as configured; the CLI prints it on one line and exits 2."""
