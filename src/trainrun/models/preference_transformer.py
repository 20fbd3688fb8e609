"""The transformer trained on preference pairs: the ``Model`` whose loss is a preference loss
over packed pair rows (``data/pair_rows.py``), so the one training step (``program/step.py``)
runs it with everything it promises (K steps per call, accumulation, sharding, precision,
bitwise resume).

The loss: the policy's forward pass over the rows, each target's log-probability, each pair's
sums (``PairLogps.of_rows``), then the configured ``PreferenceLoss`` against the reference's
sums. The reference's per-token log-probabilities come from

- ``cached``: the batch's ``reference_logps`` column (``[rows, row_len]``, the log-probability
  of token ``t`` at ``t``, 0 at the first; float32 bits as ``int32``), computed once before
  training from the starting params by ``token_logps`` itself;
- ``in_step``: a forward pass in the step under ``stop_gradient``: of the same params with the
  LoRA adapters off (``B`` read as zero; no second copy of the weights), or, without LoRA, of
  the starting params kept in the state as the model state (restored with it).

Aux ``weight`` is the batch's pairs, so accumulated microbatches give the full batch's mean.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from trainrun.config import PreferenceConfig, TransformerModel
from trainrun.models.adapters import Model
from trainrun.models.losses import tied_head_logits
from trainrun.models.preference_losses import PairLogps, PreferenceLoss
from trainrun.models.transformer import Transformer, bind_transformer, make_transformer

PyTree = Any
Batch = dict[str, jax.Array]
REFERENCE_COLUMN = "reference_logps"


def token_logps(module: Transformer, batch: Batch, key: jax.Array | None = None) -> jax.Array:
    """``[rows, row_len - 1]``: log p(token ``t + 1`` | the tokens of its sequence up to ``t``)
    of the pair rows in ``batch``, float32 (0 where the next token starts another sequence
    or is padding)."""
    tokens = batch["tokens"]
    segments = batch["segment_ids"].astype(jnp.int32)
    features, _ = module.features(tokens[:, :-1], key, segments=segments[:, :-1],
                                  segment_positions=batch["positions"][:, :-1].astype(jnp.int32))
    logits = tied_head_logits(features, module.head_table())
    targets = tokens[:, 1:].reshape(-1).astype(jnp.int32)
    picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    logps = (picked - jax.nn.logsumexp(logits, axis=-1)).reshape(tokens.shape[0], -1)
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)
    return jnp.where(same, logps, 0.0)


def pair_logps(logps: jax.Array, batch: Batch) -> tuple[PairLogps, jax.Array]:
    """Each slot's pair sums of per-token ``logps`` ``[rows, row_len - 1]`` and which slots
    hold a pair. A pair takes at least two tokens, so a row holds at most ``row_len // 2``."""
    return PairLogps.of_rows(logps, batch["segment_ids"].astype(jnp.int32),
                             batch["pair_slot"].astype(jnp.int32),
                             batch["answer"].astype(jnp.int32), batch["tokens"].shape[1] // 2)


def adapters_off(params: PyTree) -> PyTree:
    """``params`` with every LoRA adapter's ``b`` read as zero: the base model's function."""
    def off(path: tuple[Any, ...], leaf: jax.Array) -> jax.Array:
        names = [getattr(part, "key", None) for part in path]
        adapter = len(names) > 1 and str(names[-2]).endswith("_lora") and names[-1] == "b"
        return jnp.zeros_like(leaf) if adapter else leaf

    return jax.tree_util.tree_map_with_path(off, params)


def make_preference_transformer(cfg: TransformerModel, preference: PreferenceConfig) -> Model:
    """The transformer ``cfg`` describes with ``preference``'s loss over pair rows."""
    spec = PreferenceLoss(preference.loss, beta=preference.beta,
                          label_smoothing=preference.label_smoothing,
                          simpo_gamma=preference.simpo_gamma, nll_weight=preference.nll_weight)
    base = make_transformer(cfg)
    bind = bind_transformer(cfg)
    keeps_start = (spec.needs_reference and preference.reference == "in_step"
                   and cfg.lora is None)

    def reference(params: PyTree, batch: Batch, model_state: PyTree) -> PairLogps | None:
        if not spec.needs_reference:
            return None
        if preference.reference == "cached":
            # the column's float32 bits travel as int32, beyond the compute dtype's cast
            column = jax.lax.bitcast_convert_type(batch[REFERENCE_COLUMN], jnp.float32)
            return pair_logps(column[:, 1:], batch)[0]
        start = (adapters_off(params) if model_state is None else  # the policy's dtype
                 jax.tree.map(lambda r, p: r.astype(p.dtype), model_state, params))
        logps = token_logps(bind(jax.lax.stop_gradient(start)), batch)
        return pair_logps(jax.lax.stop_gradient(logps), batch)[0]

    def evaluate(params: PyTree, batch: Batch, key: jax.Array | None,
                 model_state: PyTree) -> tuple[jax.Array, dict[str, jax.Array]]:
        policy, present = pair_logps(token_logps(bind(params), batch, key), batch)
        loss, aux = spec(policy, reference(params, batch, model_state), present)
        return loss, {**aux, "weight": jnp.sum(present, dtype=jnp.float32)}

    def loss(params: PyTree, batch: Batch, key: jax.Array,
             model_state: PyTree = None) -> tuple[jax.Array, dict[str, jax.Array], PyTree]:
        value, aux = evaluate(params, batch, key, model_state)
        return value, aux, model_state

    def eval_loss(params: PyTree, batch: Batch,
                  model_state: PyTree = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        return evaluate(params, batch, None, model_state)

    return dataclasses.replace(
        base, loss=loss, eval_loss=eval_loss, name="transformer (preference)",
        # the starting params, drawn with the same key as the params themselves
        init_model_state=base.init if keeps_start else None)
