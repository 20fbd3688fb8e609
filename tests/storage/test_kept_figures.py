"""A figure derived from a compiled program is kept beside the programs and read back by a later
process instead of derived again: the FLOPs of one training step, which otherwise trace and
lower the step a second time. Kept only where the process keeps its programs; a garbled or
linked file is derived again; another program is another figure."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from trainrun.platform import process
from trainrun.program import flops
from trainrun.storage import kept_figures


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """This process keeps its programs in ``tmp_path / "compiled"``."""
    folder = tmp_path / "compiled"
    folder.mkdir()
    monkeypatch.setattr(process, "_kept", process._Kept(folder))
    return folder


def step(state, batch):
    return state @ batch["x"], {}


def never_traced(state, batch):
    raise AssertionError("the step was traced: its count should have been read back")


STATE = jnp.ones((8, 8))
BATCH = {"x": jnp.ones((2, 8, 8))}  # two steps' batches, stacked
TEXTS = [b"the K-step program"]


def test_a_second_count_of_the_same_programs_is_read_back_without_tracing(kept):
    counted = flops.step_flops({2: None}, step, STATE, BATCH, TEXTS)
    assert counted == 2 * 8 * 8 * 8  # one 8x8 matmul, one step's slice of the batch
    files = list((kept / kept_figures.FIGURES).glob("step-flops-*.json"))
    assert [json.loads(f.read_text()) for f in files] == [{"figure": counted}]
    assert flops.step_flops({2: None}, never_traced, STATE, BATCH, TEXTS) == counted


def test_other_programs_or_shapes_are_counted_anew(kept):
    counted = flops.step_flops({2: None}, step, STATE, BATCH, TEXTS)
    with pytest.raises(AssertionError, match="was traced"):
        flops.step_flops({2: None}, never_traced, STATE, BATCH, [b"another program"])
    wider = {"x": jnp.ones((2, 8, 16))}
    assert flops.step_flops({2: None}, step, STATE, wider, TEXTS) == 2 * counted


def test_nothing_is_kept_or_read_where_the_process_keeps_no_programs(tmp_path, monkeypatch):
    monkeypatch.setattr(process, "_kept", process._Kept(None))
    flops.step_flops({2: None}, step, STATE, BATCH, TEXTS)
    with pytest.raises(AssertionError, match="was traced"):
        flops.step_flops({2: None}, never_traced, STATE, BATCH, TEXTS)
    assert not list(tmp_path.rglob("*.json"))


@pytest.mark.parametrize("garbled", ["{\"figure\": ", "[1]", "{\"figure\": \"many\"}",
                                     "{\"figure\": NaN}", "{\"figure\": true}"])
def test_a_garbled_figure_is_derived_again_and_written_anew(kept, garbled):
    counted = flops.step_flops({2: None}, step, STATE, BATCH, TEXTS)
    (path,) = (kept / kept_figures.FIGURES).glob("*.json")
    path.write_text(garbled)
    assert flops.step_flops({2: None}, step, STATE, BATCH, TEXTS) == counted
    assert json.loads(path.read_text()) == {"figure": counted}


def test_a_figure_file_that_is_a_link_is_neither_read_nor_followed(kept, tmp_path):
    counted = flops.step_flops({2: None}, step, STATE, BATCH, TEXTS)
    (path,) = (kept / kept_figures.FIGURES).glob("*.json")
    theirs = tmp_path / "theirs.json"
    theirs.write_text('{"figure": 1.0}')
    path.unlink()
    path.symlink_to(theirs)
    assert flops.step_flops({2: None}, step, STATE, BATCH, TEXTS) == counted
    assert theirs.read_text() == '{"figure": 1.0}' and not path.is_symlink()


def test_a_step_with_no_count_is_kept_as_none(kept, monkeypatch):
    monkeypatch.setattr(flops, "xla_flops", lambda stage: None)
    assert flops.step_flops({2: None}, step, STATE, BATCH, TEXTS) is None
    assert flops.step_flops({2: None}, never_traced, STATE, BATCH, TEXTS) is None


def test_the_key_holds_the_program_and_the_jax_version(monkeypatch):
    key = kept_figures.figure_key("step-flops", b"a program")
    assert key.startswith("step-flops-") and key != kept_figures.figure_key("step-flops", b"b")
    assert key == kept_figures.figure_key("step-flops", b"a program")
    monkeypatch.setattr(jax, "__version__", jax.__version__ + ".other")
    assert key != kept_figures.figure_key("step-flops", b"a program")


def test_a_programs_text_leaves_out_where_it_was_traced_from():
    """The same program traced from other lines (another entry point: a script, a notebook, a
    profiler) is kept under the same key."""
    made: list[object] = []
    for blank_lines in (0, 5):
        scope: dict[str, object] = {"jnp": jnp}
        exec("\n" * blank_lines + "def f(x):\n    return jnp.sin(x) * 2\n", scope)
        made.append(jax.jit(scope["f"]).lower(STATE))
    first, second = made
    assert first.as_text(debug_info=True) != second.as_text(debug_info=True)
    assert flops.program_text(first) == flops.program_text(second)
