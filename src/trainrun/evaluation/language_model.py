"""``trainrun.load(path)``: a trained language model to call from Python, whichever form it is
in: a trainrun run directory (its newest readable checkpoint), a Hugging Face model directory
(of a ``model_type`` in ``models.huggingface.MODEL_TYPES``), or a PEFT adapter directory on
such a base, as ``trainrun export`` writes them. The result gives logits for a batch of token
ids and generates from a prompt with the run's key/value-cache decoder."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrun import rundir
from trainrun.checkpointing.run_context import require_context, trained
from trainrun.config import TransformerModel
from trainrun.errors import UserError, path_refused
from trainrun.program.precision import DTYPES, cast_floats
from trainrun.storage import location
from trainrun.storage.location import Location

PyTree = Any


class LoadError(UserError):
    """A path that holds no model ``load`` reads; one line, exit 2 at the CLI."""


@dataclasses.dataclass(frozen=True)
class LanguageModel:
    """A transformer and its params, on this process's first device.

    config: the architecture (``trainrun.config.TransformerModel``); its ``seq_len`` is the
        context the model reads and generates within.
    params: the params as a nested dict of arrays (LoRA adapters included, not merged).
    compute: the dtype the model runs in (a run's ``precision.compute``; float32 otherwise).
    step: the checkpoint's step for a run directory, else None.
    """

    config: TransformerModel
    params: PyTree
    compute: str = "float32"
    step: int | None = None

    def logits(self, tokens: Any) -> np.ndarray:
        """float32 logits ``[batch, seq, vocab]`` of token ids ``[batch, seq]`` (or ``[seq]``:
        then ``[seq, vocab]``)."""
        ids = np.asarray(tokens)
        single = ids.ndim == 1
        ids = ids[None] if single else ids
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise LoadError(f"tokens: give integer ids [batch, seq], not an array of shape "
                            f"{ids.shape} and dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab):
            raise LoadError(f"tokens: ids run from {ids.min()} to {ids.max()}; the model's "
                            f"vocabulary is 0..{self.config.vocab - 1}")
        if self.config.positions == "learned" and ids.shape[1] > self.config.seq_len:
            raise LoadError(f"tokens: {ids.shape[1]} positions, more than the model's "
                            f"{self.config.seq_len} learned ones")
        # Frozen sections hash at run time; pyright reads frozen only from class keywords.
        forward = _forward(self.config, self.compute)  # pyright: ignore[reportArgumentType]
        out = np.asarray(forward(self.params, jnp.asarray(ids)))
        return out[0] if single else out

    __call__ = logits

    def generate(self, prompt: Sequence[int] | np.ndarray, tokens: int, *,
                 temperature: float = 0.0, seed: int = 0) -> np.ndarray:
        """``prompt`` (token ids) followed by ``tokens`` generated ones (``temperature`` 0:
        the most likely token each time), or fewer where the model's context
        (``config.seq_len``) ends first: then a ``ContextWarning`` says so."""
        from trainrun.fast import strategies
        from trainrun.program.decode import generate

        return generate(self.config, self.params, np.asarray(prompt, np.int32), tokens,
                        temperature=temperature, seed=seed, compute=self.compute,
                        head=strategies.chosen().decode_head())

    def generate_batch(self, prompts: Sequence[Sequence[int] | np.ndarray], tokens: int, *,
                       temperature: float = 0.0, seed: int = 0, stop_ids: Sequence[int] = (),
                       batch_size: int = 16) -> list[np.ndarray]:
        """What the model generates after each of ``prompts`` (token ids, any lengths):
        ``tokens`` ids, or fewer, up to and including the first of ``stop_ids`` or up to the
        end of the model's context (a ``ContextWarning`` says so). Prompts are decoded
        ``batch_size`` at a time with one compiled program."""
        from trainrun.fast import strategies
        from trainrun.program.decode import generate_batch

        return generate_batch(self.config, self.params,
                              [np.asarray(p, np.int32) for p in prompts], tokens,
                              temperature=temperature, seed=seed, compute=self.compute,
                              stop_ids=stop_ids, batch_size=batch_size,
                              head=strategies.chosen().decode_head())


@functools.lru_cache(maxsize=8)
def _forward(cfg: TransformerModel, compute: str) -> Callable[..., jax.Array]:
    from trainrun.models.transformer import bind_transformer

    module_of = bind_transformer(cfg)

    def logits(params: PyTree, tokens: jax.Array) -> jax.Array:
        return module_of(cast_floats(params, DTYPES[compute]))(tokens)[0]

    return jax.jit(logits)


def load(path: str | Path, *, ema: bool = False, context: int | None = None) -> LanguageModel:
    """The model at ``path``: a run directory, a Hugging Face model directory or a PEFT adapter
    directory (with its base model where ``base_model_name_or_path`` says); a run directory
    may be on object storage (``gs://bucket/runs/lm``, ``s3://...``). ``ema``: a run's moving
    average of the params instead of the params. ``context``: the longest text the model
    reads and generates within (its ``config.seq_len``), at most what the architecture
    allows; default: a Hugging Face or adapter directory's ``max_position_embeddings``, and
    for a run what ``run_model`` gives (the ``init.from`` source's, not the training rows'
    length)."""
    from trainrun.platform.process import require_backend

    require_backend()  # one line, not JAX's assertion, when JAX cannot start
    require_context(context)
    where = location.location(path)  # where the path enters: asked nothing again below
    folder = where.local_path
    if folder is None:
        if not (where / rundir.CONFIG).is_file():
            where.require_bucket()
            raise LoadError(f"{where} holds no trainrun run (no {rundir.CONFIG}); on object "
                            "storage trainrun.load reads run directories: give one, or the "
                            "local path of a Hugging Face or adapter directory")
        return _load_run(where, ema, context)
    try:
        folder.stat()
    except OSError as err:
        line, code = path_refused(err)
        if code == 2:  # a path no file system holds: said in one line
            raise LoadError(line) from None
    if (where / rundir.CONFIG).is_file():
        return _load_run(where, ema, context)
    if ema:
        raise LoadError(f"{where} is not a run directory: only a run keeps a moving average")
    from trainrun.checkpointing.init_from import model_of, placed_params, readers, source_kind
    from trainrun.models import build_model

    kind = source_kind(where, what="trainrun.load")
    if kind not in ("huggingface", "adapter"):
        raise LoadError(f"{where} is a lone weights file: load its model directory (with "
                        "config.json), a run directory or an adapter directory")
    cfg = model_of(where, seq_len=context, full_context=True, seq_len_key="context")
    from trainrun.training.preflight import check_model_memory

    # the params go whole onto the first device: refused there before a layer is built
    check_model_memory(cfg, jax.local_devices()[:1], "float32", f"the model of {where}")
    model = build_model(cfg)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    params = placed_params(readers(str(where), cfg, abstract), 0, abstract, None)
    return LanguageModel(cfg, params)


def _load_run(path: Location, ema: bool, context: int | None) -> LanguageModel:
    """A run directory's model at its newest readable checkpoint (local or on object storage,
    where only run directories are read), within ``context`` (``run_model``)."""
    from trainrun.checkpointing.reader import saved_config

    config = saved_config(path)
    if not isinstance(config.model, TransformerModel):
        raise LoadError(f"{path} trains model.kind={config.model.kind}; load reads "
                        "transformer language models")
    if ema and config.optimizer.ema is None:
        raise LoadError(f"{path} keeps no moving average (optimizer.ema is not set); "
                        "load it without ema")
    model, step, params = trained(path, config, context, ema=ema)
    return LanguageModel(model, params, config.precision.compute, step)
