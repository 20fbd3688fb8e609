"""Decoding multiplies by the output head's table laid out ``[d_model, vocab]`` once per call
(``decode_head_layout``): the ``HeadLayout`` (``program/decode.py``) the decoder takes in place
of the model's own ``[vocab, d_model]`` table.

XLA:CPU multiplies a few rows (a decoding batch) by a ``[vocab, d_model]`` table far slower
than by its transpose; the decoder carries the transposed table into its loop as an operand.
The same tokens either way (BENCHMARKS.md, "Decoding against transformers' generate").
"""

from __future__ import annotations

import jax

from trainrun.models.transformer import Transformer


def head_transposed(module: Transformer) -> jax.Array:
    """The head's table as ``[d_model, vocab]``."""
    return module.head_table().T
