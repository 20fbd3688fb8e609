"""The memory preflight on an accelerator (a chip whose allocator reports its limit and what is in
use, as a TPU's does): a step program that does not fit is refused in one line naming the
largest batch size that does, by XLA's own count; and, once the state is placed, memory that
something else holds counts while the state itself is not counted twice."""

from __future__ import annotations

import re
import types
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from trainrun.errors import UserError
from trainrun.training import preflight

WIDTH = 256
MULTIPLE = 8


class Chip:
    """An accelerator as the preflight sees one: its allocator's limit and bytes in use."""

    platform = "tpu"

    def __init__(self, limit: int, in_use: int = 0):
        self.limit, self.in_use = limit, in_use

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_limit": self.limit, "bytes_in_use": self.in_use}

    def __str__(self) -> str:
        return "TPU_0(process=0,(0,0,0,0))"


def program(batch: int, hidden: int = WIDTH) -> jax.stages.Compiled:
    """A gradient whose intermediates grow with the batch, compiled (on the CPU) for ``batch``
    rows: a step program's shape in small (its intermediates the larger part for a ``hidden``
    wider than its input)."""

    def loss(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    return jax.jit(jax.grad(loss)).lower(
        jax.ShapeDtypeStruct((WIDTH, hidden), jnp.float32),
        jax.ShapeDtypeStruct((batch, WIDTH), jnp.float32)).compile()


def need(batch: int, hidden: int = WIDTH) -> int:
    memory = preflight.program_memory(program(batch, hidden), [Chip(2**40)])
    assert memory is not None
    return memory.need


def test_a_program_over_the_chips_memory_names_the_largest_batch_that_fits():
    """Before, the line said to lower data.batch_size, without saying to what."""
    size = 4096
    chip = Chip(limit=need(size) // 2 + 2**20, in_use=2**20)
    resize = preflight.Resize(size, MULTIPLE, program)
    with pytest.raises(UserError) as refused:
        preflight.check_program_memory(program(size), [chip], 1, resize=resize)
    line = str(refused.value)
    assert "\n" not in line and "of TPU_0(process=0,(0,0,0,0)) (state and batches" in line
    found = re.search(r"data\.batch_size=(\d+) fits by XLA's count \(it is 4096\)", line)
    assert found is not None, line
    fits = int(found.group(1))
    assert fits % MULTIPLE == 0 and 0 < fits < size
    free = chip.limit - chip.in_use
    assert need(fits) <= free < need(fits + MULTIPLE)  # the largest, by XLA's count


def test_no_batch_fits_is_said_so():
    chip = Chip(limit=need(MULTIPLE) // 2)  # not even the smallest batch size
    with pytest.raises(UserError, match=rf"not even data\.batch_size={MULTIPLE} fits; lower "
                                        "steps_per_call"):
        preflight.check_program_memory(program(1024), [chip], 1,
                                       resize=preflight.Resize(1024, MULTIPLE, program))


def test_once_the_state_is_placed_other_holders_count_and_the_state_once():
    """With the state (here the weights, the program's first argument) on the chip, the check
    counts what else is in use: a program that fitted before anything existed is refused when
    another buffer of that size is alive, and not refused for the state's own bytes."""
    size = 1024
    compiled = program(size)
    state = WIDTH * WIDTH * 4
    chip = Chip(limit=need(size) + 2**20)
    preflight.check_program_memory(compiled, [chip], 1)  # fits, nothing placed
    chip.in_use = state  # the state placed: counted once
    preflight.check_program_memory(compiled, [chip], 1, placed={chip: state})
    chip.in_use = state + 2 * 2**20  # and something else holding 2 MiB
    with pytest.raises(UserError, match=r"needs [\d.]+ MiB of TPU_0\S* beyond the state placed "
                                        r"there \(batches of a 1-step call"):
        preflight.check_program_memory(compiled, [chip], 1, placed={chip: state},
                                       resize=preflight.Resize(size, MULTIPLE, program))


def test_placed_bytes_are_each_devices_shards():
    tree = {"w": jnp.ones((WIDTH, WIDTH), jnp.float32), "b": jnp.ones((3,), jnp.bfloat16)}
    assert preflight.placed_bytes(tree) == {jax.devices()[0]: WIDTH * WIDTH * 4 + 3 * 2}


def readable(nbytes: float) -> str:
    """Bytes as XLA's messages write them: two decimals of the largest unit under 1024."""
    for unit in ("", "K", "M", "G"):
        if nbytes < 1024 or unit == "G":
            return f"{nbytes:.2f}{unit}"
        nbytes /= 1024
    raise AssertionError


def compiled_as_a_tpu(chip: Chip, hidden: int = WIDTH, compiles: list[int] | None = None,
                      units: bool = False):
    """``program``, compiled as a TPU's compiler does: refused, with its words, where the
    program's temporaries exceed the chip's memory (its limit: XLA knows nothing of what is in
    use). The figures in GiB (too coarse at these sizes to draw on), or with ``units`` as XLA
    writes bytes; ``compiles`` collects the batch size of every compile."""

    def compile_at(batch: int) -> jax.stages.Compiled:
        if compiles is not None:
            compiles.append(batch)
        compiled = program(batch, hidden)
        stats = compiled.memory_analysis()
        assert stats is not None
        temporaries = stats.temp_size_in_bytes
        if temporaries > chip.limit:
            said = ((readable(temporaries), readable(chip.limit)) if units else
                    (f"{temporaries / 2**30:.2f}G", f"{chip.limit / 2**30:.2f}G"))
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
                f"HLO temporaries ({said[0]}) exceeds available HBM ({said[1]}).\n")
        return compiled

    return compile_at


def refusal(chip: Chip, size: int, hidden: int = WIDTH, compiles: list[int] | None = None,
            units: bool = False) -> str:
    compile_at = compiled_as_a_tpu(chip, hidden, compiles, units)
    with pytest.raises(UserError) as refused:
        preflight.compile_or_refuse(lambda: compile_at(size), [chip], 1,
                                    preflight.Resize(size, MULTIPLE, compile_at))
    line = str(refused.value)
    assert "\n" not in line, line
    assert line.startswith(
        "the compiled training step does not fit TPU_0(process=0,(0,0,0,0)): XLA refused to "
        "compile a 1-step call (RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
        "required for HLO temporaries ("), line
    return line


def named_batch(line: str, size: int) -> int:
    found = re.search(rf"data\.batch_size=(\d+) fits by XLA's count \(it is {size}\)", line)
    assert found is not None, line
    return int(found.group(1))


@pytest.mark.parametrize("hidden, limit, in_use", [
    # 4096 and 2048 rows refused; 1024 compile and fit: the largest found above 1024
    (8 * WIDTH, 14 * 2**20, 0),
    # 4096 refused; 2048 compile, yet do not fit: found below 2048
    (WIDTH, 3 * 2**20, 0),
    (8 * WIDTH, 20 * 2**20, 2**20),  # 2048 compile, yet do not fit beside what is in use
])
def test_a_program_xla_refuses_to_compile_names_the_largest_batch_that_fits(hidden, limit,
                                                                            in_use):
    """A TPU's compiler refuses a program over the chip's memory, so there is no compiled
    program to measure: the run's batch size is halved until its program compiles, and the
    largest batch that fits is found from there. Before, XLA's error went through."""
    size = 4096
    chip = Chip(limit, in_use)
    fits = named_batch(refusal(chip, size, hidden), size)
    assert fits % MULTIPLE == 0 and 0 < fits < size
    free = chip.limit - chip.in_use
    assert need(fits, hidden) <= free < need(fits + MULTIPLE, hidden)  # by XLA's count


@pytest.mark.parametrize("hidden, limit, in_use", [
    (8 * WIDTH, 14 * 2**20, 0),  # the one compile at the figures' size fits
    (8 * WIDTH, 20 * 2**20, 5 * 2**20),  # it compiles, yet does not fit beside the rest
])
def test_a_refusal_that_says_its_figures_takes_one_more_compile(hidden, limit, in_use):
    """Where XLA's refusal says what the temporaries need and what the chip has, in figures
    fine enough to draw a line through, one compile at the size they point to finds the
    largest batch that fits: on a chip each compile of a program that fills it takes most of
    a minute. Before, the size was halved until a program compiled and once more (4 compiles
    here, over 3 minutes on the chip for a byte LM at 2048 rows)."""
    size = 4096
    chip, compiles = Chip(limit, in_use), []
    fits = named_batch(refusal(chip, size, hidden, compiles, units=True), size)
    assert fits % MULTIPLE == 0 and 0 < fits < size
    free = chip.limit - chip.in_use
    # it fits, by XLA's count, and is within an eighth of the largest that does: the line
    # grows by the temporaries a row, here less the batch's own input of each row
    larger = fits + fits // 8
    assert need(fits, hidden) <= free < need(larger - larger % MULTIPLE, hidden)
    assert compiles[0] == size and len(compiles) == 2, compiles


def test_refused_figures_are_read_only_where_fine_enough():
    said = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
            "temporaries (23.71G) exceeds available HBM (15.75G).")
    assert preflight.refused_need(said) == (23.71 * 2**30, 15.75 * 2**30)
    assert preflight.refused_need(said.replace("23.71G", "0.01G")) is None
    assert preflight.refused_need("RESOURCE_EXHAUSTED: out of memory") is None


def test_no_batch_xla_compiles_is_said_so():
    line = refusal(Chip(limit=2**10), 1024)
    assert f"not even data.batch_size={MULTIPLE} fits; lower steps_per_call" in line


def test_any_other_compile_error_goes_through():
    def broken() -> jax.stages.Compiled:
        raise jax.errors.JaxRuntimeError("INTERNAL: the compiler crashed")

    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        preflight.compile_or_refuse(broken, [Chip(2**30)], 1,
                                    preflight.Resize(64, MULTIPLE, lambda b: broken()))


class _TpuDevice:
    platform = "tpu"


class _Placed:
    device_set = frozenset({_TpuDevice()})


class _ChipProgram:
    """A step program as XLA:TPU reported it: the Qwen2.5-0.5B shape at 8 x 2048 tokens, K=4,
    which ran on a 15.75 GiB v5e (BENCHMARKS.md, "Third run on the chip")."""

    input_shardings = ((_Placed(),), {})

    def memory_analysis(self) -> Any:
        return types.SimpleNamespace(
            argument_size_in_bytes=5928786944, output_size_in_bytes=5928516096,
            alias_size_in_bytes=5928508416, temp_size_in_bytes=13557424640,
            generated_code_size_in_bytes=65025536, peak_memory_in_bytes=16356069888)


def test_on_a_tpu_a_program_is_held_to_xla_s_peak_not_its_parts_summed():
    """Its parts summed (18.2 GiB) refused a run the chip ran; XLA's peak (15.3 GiB) fits."""
    chip = Chip(int(15.75 * 2**30))
    memory = preflight.program_memory(_ChipProgram(), [chip])  # type: ignore[arg-type]
    assert memory is not None and memory.fits()
    assert memory.need == 16356069888 + 65025536
    preflight.check_program_memory(_ChipProgram(), [chip], 4)  # type: ignore[arg-type]
    smaller = Chip(15 * 2**30)
    with pytest.raises(UserError, match=r"needs 15\.3 GiB of TPU_0"):
        preflight.check_program_memory(_ChipProgram(), [smaller], 4)  # type: ignore[arg-type]
