"""Checkpoints: Orbax IO, when to save, integrity, what may change on resume, ``init.from``,
and the one read-only reader that sampling, export and ``init.from`` use."""
