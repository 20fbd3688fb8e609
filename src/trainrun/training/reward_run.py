"""What a reward run (a config with a ``reward_model`` section) trains on and with: its config
with the pad token the score is read past, its model, and its batches, for the set-up to call.

- ``with_pad_id``: ``model.pad_id`` where the config gives none, TRL's choice: the tokenizer's
  pad token, else its end of text. The score is read at each sequence's last token that is not
  the pad token, as transformers' ``...ForSequenceClassification`` reads it, so a trained model
  exports with that ``pad_token_id`` and scores alike there.
- ``reward_data``: the pair rows (``data/preference_rows.py``, with each record's ``margin``
  where ``reward_model.margin``), batched as a preference run's: ``data.batch_size`` rows a
  batch, each row holding as many whole pairs as fit; the held-out rows for evaluation.

The held-out evaluation is the ``Evaluator`` of ``training/evaluation.py`` over ``reward_data``'s
held-out rows: the model's ``eval_loss`` gives the loss and TRL's metrics, ``accuracy`` among
them, each a mean over every held-out pair.
"""

from __future__ import annotations

from trainrun.config import RecordsData, RunConfig, TransformerModel
from trainrun.config.sections import RewardModelConfig
from trainrun.data import model_tokenizer
from trainrun.training.preference_data import (
    PreferenceData,
    batch_line,
    pair_batches,
    read_pairs,
)


def reward_pad_id(tokenizer: model_tokenizer.ModelTokenizer) -> int | None:
    """The id TRL pads a reward model's batches with: the tokenizer's pad token, else its end
    of text (None: it has neither)."""
    pad = tokenizer.special.get("pad_token")
    found = tokenizer.tokenizer.token_to_id(pad) if pad else None
    return found if found is not None else tokenizer.eos_id


def with_pad_id(config: RunConfig) -> RunConfig:
    """``config`` with ``model.pad_id`` set to the records' tokenizer's ``reward_pad_id`` where
    it gives none; as it is where it does, or where the tokenizer has no such token."""
    model, data = config.model, config.data
    if (config.kind != "reward" or not isinstance(model, TransformerModel)
            or model.pad_id is not None or not isinstance(data, RecordsData)):
        return config
    pad = reward_pad_id(model_tokenizer.of_records(data))
    if pad is None or pad >= model.vocab:
        return config
    return config.model_copy(update={"model": model.model_copy(update={"pad_id": pad})})


def reward_data(config: RunConfig, rows: tuple[int, int]) -> PreferenceData:
    """The run's training batches (this process's ``rows``: its index and the count) and its
    held-out rows."""
    section, data = config.tuning(RewardModelConfig), config.data
    assert isinstance(data, RecordsData)
    train, held, files, counts, notices = read_pairs(
        data, "reward_model", section.max_prompt, section.max_completion, section.margin)
    assert train.train is not None  # preference_rows refuses a source without
    batches = pair_batches(train.train, data.batch_size, shuffle=data.shuffle, seed=config.seed,
                           process_index=rows[0], process_count=rows[1])
    return PreferenceData(
        train=batches, eval=held.eval if held is not None else train.eval, counts=counts,
        files=files, notices=notices,
        batch_holds=batch_line(data.batch_size, train.counts.examples, batches.num_examples))
