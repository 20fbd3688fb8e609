"""GRPO rollouts: the decoder's answers for each completion's own key, drawn again the same,
masked at their stops, with the log-probabilities a forward pass gives; on a mesh, split over
its batch axes."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cli_env

from trainrun.config import LoraConfig, TransformerModel
from trainrun.models import build_model
from trainrun.models.grpo_transformer import Rollouts
from trainrun.models.token_logps import completions_per_row, rollout_rows, token_logps
from trainrun.models.transformer import bind_transformer
from trainrun.program import decode, rollouts
from trainrun.program.decode import SampleError, StopStrings, generate_batch
from trainrun.program.rollouts import (
    RolloutSettings,
    draw_rollouts,
    reference_logps,
    rollout_keys,
)

CFG = TransformerModel(d_model=32, layers=2, heads=4, seq_len=32)
PROMPTS = [np.frombuffer(text, np.uint8) for text in (b"ab", b"import")]
KEY, STEP, G, LIMIT = jax.random.key(3), 7, 3, 8


@pytest.fixture(scope="module")
def params():
    return build_model(CFG).init(jax.random.key(0))


def as_bytes(ids: list[int]) -> str:
    return bytes(ids).decode("latin-1")


@functools.partial(jax.jit, static_argnums=(0, 3))
def forward_logps(cfg: TransformerModel, params, text: jax.Array, limit: int) -> jax.Array:
    """The log-probability of each of the last ``limit`` tokens of ``text`` (one row, no
    padding), from the model's logits over the whole text."""
    text = text.astype(jnp.int32)
    logits = bind_transformer(cfg)(params)(text[None, :-1])[0][0]
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), text[1:, None], axis=-1)[:, 0]
    return picked[-limit:]


def check_rows(drawn: Rollouts, answers: list[np.ndarray]) -> None:
    """Each row of ``drawn`` holds its prompt left-padded, then ``answers``' answer, 0 after it,
    its mask and length those of the answer."""
    tokens, start = np.asarray(drawn.tokens), np.asarray(drawn.start)
    width = tokens.shape[1] - LIMIT
    for row, answer in enumerate(answers):
        prompt = PROMPTS[row // G]
        assert start[row] == width - prompt.size
        assert tokens[row, start[row]:width].tolist() == prompt.tolist()
        assert tokens[row, width:].tolist() == [*answer.tolist(), *[0] * (LIMIT - answer.size)]
        assert np.asarray(drawn.completion_mask)[row].tolist() == [
            i < answer.size for i in range(LIMIT)]
        assert int(drawn.completion_lengths[row]) == answer.size


@pytest.mark.slow
def test_rollouts_are_the_decoders_answers_for_each_completions_key(params):
    drawn = draw_rollouts(CFG, params, PROMPTS, KEY, STEP, RolloutSettings(G, LIMIT))
    keys = rollout_keys(KEY, STEP, len(PROMPTS), G)
    want = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(KEY, STEP), 1), 2)
    assert np.array_equal(jax.random.key_data(keys[5]), jax.random.key_data(want))
    repeated = [p for p in PROMPTS for _ in range(G)]
    answers = generate_batch(CFG, params, repeated, LIMIT, temperature=1.0, keys=list(keys))
    check_rows(drawn, answers)
    assert len({a.tobytes() for a in answers}) == len(answers)  # each completion its own draw
    # the old log-probabilities: a forward pass of each row's own text, unpadded
    for row in range(len(repeated)):
        text = np.asarray(drawn.tokens[row, int(drawn.start[row]):])
        np.testing.assert_allclose(np.asarray(drawn.old_logps[row]),
                                   forward_logps(CFG, params, text, LIMIT), atol=1e-5)


@pytest.mark.slow
def test_a_steps_rollouts_drawn_again_are_the_same_bit_for_bit(params):
    settings = RolloutSettings(G, LIMIT, temperature=0.9, top_p=0.95)
    first = draw_rollouts(CFG, params, PROMPTS, KEY, STEP, settings)
    decode.decoder.cache_clear()  # a fresh program, as a resumed run compiles
    rollouts._logps_program.cache_clear()
    again = draw_rollouts(CFG, params, PROMPTS, jax.random.key(3), STEP, settings)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    later = draw_rollouts(CFG, params, PROMPTS, KEY, STEP + 1, settings)
    assert not np.array_equal(np.asarray(later.tokens), np.asarray(first.tokens))


