"""The transformer trained on preference pairs: the ``Model`` whose loss is a preference loss
over packed pair rows (``data/pair_rows.py``), so the one training step (``program/step.py``)
runs it with everything it promises (K steps per call, accumulation, sharding, precision,
bitwise resume).

The loss: the policy's forward pass over the rows, each target's log-probability, each pair's
sums (``PairLogps.of_rows``), then the configured ``PreferenceLoss`` against the reference's
sums. The reference's per-token log-probabilities come from

- ``cached``: the batch's ``reference_logps`` column (``[rows, row_len]``, the log-probability
  of token ``t`` at ``t``, 0 at the first; float32 bits as ``int32``), computed once before
  training from the starting params by the same ``token_logps`` (``token_logps.py``);
- ``in_step``: a forward pass in the step under ``stop_gradient``: of the same params with the
  LoRA adapters off (``B`` read as zero; no second copy of the weights), or, without LoRA, of
  the starting params kept in the state as the model state at the first step (``kept_start``:
  a fresh init's or init.from's; checkpointed and restored with the state).

Aux ``weight`` is the batch's pairs, so accumulated microbatches give the full batch's mean; the
step logs it as ``pairs``, the pairs it trained (a batch's rows hold as many as fit).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from trainrun.config import PreferenceConfig, TransformerModel
from trainrun.models.adapters import Model
from trainrun.models.lora import adapters_off
from trainrun.models.preference_losses import PairLogps, PreferenceLoss
from trainrun.models.token_logps import pair_rows, token_logps
from trainrun.models.transformer import bind_transformer, make_transformer

PyTree = Any
Batch = dict[str, jax.Array]
REFERENCE_COLUMN = "reference_logps"


def pair_logps(logps: jax.Array, batch: Batch) -> tuple[PairLogps, jax.Array]:
    """Each slot's pair sums of per-token ``logps`` ``[rows, row_len - 1]`` and which slots
    hold a pair. A pair takes at least two tokens, so a row holds at most ``row_len // 2``."""
    return PairLogps.of_rows(logps, batch["segment_ids"].astype(jnp.int32),
                             batch["pair_slot"].astype(jnp.int32),
                             batch["answer"].astype(jnp.int32), batch["tokens"].shape[1] // 2)


def make_preference_transformer(cfg: TransformerModel, preference: PreferenceConfig) -> Model:
    """The transformer ``cfg`` describes with ``preference``'s loss over pair rows."""
    spec = PreferenceLoss(preference.loss, beta=preference.beta,
                          label_smoothing=preference.label_smoothing,
                          simpo_gamma=preference.simpo_gamma, nll_weight=preference.nll_weight)
    base = make_transformer(cfg)
    bind = bind_transformer(cfg)
    keeps_start = (spec.needs_reference and preference.reference == "in_step"
                   and cfg.lora is None)

    def reference(params: PyTree, batch: Batch, start: PyTree) -> PairLogps | None:
        if not spec.needs_reference:
            return None
        if preference.reference == "cached":
            # the column's float32 bits travel as int32, beyond the compute dtype's cast
            column = jax.lax.bitcast_convert_type(batch[REFERENCE_COLUMN], jnp.float32)
            return pair_logps(column[:, 1:], batch)[0]
        start = (adapters_off(params) if start is None else  # in the policy's dtype
                 jax.tree.map(lambda r, p: r.astype(p.dtype), start, params))
        logps, _ = token_logps(bind(jax.lax.stop_gradient(start)), pair_rows(batch),
                               chunk=cfg.loss_chunk)
        return pair_logps(jax.lax.stop_gradient(logps), batch)[0]

    def evaluate(params: PyTree, batch: Batch, key: jax.Array | None,
                 start: PyTree) -> tuple[jax.Array, dict[str, jax.Array]]:
        logps, _ = token_logps(bind(params), pair_rows(batch), key, cfg.loss_chunk)
        policy, present = pair_logps(logps, batch)
        loss, aux = spec(policy, reference(params, batch, start), present)
        return loss, {**aux, "weight": jnp.sum(present, dtype=jnp.float32)}

    def loss(params: PyTree, batch: Batch, key: jax.Array,
             model_state: PyTree = None) -> tuple[jax.Array, dict[str, jax.Array], PyTree]:
        model_state = None if model_state is None else kept_start(model_state, params)
        value, aux = evaluate(params, batch, key,
                              None if model_state is None else model_state["params"])
        return value, aux, model_state

    def eval_loss(params: PyTree, batch: Batch,
                  model_state: PyTree = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        start = None if model_state is None else kept_start(model_state, params)["params"]
        return evaluate(params, batch, None, start)

    def init_start(key: jax.Array) -> PyTree:
        return {"params": base.init(key), "kept": jnp.zeros((), jnp.bool_)}

    return dataclasses.replace(base, loss=loss, eval_loss=eval_loss,
                               name="transformer (preference)",
                               init_model_state=init_start if keeps_start else None,
                               weight_name="pairs")


def kept_start(model_state: PyTree, params: PyTree) -> PyTree:
    """The model state of an in-step reference without LoRA, ``{"params": the starting params,
    "kept": whether they are}``: the params a run takes its first step with (its fresh init,
    or init.from's) are kept there at that step, and stay."""
    taken = jax.lax.cond(
        model_state["kept"], lambda: model_state["params"],
        lambda: jax.tree.map(lambda p, r: jax.lax.stop_gradient(p).astype(r.dtype), params,
                             model_state["params"]))
    return {"params": taken, "kept": jnp.ones((), jnp.bool_)}
