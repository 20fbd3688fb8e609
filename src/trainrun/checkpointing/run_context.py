"""The context a trained model generates within: the one its architecture gives (the
``max_position_embeddings`` of the Hugging Face model a run started from, or what its positions
allow), or a shorter one asked for; never its training rows' length."""

from __future__ import annotations

from typing import Any

from trainrun.config import RunConfig, TransformerModel
from trainrun.errors import UserError
from trainrun.storage.location import Location

PyTree = Any


class ContextRefused(UserError):
    """A context the model cannot read: one line, exit 2 at the CLI."""


# A rotary run's context where no init.from source gives one: its positions allow any length,
# and lm-evaluation-harness's hf model reads this many where a model names none.
ROPE_CONTEXT = 2048


def run_model(config: RunConfig, context: int | None = None, *,
              named: str = "the run") -> TransformerModel:
    """The transformer of a run (its ``config``; the run is ``named`` so in a refusal) with
    the context it generates within as ``seq_len``: ``context`` where given, else the
    architecture's. Learned positions read their table (the run's ``model.seq_len``) and no
    further. Rotary ones read the ``max_position_embeddings`` of the Hugging Face model the
    run started from (``init.from``, through runs started from runs and adapter directories),
    and no further; without one they allow any length, ``ROPE_CONTEXT`` by default (or the
    run's longer ``seq_len``); where the source can no longer be read, the run's ``seq_len``
    by default. A ``context`` past what the architecture allows is refused in one line."""
    require_context(context)
    model = config.model
    assert isinstance(model, TransformerModel)
    if model.positions == "learned":
        limit, default = model.seq_len, model.seq_len
        why = f"a table of {limit} learned positions"
    else:
        found = source_positions(config)
        if found is None:
            limit, default, why = None, model.seq_len, ""
        elif found[0]:
            limit, default = found[0], found[0]
            why = f"the max_position_embeddings of {found[1]}, its init.from"
        else:
            limit, default, why = None, max(model.seq_len, ROPE_CONTEXT), ""
    if context is not None and limit is not None and context > limit:
        raise ContextRefused(f"context={context}: the model of {named} reads at most {limit} "
                        f"positions ({why}); give at most {limit}")
    return model.model_copy(update={"seq_len": context or default})


def trained(run: Location, config: RunConfig, context: int | None = None, *,
            ema: bool = False) -> tuple[TransformerModel, int, PyTree]:
    """A language-model run's transformer within ``context`` (``run_model``), and the step and
    params (with ``ema``: their moving average) of its newest readable checkpoint as that model
    holds them (``within``); the optimizer's state is left unread."""
    from trainrun.checkpointing.reader import latest_state

    model = run_model(config, context, named=str(run))
    step, state = latest_state(run, config, optimizer_state=False)
    return model, step, within(model, state.ema if ema else state.params)


def require_context(context: int | None) -> None:
    """A ``context`` that is no number of positions above 1, refused in one line."""
    if context is not None and (type(context) is not int or context < 2):
        raise ContextRefused(f"context={context!r}: give a number of positions above 1")


def within(model: TransformerModel, params: PyTree) -> PyTree:
    """``params`` as ``model`` (``run_model``'s) holds them: a learned position table cut to
    its context, which its first rows are."""
    if model.positions != "learned" or params["positions"].shape[0] == model.seq_len:
        return params
    return {**params, "positions": params["positions"][:model.seq_len]}


def source_positions(config: RunConfig) -> tuple[int, str] | None:
    """The ``max_position_embeddings`` (0: none given) of the Hugging Face model a run
    started from, and that model's directory, followed through ``init.from`` runs and adapter
    directories; ``(0, "")`` for a run that started from none, and None where a source on the
    way can no longer be read."""
    from trainrun.checkpointing.init_from import _adapter_base, source_kind, source_location
    from trainrun.checkpointing.reader import saved_config
    from trainrun.models.huggingface import architecture, read_config

    seen: set[str] = set()
    while config.init.from_ is not None and config.init.from_ not in seen:
        seen.add(config.init.from_)
        path = source_location(config.init.from_)
        try:
            kind = source_kind(path)
            if kind == "run":
                config = saved_config(path)
                continue
            if kind not in ("huggingface", "adapter"):
                return 0, ""  # lone weights: no config gives a context
            base = _adapter_base(path) if kind == "adapter" else path
            return architecture(read_config(base)).max_positions, str(base)
        except UserError:
            return None
    return 0, ""