@pytest.mark.slow
def test_a_completion_ends_at_its_stop_id_or_stop_string_and_nothing_after_counts(params):
    free = draw_rollouts(CFG, params, PROMPTS, KEY, STEP, RolloutSettings(G, LIMIT))
    completions = [np.asarray(c) for c in free.completions]
    stop = int(completions[1][2])  # the third token of the second completion
    stopped = draw_rollouts(CFG, params, PROMPTS, KEY, STEP,
                            RolloutSettings(G, LIMIT, stop_ids=(stop,)))
    ends = [int(np.flatnonzero(c == stop)[0]) + 1 if stop in c else LIMIT for c in completions]
    assert ends[1] <= 3 and min(ends) < LIMIT
    check_rows(stopped, [c[:end] for c, end in zip(completions, ends, strict=True)])
    masked = np.asarray(stopped.completion_mask)
    np.testing.assert_array_equal(np.asarray(stopped.old_logps)[masked],
                                  np.asarray(free.old_logps)[masked])
    assert not np.asarray(stopped.old_logps)[~masked].any()

    text = as_bytes(completions[4].tolist())[3:5]  # two characters the fifth completion holds
    by_text = draw_rollouts(CFG, params, PROMPTS, KEY, STEP,
                            RolloutSettings(G, LIMIT, stop_strings=StopStrings((text,), as_bytes)))
    said = [as_bytes(c.tolist()) for c in completions]
    ends = [s.find(text) + len(text) if text in s else LIMIT for s in said]
    assert ends[4] <= 5
    check_rows(by_text, [c[:end] for c, end in zip(completions, ends, strict=True)])


def test_prompts_and_completions_past_the_context_are_refused(params):
    with pytest.raises(SampleError, match="exceed the model's 32 positions"):
        draw_rollouts(CFG, params, PROMPTS, KEY, STEP, RolloutSettings(G, 27))
    with pytest.raises(SampleError, match="group=0"):
        draw_rollouts(CFG, params, PROMPTS, KEY, STEP, RolloutSettings(0, LIMIT))


def test_reference_logps_are_the_starting_models_and_lora_s_are_the_base_models(params):
    drawn = draw_rollouts(CFG, params, PROMPTS, KEY, STEP, RolloutSettings(G, LIMIT))
    reference = np.asarray(reference_logps(CFG, params, drawn))
    np.testing.assert_array_equal(reference, np.asarray(drawn.old_logps))
    adapted = CFG.model_copy(update={"lora": LoraConfig(rank=4, alpha=8.0)})
    lora_params = build_model(adapted).init(jax.random.key(0))
    # trained adapters: B away from its zero start
    lora_params = jax.tree.map_with_path(
        lambda path, leaf: leaf + 0.5 if jax.tree_util.keystr(path).endswith("['b']") else leaf,
        lora_params)
    base = np.asarray(reference_logps(adapted, lora_params, drawn))
    on = np.asarray(rollouts.completion_logps(adapted, lora_params, drawn.tokens, drawn.start,
                                              drawn.completion_mask))
    for row in range(drawn.tokens.shape[0]):
        text = np.asarray(drawn.tokens[row, int(drawn.start[row]):])
        # the base model built on its own from the same key: the params under the adapters
        np.testing.assert_allclose(base[row], forward_logps(CFG, params, text, LIMIT),
                                   atol=1e-5)
    assert np.abs(on - base).max() > 1e-2  # the adapters on change them


