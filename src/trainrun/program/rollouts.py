"""Rollouts for GRPO: ``group`` completions of each prompt drawn from the current params by the
decoder (``decode.py``) in one program, and the per-token log-probabilities of those
completions under given params, by a forward pass of the whole text.

Completion ``j`` of prompt ``i`` at step ``step`` is drawn from its own key,
``fold_in(fold_in(fold_in(key, step), i), j)`` (``rollout_keys``): a step's rollouts drawn again
(on resume) are the same, bit for bit, whatever rows are beside them. Prompts are left-padded
to the longest, as the decoder pads them; on a mesh the rows are split over its batch axes
(``data``, ``fsdp``, ``expert``) as a training batch's are, and the params stay where they lie.

A completion is its generated tokens up to and including the first stop id drawn (a turn's
end), or up to and including the token that completes a stop string (``StopStrings``), or the
token limit; its tokens after that are 0 and out of its mask. The "old" log-probabilities (of
the params that drew the completions) come from a forward pass, not from the sampler, whose
temperature and nucleus change them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainrun.config import BATCH_AXES, TransformerModel
from trainrun.models.grpo_transformer import Rollouts
from trainrun.models.lora import adapters_off
from trainrun.models.token_logps import rollout_rows, token_logps
from trainrun.models.transformer import bind_transformer
from trainrun.program.decode import (
    SampleError,
    StopStrings,
    decoder,
    head_as_trained,
    left_padded,
    require_settings,
    stop_array,
)
from trainrun.program.precision import DTYPES, cast_floats
from trainrun.program.sharding import on_host

PyTree = Any


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """How rollouts are drawn.

    group: completions per prompt.
    tokens: the token limit of a completion.
    temperature, top_p: as ``decode.generate``'s (temperature 0: greedy, every completion of
        a prompt the same).
    stop_ids: ids that end a completion (included in it): a turn's end.
    stop_strings: texts that end a completion (``StopStrings``).
    compute: the dtype the model runs in (the run's ``precision.compute``).
    """

    group: int
    tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    stop_strings: StopStrings | None = None
    compute: str = "float32"


# one program: traced op by op it costs a GRPO step several milliseconds of host time
@functools.partial(jax.jit, static_argnums=(2, 3))
def rollout_keys(key: jax.Array, step: int | jax.Array, prompts: int, group: int) -> jax.Array:
    """``[prompts * group]`` keys: completion ``j`` of prompt ``i`` at ``step`` draws from
    ``fold_in(fold_in(fold_in(key, step), i), j)``."""
    step_key = jax.random.fold_in(key, step)
    per_prompt = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(jnp.arange(prompts))
    fold = lambda prompt_key: jax.vmap(lambda j: jax.random.fold_in(prompt_key, j))(
        jnp.arange(group))
    return jax.vmap(fold)(per_prompt).reshape(-1)


def rows_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """The sharding of a rollout batch's leaves on ``mesh``: rows split over its batch axes, as
    a training batch's examples (``sharding.batch_placement``)."""
    split = math.prod(mesh.shape[axis] for axis in BATCH_AXES)
    if rows % split:
        raise SampleError(f"{rows} rollouts (prompts x group) do not split over data x fsdp x "
                          f"expert = {split} devices; give a number of prompts times group that "
                          f"is a multiple of {split}")
    return NamedSharding(mesh, P(BATCH_AXES))


def draw_rollouts(cfg: TransformerModel, params: PyTree, prompts: Sequence[np.ndarray],
                  key: jax.Array, step: int, settings: RolloutSettings,
                  mesh: Mesh | None = None, width: int | None = None,
                  old_logps: bool = True) -> Rollouts:
    """``settings.group`` completions of each of ``prompts`` (1-D token ids) drawn from
    ``params`` at ``step``, from ``rollout_keys(key, step, ...)``: the completions
    ``decode.generate_batch`` draws from those keys, with the old log-probabilities of their
    tokens (``completion_logps``). On ``mesh`` the rows are split over its batch axes.
    width: the prompts' padded width (None: the longest prompt's); a fixed one keeps every
    batch's shapes, so the programs compile once. old_logps: False leaves them 0 and skips
    their forward pass, for a loss that never reads them (one update a batch: the ratio is 1)."""
    contexts = _contexts(cfg, prompts, settings)
    rows, longest = len(contexts), max(c.size for c in contexts)
    if width is not None and width < longest:
        raise SampleError(f"a prompt of {longest} tokens is wider than the rollouts' {width}")
    width = longest if width is None else width
    ids, start = left_padded(contexts, width)
    # the key as this host holds it (a run's key spans its processes): the keys made here
    impl = jax.random.key_impl(key)
    keys = rollout_keys(jax.random.wrap_key_data(jnp.asarray(on_host(jax.random.key_data(key))),
                                                 impl=impl),
                        step, len(prompts), settings.group)
    place = _placer(mesh, rows)
    placed_keys = jax.random.wrap_key_data(place(np.asarray(jax.random.key_data(keys))),
                                           impl=impl)
    # Frozen sections hash at run time; pyright reads frozen only from class keywords.
    program = decoder(cfg, rows, width, settings.tokens, settings.compute,  # pyright: ignore[reportArgumentType]
                      bool(np.any(start)), head_as_trained, settings.temperature > 0,
                      nucleus=settings.top_p < 1, own_keys=True)
    top_p = (np.float32(settings.top_p),) if settings.top_p < 1 else ()
    drawn, counts = program(params, place(ids), place(start), np.float32(settings.temperature),
                            placed_keys, stop_array(settings.stop_ids), *top_p)
    drawn, counts = on_host(drawn), on_host(counts)
    if settings.stop_strings is not None:
        counts = np.asarray([settings.stop_strings.tokens_kept(drawn[row, :counts[row]])
                             for row in range(rows)], np.int32)
    mask = np.arange(settings.tokens)[None] < counts[:, None]
    tokens = np.concatenate([ids, np.where(mask, drawn, 0)], axis=1)
    tokens, start, mask = place(tokens), place(start), place(mask)
    old = (completion_logps(cfg, params, tokens, start, mask, settings.compute,
                            settings.group) if old_logps
           else place(np.zeros(mask.shape, np.float32)))
    return Rollouts(tokens, start, mask, place(counts), old, settings.group)


def _contexts(cfg: TransformerModel, prompts: Sequence[np.ndarray],
              settings: RolloutSettings) -> list[np.ndarray]:
    """Each prompt ``settings.group`` times, as int32 ids; settings and prompts that cannot be
    drawn from are refused in one line."""
    require_settings(settings.tokens, settings.temperature, 0, settings.top_p)
    if settings.group < 1:
        raise SampleError(f"group={settings.group}: give at least 1 completion per prompt")
    if not prompts or any(np.asarray(p).size == 0 for p in prompts):
        raise SampleError("a rollout prompt is empty; give prompts of at least one token")
    longest = max(np.asarray(p).size for p in prompts)
    if longest + settings.tokens > cfg.seq_len:
        raise SampleError(f"a prompt of {longest} tokens and completions of up to "
                          f"{settings.tokens} tokens exceed the model's {cfg.seq_len} positions; "
                          "give shorter prompts or a lower token limit")
    return [np.asarray(p, np.int32) for p in prompts for _ in range(settings.group)]


def _placer(mesh: Mesh | None, rows: int) -> Any:
    """``array -> array`` on the devices: split over ``mesh``'s batch axes (each process puts
    the rows its devices hold of the whole host array, the same in every process), or as it
    is."""
    if mesh is None:
        return lambda array: array
    sharding = rows_sharding(mesh, rows)
    return lambda array: jax.make_array_from_callback(array.shape, sharding,
                                                      lambda index: array[index])


# ---- log-probabilities of completions --------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _logps_program(cfg: TransformerModel, compute: str, group: int) -> Any:
    """The jitted ``(params, tokens, start, mask) -> logps`` of ``completion_logps``."""
    module_of, dtype = bind_transformer(cfg), DTYPES[compute]

    def logps(params: PyTree, tokens: jax.Array, start: jax.Array,
              mask: jax.Array) -> jax.Array:
        module = module_of(cast_floats(params, dtype))
        found, _ = token_logps(module, rollout_rows(module, tokens, start, mask.shape[1], group),
                               chunk=cfg.loss_chunk)
        return jnp.where(mask, found, 0.0)

    return jax.jit(logps)


def completion_logps(cfg: TransformerModel, params: PyTree, tokens: jax.Array,
                     start: jax.Array, mask: jax.Array, compute: str = "float32",
                     group: int = 1) -> jax.Array:
    """``[rows, limit]`` float32: the log-probability of each completion token (``mask``
    ``[rows, limit]``; 0 outside it) under ``params`` in ``compute`` (``token_logps``; rows in
    groups of ``group`` per prompt)."""
    # Frozen sections hash at run time; pyright reads frozen only from class keywords.
    return _logps_program(cfg, compute, group)(params, tokens, start, mask)  # pyright: ignore[reportArgumentType]


def reference_logps(cfg: TransformerModel, params: PyTree, rollouts: Rollouts,
                    compute: str = "float32") -> jax.Array:
    """``[rows, limit]`` float32: each completion token's log-probability under the reference
    model, ``params`` as given (the starting params), or for a model with LoRA adapters those
    params with the adapters off (``adapters_off``: each ``b`` read as zero, the base model's
    function); 0 outside the completion mask."""
    reference = params if cfg.lora is None else adapters_off(params)
    return completion_logps(cfg, reference, rollouts.tokens, rollouts.start,
                            rollouts.completion_mask, compute, rollouts.group)
