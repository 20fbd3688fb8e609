"""The decoder's sampling controls: the nucleus (top-p), each row's own keys, stop strings."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.config import TransformerModel
from trainrun.models import build_model
from trainrun.program.decode import (
    SampleError,
    StopStrings,
    decoder,
    generate_batch,
    nucleus_logits,
)

CFG = TransformerModel(d_model=32, layers=2, heads=4, seq_len=32)
PROMPTS = [np.frombuffer(text, np.uint8) for text in (b"ab", b"import", b"x = 1\n")]


@pytest.fixture(scope="module")
def params():
    return build_model(CFG).init(jax.random.key(0))


def as_bytes(ids: list[int]) -> str:
    """Byte ids as text, one character each."""
    return bytes(ids).decode("latin-1")


def test_the_nucleus_is_the_fewest_most_likely_tokens_that_reach_top_p():
    logits = jnp.log(jnp.asarray([[0.05, 0.5, 0.15, 0.3]]))
    kept = lambda top_p: np.flatnonzero(np.isfinite(np.asarray(nucleus_logits(logits, top_p))[0]))
    assert kept(0.8).tolist() == [1, 3]  # 0.5 + 0.3 reach 0.8
    assert kept(0.81).tolist() == [1, 2, 3]
    assert kept(1e-6).tolist() == [1]  # the most likely always
    assert kept(1.0).tolist() == [0, 1, 2, 3]
    kept_logits = np.asarray(nucleus_logits(logits, 0.8))[0]
    np.testing.assert_array_equal(kept_logits[[1, 3]], np.asarray(logits)[0, [1, 3]])


def test_top_p_one_decodes_with_no_nucleus_in_the_program(params):
    """Off (1), the program is today's: no sort over the vocabulary; on, it sorts."""
    args = (params, jnp.zeros((2, 4), jnp.int32), jnp.zeros(2, jnp.int32), jnp.float32(1.0),
            jax.random.key(0), jnp.array([-1], jnp.int32))
    plain = str(jax.make_jaxpr(decoder(CFG, 2, 4, 6))(*args))
    nucleus = str(jax.make_jaxpr(decoder(CFG, 2, 4, 6, nucleus=True))(*args, jnp.float32(0.9)))
    sorts = lambda jaxpr: re.findall(r"\bsort\[", jaxpr)
    assert not sorts(plain) and sorts(nucleus)


@pytest.mark.slow
def test_a_small_nucleus_samples_the_most_likely_token(params):
    greedy = generate_batch(CFG, params, PROMPTS, 8, temperature=0.0)
    for seed in (1, 2):
        narrow = generate_batch(CFG, params, PROMPTS, 8, temperature=1.0, top_p=1e-6, seed=seed)
        assert [a.tolist() for a in narrow] == [g.tolist() for g in greedy]
    wide = generate_batch(CFG, params, PROMPTS, 8, temperature=1.0, top_p=0.9, seed=1)
    assert [a.tolist() for a in wide] != [g.tolist() for g in greedy]  # it samples


@pytest.mark.parametrize("top_p", [0.0, 1.5, float("nan")])
def test_a_top_p_outside_0_to_1_is_refused(params, top_p):
    with pytest.raises(SampleError, match="top_p"):
        generate_batch(CFG, params, PROMPTS, 4, top_p=top_p)


@pytest.mark.slow
def test_an_answer_from_its_own_key_is_the_same_whatever_rows_are_beside_it(params):
    keys = [jax.random.key(k) for k in (5, 6, 7)]
    together = generate_batch(CFG, params, PROMPTS, 8, temperature=1.0, keys=keys)
    # the two prompts of one length, each alone: one more program
    alone = [generate_batch(CFG, params, [PROMPTS[i]], 8, temperature=1.0, keys=[keys[i]])[0]
             for i in (1, 2)]
    assert [a.tolist() for a in together[1:]] == [a.tolist() for a in alone]
    other = generate_batch(CFG, params, [PROMPTS[1]], 8, temperature=1.0, keys=[keys[0]])[0]
    assert other.tolist() != alone[0].tolist()  # another key, another draw
    with pytest.raises(SampleError, match="one key per prompt"):
        generate_batch(CFG, params, PROMPTS, 4, keys=keys[:2])


@pytest.mark.slow
def test_an_answer_ends_with_the_token_that_completes_a_stop_string(params):
    full = generate_batch(CFG, params, PROMPTS, 16, temperature=0.0)
    text = as_bytes(full[1].tolist())
    stop = text[4:6]  # a string the second answer holds, ending at its 6th token
    stops = StopStrings((stop,), as_bytes)
    cut = generate_batch(CFG, params, PROMPTS, 16, temperature=0.0, stop_strings=stops)
    for answer, whole in zip(cut, full, strict=True):
        said = as_bytes(whole.tolist())
        ends = said.find(stop) + len(stop) if stop in said else whole.size
        assert answer.tolist() == whole[:ends].tolist()
    assert cut[1].size <= 6 and stops.cut(as_bytes(cut[1].tolist())) == text[:text.find(stop)]


def test_the_stop_string_that_ends_first_stops_and_multi_character_tokens_are_kept_whole():
    pieces = {0: "ab", 1: "cd", 2: "e", 3: "fg"}
    stops = StopStrings(("abcde", "bc", "zz"), lambda ids: "".join(pieces[i] for i in ids))
    ids = np.array([0, 1, 2, 3])
    assert stops.tokens_kept(ids) == 2  # "bc" ends in "cd", before "abcde" ends
    assert stops.cut("abcdefg") == "a"
    assert stops.tokens_kept(np.array([2, 3])) == 2  # none: every token
    assert stops.cut("efg") == "efg"
    with pytest.raises(SampleError, match="empty"):
        StopStrings(("",), str)


def test_a_sampled_token_is_jax_random_categoricals_draw() -> None:
    from trainrun.program.decode import categorical

    logits = jax.random.normal(jax.random.key(1), (16, 264)) * 3
    keys = jax.random.split(jax.random.key(2), 200)
    ours = jax.jit(jax.vmap(categorical, (0, None)))(keys, logits)
    theirs = jax.jit(jax.vmap(jax.random.categorical, (0, None)))(keys, logits)
    np.testing.assert_array_equal(ours, theirs)
    assert len(np.unique(np.asarray(ours))) > 100  # draws, not one token