SHARDED = textwrap.dedent("""
    import json
    import jax, numpy as np
    from trainrun.config import MeshConfig, TransformerModel
    from trainrun.models import build_model
    from trainrun.program import rollouts
    from trainrun.program.rollouts import RolloutSettings, draw_rollouts
    from trainrun.program.sharding import build_mesh

    decoded = []  # what each device holds of the decoder's drawn ids: the program's own split
    made = rollouts.decoder

    def recording(*args, **kwargs):
        program = made(*args, **kwargs)

        def run(*operands):
            drawn, counts = program(*operands)
            decoded.append([list(s.data.shape) for s in drawn.addressable_shards])
            return drawn, counts
        return run

    rollouts.decoder = recording

    cfg = TransformerModel(d_model=32, layers=2, heads=4, seq_len=32)
    params = build_model(cfg).init(jax.random.key(0))
    prompts = [np.frombuffer(t, np.uint8) for t in (b"ab", b"import")]
    settings = RolloutSettings(3, 8, stop_ids=(10,))
    mesh = build_mesh(MeshConfig())
    on_mesh = draw_rollouts(cfg, params, prompts, jax.random.key(3), 7, settings, mesh)
    alone = draw_rollouts(cfg, params, prompts, jax.random.key(3), 7, settings)
    print(json.dumps({
        "devices": len(jax.devices()), "mesh": dict(mesh.shape), "decoded": decoded[0],
        "shards": {name: [list(s.data.shape) for s in leaf.addressable_shards]
                   for name, leaf in vars(on_mesh).items() if name != "group"},
        "same_tokens": bool(np.array_equal(on_mesh.tokens, alone.tokens)),
        "same_mask": bool(np.array_equal(on_mesh.completion_mask, alone.completion_mask)),
        "logps_gap": float(np.abs(np.asarray(on_mesh.old_logps)
                                  - np.asarray(alone.old_logps)).max())}))
""")


@pytest.mark.slow
def test_rollouts_on_two_devices_are_split_over_the_data_axis_and_the_same():
    done = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True,
                          timeout=600, env=cli_env(2))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2 and out["mesh"]["data"] == 2
    assert out["decoded"] == [[3, 8], [3, 8]]  # the decoder draws 3 rows on each device
    assert out["shards"]["tokens"] == [[3, 14], [3, 14]]  # 6 rows, 3 on each device
    assert out["shards"]["old_logps"] == [[3, 8], [3, 8]]
    assert out["shards"]["completion_lengths"] == [[3], [3]]
    assert out["same_tokens"] and out["same_mask"]
    assert out["logps_gap"] < 1e-5


def test_the_logps_of_a_model_with_capped_logits_are_those_of_its_capped_logits(params):
    """A soft-capped output head (Gemma 2's) gives the rollouts' log-probabilities through its
    cap, as its forward pass does."""
    capped = CFG.model_copy(update={"final_logit_softcap": 0.01})
    text = np.frombuffer(b"import jax", np.uint8).astype(np.int32)
    def scored(p: Any, t: jax.Array) -> jax.Array:
        module = bind_transformer(capped)(p)
        return token_logps(module, rollout_rows(module, t, jnp.zeros(1, jnp.int32), 4))[0]

    got = jax.jit(scored)(params, text[None])
    want = forward_logps(capped, params, text, 4)
    assert not np.allclose(want, forward_logps(CFG, params, text, 4), atol=1e-4)
    np.testing.assert_allclose(got[0], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("window", [None, 5])  # 5: fewer positions than a prompt and answer
def test_a_prompts_completions_share_a_row_and_score_as_each_alone(params, window):
    """rollout_rows puts a prompt's completions in one row of the forward pass (the prompt once)
    where that costs less, with the log-probabilities and entropies of each row alone."""
    cfg = CFG.model_copy(update={"sliding_window": window})
    module = bind_transformer(cfg)(params)
    drawn = draw_rollouts(cfg, params, PROMPTS, KEY, STEP, RolloutSettings(G, LIMIT))
    rows, width = drawn.tokens.shape[0], drawn.tokens.shape[1] - LIMIT
    assert completions_per_row(module, rows, G, width, LIMIT) == G
    shared = jax.jit(lambda m, tokens, start, group: token_logps(
        m, rollout_rows(m, tokens, start, LIMIT, group)), static_argnums=(3,))
    apart = shared(module, drawn.tokens, drawn.start, 1)
    together = shared(module, drawn.tokens, drawn.start, G)
    for one, other in zip(apart, together, strict=True):
        np.testing.assert_allclose(other, one, rtol=0, atol=1e-5)
    for row in range(rows):  # and those of the text alone, no padding
        text = np.asarray(drawn.tokens[row, int(drawn.start[row]):])
        np.testing.assert_allclose(together[0][row], forward_logps(cfg, params, text, LIMIT),
                                   atol=1e-5)
