"""What a run checks about its model and data together before it writes anything.

A batch the model cannot take (a ``.npz`` whose arrays are not named as the model reads them,
widths that do not match) would otherwise surface at the first compile as a traceback, after
the run directory exists. Tracing the model's loss on the shapes of the first batch
(``jax.eval_shape``: no compile, no device work) finds it first.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from trainrun.config import TransformerModel
from trainrun.data import DataError
from trainrun.errors import UserError, printable
from trainrun.models import Model
from trainrun.models.transformer import parameter_count
from trainrun.platform.host_memory import host_memory_free


def check_batch(model: Model, data: Any, params: Any, from_config: bool) -> None:
    """Refuse, on one line, a batch of ``data`` that ``model``'s loss cannot take.

    params: the abstract params (shapes and dtypes). from_config: the model was built from the
        config, so a shape error is the config's (a model passed in reports its own errors).
    """
    import grain  # here: checking a model's memory (``trainrun.load``) needs no pipeline

    if not isinstance(data, grain.MapDataset):
        return  # a plain iterator: its first batch cannot be looked at without taking it
    batch = data[0]
    if not isinstance(batch, dict):
        return
    shapes = {name: jax.ShapeDtypeStruct(a.shape, a.dtype) for name, a in batch.items()}
    described = ", ".join(f"{name} {a.dtype}{list(a.shape)}" for name, a in shapes.items())
    init_model_state = model.init_model_state
    try:
        jax.eval_shape(lambda p, b: model.loss(
            p, b, jax.random.key(0),
            None if init_model_state is None else init_model_state(jax.random.key(0))),
            params, shapes)
    except KeyError as err:
        raise DataError(f"the model ({model.name}) reads batch key {err.args[0]!r}, which the "
                        f"data does not have (its arrays: {described}); name the arrays as the "
                        "model reads them (the MLP reads x and y)") from None
    except (TypeError, ValueError) as err:
        if not from_config:
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"the model ({model.name}) cannot take the data's batches "
                        f"({described}): {first}; make the model's sizes match the "
                        "data") from None


def check_vocab(vocab: int, model: Any, data: Any, source: str | None = None) -> None:
    """Refuse token ids a transformer's embedding has no row for (JAX would clip them to the
    last row without a word). source: the run's ``init.from``, which gave the model."""
    if not (isinstance(model, TransformerModel) and vocab > model.vocab):
        return
    named = f"data.tokenizer {data.tokenizer or 'bytes'!r} has {vocab} tokens"
    if source is not None:
        raise DataError(f"{named}, more than the {model.vocab} of the model of init.from "
                        f"{source}; drop data.tokenizer (the records are then read with the "
                        f"model's own) or give one of at most {model.vocab} tokens")
    raise DataError(f"{named}, more than model.vocab={model.vocab}; set model.vocab to at "
                    f"least {vocab} (or train from the tokenizer's model with init.from)")


def check_state_memory(abstract_state: Any, shardings: Any,
                       model_state: str = "model state") -> None:
    """Refuse, on one line and before anything is allocated, a train state (params, optimizer
    state, the model's state, moving average) that does not fit the memory its devices have
    free: on CPU the host memory every local device shares, on an accelerator each device's
    own. ``model_state``: what the state's ``model_state`` holds, as the refusal names it (a
    frozen reference's params, running statistics)."""
    placements = jax.tree.leaves(shardings)
    named = {**STATE_PARTS, "model_state": model_state}
    per_device: dict[Any, int] = {}
    parts: dict[str, int] = {}  # each large part's bytes in all, by what the refusal calls it
    at = 0
    for field in dataclasses.fields(abstract_state):
        for leaf in jax.tree.leaves(getattr(abstract_state, field.name)):
            sharding = placements[at]
            at += 1
            nbytes = _bytes(sharding.shard_shape(leaf.shape), leaf.dtype)
            for device in sharding.addressable_devices:
                per_device[device] = per_device.get(device, 0) + nbytes
            if field.name in named:
                part = named[field.name]
                parts[part] = parts.get(part, 0) + _bytes(leaf.shape, leaf.dtype)
    assert at == len(placements), "one placement per leaf of the state"
    if not per_device:
        return
    device = max(per_device, key=lambda d: per_device[d])
    if device.platform == "cpu":
        need, where, (free, bound, fix) = sum(per_device.values()), "host memory", _host()
    else:
        need, where, free, bound, fix = (per_device[device], str(device),
                                         device_memory_available(device), "", "")
    if free is not None and need > free:
        held = ", ".join(f"{name} {_size(nbytes)}" for name, nbytes in parts.items()
                         if nbytes >= 2**20)
        raise UserError(f"the train state needs {_size(need)} of {where} ({held} in all) and "
                        f"{_size(free)} is free{bound}: shrink the model, shard it over more "
                        "devices (mesh.fsdp), or drop optimizer state (optimizer.name=sgd, "
                        f"optimizer.trainable, model.lora){fix}")


# what the refusal calls each field of the state that can be large
STATE_PARTS = {"params": "params", "opt_state": "optimizer state", "ema": "moving average"}


def check_model_memory(cfg: TransformerModel, devices: list[Any], dtype: str,
                       described: str = "the model") -> None:
    """Refuse, on one line and before a layer of it is built, a transformer whose params alone
    (counted from its config, in ``dtype``) exceed the memory free on ``devices`` (the mesh's,
    over which the params may be sharded): a config.json of a trillion layers would otherwise
    be built module by module without end. ``check_state_memory`` counts the whole state once
    the model is built."""
    count = parameter_count(cfg)
    need = count * np.dtype(dtype).itemsize
    local = [d for d in devices if d.process_index == jax.process_index()]
    if not local:
        return
    bound = fix = ""
    if local[0].platform == "cpu":  # the host's memory, which its devices share
        (free, bound, fix), where = _host(), "host memory"
    else:
        known = [m for m in map(device_memory_available, local) if m is not None]
        free, where = (sum(known) if known else None), f"{local[0].platform} memory"
    if free is None:
        return
    free = free * len(devices) // len(local)  # other hosts' devices hold shards of it too
    if need > free:
        sizes = (f"layers={cfg.layers}, d_model={cfg.d_model}, heads={cfg.heads}, "
                 f"mlp_hidden={cfg.hidden}, vocab={cfg.vocab}")
        raise UserError(f"{described} ({sizes}) has {count:,} params, {_size(need)} as {dtype} "
                        f"alone, and {_size(free)} of {where} is free{bound}: check its sizes "
                        f"(is its config.json damaged?) or give a smaller model{fix}")


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """What one call of a compiled step program needs of its devices' memory, where it fits
    worst (on CPU: the host's, which its devices share), against what is free there."""

    need: int  # bytes the call allocates, less its arguments already placed
    intermediates: int  # of which XLA's temporaries
    free: int
    where: str  # "host memory", or the device
    bound: str = ""  # what bounds free host memory (after a space)
    fix: str = ""  # "; or raise that limit" where raising it is the fix

    def fits(self) -> bool:
        return self.need <= self.free


@dataclasses.dataclass(frozen=True)
class Resize:
    """The run's batch size and how to compile its step program at another: what a refusal
    needs to name the largest batch that fits. multiple: a batch size must be a multiple of it
    (the mesh's batch shards, the microbatches of ``accumulate``)."""

    size: int
    multiple: int
    compile_at: Callable[[int], jax.stages.Compiled]


# XLA's refusal, as it compiles, of a program whose buffers exceed the device's memory: a TPU's
# compiler checks its temporaries against the chip's HBM, where a CPU's or GPU's compiles
COMPILE_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED\b.*(HLO temporaries|Ran out of memory)",
                                   re.DOTALL)
ALSO = ("split batches (accumulate), recompute activations (model.remat), compute in bfloat16 "
        "(precision.compute), or shrink the model")


def refused_for_memory(err: BaseException) -> bool:
    """Whether ``err`` is XLA's refusal to compile a program for the memory it would need."""
    return (isinstance(err, jax.errors.JaxRuntimeError)
            and COMPILE_OUT_OF_MEMORY.search(str(err)) is not None)


def compile_or_refuse(compile_program: Callable[[], jax.stages.Compiled], devices: list[Any],
                      steps: int, resize: Resize | None = None) -> jax.stages.Compiled:
    """``compile_program()``, the step program of a ``steps``-step call; where XLA refuses to
    compile it for the memory it would need (``refused_for_memory``), the refusal in one line,
    naming with ``resize`` the largest batch size that fits (``batch_below_refused``)."""
    try:
        return compile_program()
    except jax.errors.JaxRuntimeError as err:
        if not refused_for_memory(err):
            raise
        lines = str(err).strip().splitlines()
        said = str(err)
    where = str(devices[0]) if devices else "its device"
    lower = "lower data.batch_size or steps_per_call"
    if resize is not None:
        lower = _lower(batch_below_refused(resize, devices, said), resize, lower)
    raise UserError(f"the compiled training step does not fit {where}: XLA refused to compile "
                    f"a {steps}-step call ({printable(lines[0].rstrip('.'))}): {lower}, "
                    f"{ALSO}")


def batch_below_refused(resize: Resize, devices: list[Any], said: str = "") -> int | None:
    """The largest batch size that fits where XLA refused to compile the run's own
    (``resize.size``). Where the refusal ``said`` what the temporaries need and what there is,
    finely enough to draw a line through (``refused_need``), one compile at the size they
    point to gives the line's second point (``_batch_between``): each compile of a program
    that fills a chip takes most of a minute there. Otherwise the size is halved until its
    program compiles; from there as ``batch_that_fits`` finds it where that program does not
    fit either, else on the line through it and a compile at half of it, below the smallest
    size refused (``_batch_above``). 0: not even ``resize.multiple`` compiles; None: it cannot
    be told."""
    needs = refused_need(said)
    if needs is not None:
        found = _batch_between(resize, devices, *needs)
        if found is not None:
            return found
    refused = size = resize.size
    compiled = None
    while compiled is None:
        half = _halved(size, resize.multiple)
        if half is None:
            return 0
        try:
            compiled = resize.compile_at(half)
        except jax.errors.JaxRuntimeError as err:
            if not refused_for_memory(err):
                raise
            refused = half
        size = half
    memory = program_memory(compiled, devices)
    at = dataclasses.replace(resize, size=size)
    if memory is None:
        return size  # it compiled: the one word the backend gives
    if not memory.fits():
        return batch_that_fits(memory, at, devices)
    return _batch_above(memory, at, refused, devices)


# XLA's words for what the temporaries of a refused program need and what the chip has
REFUSED_NEED = re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM "
                          r"\(([\d.]+)([KMGT]?)\)")


def refused_need(said: str) -> tuple[float, float] | None:
    """``(temporaries, available)`` bytes of XLA's refusal ``said``; None where it does not
    say them, or says them too coarsely (a figure of under three digits) to draw a line on."""
    found = REFUSED_NEED.search(said)
    if found is None:
        return None
    digits = min(len(found.group(i).replace(".", "").lstrip("0")) for i in (1, 3))
    if digits < 3:
        return None
    unit = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    return (float(found.group(1)) * unit[found.group(2)],
            float(found.group(3)) * unit[found.group(4)])


def _batch_between(resize: Resize, devices: list[Any], temporaries: float,
                   available: float) -> int | None:
    """The largest batch size that fits (0: none does), on the line through the refused
    size's temporaries (``temporaries``, of ``available``) and one compile at the size a need
    proportional to the batch would fit, less a tenth, whether that one fits or not; None
    where that compile is refused too or says nothing."""
    size, multiple = resize.size, resize.multiple
    guess = int(size * available / temporaries * 0.9)
    guess -= guess % multiple
    if not 0 < guess < size:
        return None
    try:
        compiled = resize.compile_at(guess)
    except jax.errors.JaxRuntimeError as err:
        if not refused_for_memory(err):
            raise
        return None
    memory = program_memory(compiled, devices)
    if memory is None:
        return guess  # it compiled: the one word the backend gives
    per_row = (temporaries - memory.intermediates) / (size - guess)
    if per_row <= 0:  # the batch does not move the need: the size known to compile, or none
        return guess if memory.fits() else 0
    return max(_on_line(guess, memory, per_row, size - multiple, multiple), 0)


def _batch_above(memory: ProgramMemory, at: Resize, refused: int, devices: list[Any]) -> int:
    """The largest batch size that fits, from ``at.size``, which fits (``memory``), towards
    ``refused``, which does not compile: XLA's need grows by a step per row, measured by one
    more compile at half ``at.size``."""
    size, multiple = at.size, at.multiple
    half = _halved(size, multiple)
    other = None if half is None else program_memory(at.compile_at(half), devices)
    if half is None or other is None or memory.need <= other.need:
        return size  # no second point, or a need the batch does not move: the size known to fit
    per_row = (memory.need - other.need) / (size - half)
    return max(_on_line(size, memory, per_row, refused - multiple, multiple), size)


def _on_line(size: int, memory: ProgramMemory, per_row: float, ceiling: int,
             multiple: int) -> int:
    """The batch size where the need, ``memory``'s at ``size`` growing by ``per_row`` bytes a
    row, meets what is free: at most ``ceiling``, rounded down to ``multiple``."""
    fits = min(size + math.floor((memory.free - memory.need) / per_row), ceiling)
    return fits - fits % multiple


def _halved(size: int, multiple: int) -> int | None:
    """Half ``size``, rounded down to a multiple of ``multiple``; None below ``multiple``."""
    half = size // 2 - (size // 2) % multiple
    return half if 0 < half < size else None


def program_memory(compiled: jax.stages.Compiled, devices: list[Any],
                   placed: Mapping[Any, int] | None = None) -> ProgramMemory | None:
    """XLA's buffer assignment for one call of ``compiled`` on each of ``devices``, summed over
    the host's devices on CPU, against the memory free there; None where the backend does not
    say. Its peak on a TPU, else its arguments, outputs less the donated state they reuse and
    temporaries, each with the code. placed: bytes of the call's arguments already
    on each device (the state, once made), which the memory in use counts already."""
    stats = compiled.memory_analysis()
    if stats is None or not devices:  # a backend that does not say
        return None
    temp = int(stats.temp_size_in_bytes)
    # On a TPU the sum counts twice what XLA places in the donated state's buffers as they free
    # up, and refused steps the chip ran (BENCHMARKS.md, "Third run on the chip"); on CPU the
    # peak leaves out part of the temporaries' one allocation
    peak = int(stats.peak_memory_in_bytes) if _compiled_for(compiled) == "tpu" else 0
    per_device = int(stats.generated_code_size_in_bytes) + (
        peak or (int(stats.argument_size_in_bytes) + int(stats.output_size_in_bytes)
                 - int(stats.alias_size_in_bytes) + temp))
    placed = placed or {}
    if devices[0].platform == "cpu":
        free, bound, fix = _host()
        if free is None:
            return None
        count = len(devices)
        return ProgramMemory(per_device * count - sum(placed.get(d, 0) for d in devices),
                             temp * count, free, "host memory", bound, fix)
    available = {d: device_memory_available(d) for d in devices}
    known = [d for d in devices if available[d] is not None]
    if not known:
        return None
    device = min(known, key=lambda d: (available[d] or 0) + placed.get(d, 0))
    return ProgramMemory(per_device - placed.get(device, 0), temp, available[device] or 0,
                         str(device))


def _compiled_for(compiled: jax.stages.Compiled) -> str | None:
    """The platform of the devices ``compiled`` takes its arguments on; None if it takes none."""
    for sharding in jax.tree.leaves(compiled.input_shardings):
        for device in sharding.device_set:
            return str(device.platform)
    return None


def check_program_memory(compiled: jax.stages.Compiled, devices: list[Any], steps: int, *,
                         placed: Mapping[Any, int] | None = None,
                         resize: Resize | None = None) -> None:
    """Refuse, on one line, a compiled step program whose call does not fit the memory its
    devices have free (``program_memory``): before the state exists, and on an accelerator
    once more with the state placed (``placed``), where anything else that holds memory then
    counts too. With ``resize``, the line names the largest batch size that fits
    (``batch_that_fits``)."""
    memory = program_memory(compiled, devices, placed)
    if memory is None or memory.fits():
        return
    what = (f"beyond the state placed there (batches of a {steps}-step call, with "
            if placed else f"(state and batches of a {steps}-step call, with ")
    lower = "lower data.batch_size or steps_per_call"
    if resize is not None:
        lower = _lower(batch_that_fits(memory, resize, devices, placed), resize, lower)
    raise UserError(f"the compiled training step needs {_size(memory.need)} of {memory.where} "
                    f"{what}{_size(memory.intermediates)} of intermediates) and "
                    f"{_size(memory.free)} is free{memory.bound}: {lower}, {ALSO}{memory.fix}")


def _lower(fits: int | None, resize: Resize, otherwise: str) -> str:
    """What a refusal says to lower: the batch size that fits (``fits``; 0: none does), or
    ``otherwise`` where that cannot be told."""
    if fits:
        return (f"data.batch_size={fits} fits by XLA's count (it is {resize.size}); or lower "
                "steps_per_call")
    if fits == 0:
        return f"not even data.batch_size={resize.multiple} fits; lower steps_per_call"
    return otherwise


def batch_that_fits(memory: ProgramMemory, resize: Resize, devices: list[Any],
                    placed: Mapping[Any, int] | None = None) -> int | None:
    """The largest batch size (a multiple of ``resize.multiple``) whose program fits, where
    ``memory`` is the run's at ``resize.size``; 0 if none does; None if it cannot be told.

    XLA's need grows with the batch by a step per row (the activations) over a part that does
    not (the state, its gradients, the optimizer's temporaries). One more compile, at the size
    a need proportional to the batch would fit (never smaller than the answer), gives the
    second point of that line; the size it reaches is rounded down to the multiple."""
    size, multiple = resize.size, resize.multiple
    guess = min(size * memory.free // max(memory.need, 1), size - multiple)
    guess -= guess % multiple
    if guess < multiple:
        guess = multiple
    if guess >= size:
        return 0  # the smallest batch size is the run's own
    other = program_memory(resize.compile_at(guess), devices, placed)
    if other is None:
        return None
    per_row = (memory.need - other.need) / (size - guess)
    if per_row <= 0:  # the batch does not move the need: no batch size fits
        return 0
    return max(_on_line(guess, other, per_row, size - multiple, multiple), 0)


def placed_bytes(tree: Any) -> dict[Any, int]:
    """Bytes the arrays of ``tree`` hold on each of this process's devices."""
    held: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            held[shard.device] = held.get(shard.device, 0) + _bytes(shard.data.shape, leaf.dtype)
    return held


def _host() -> tuple[int | None, str, str]:
    """Free host memory, which limit bounds it (after a space) and, for a limit set on this
    process or its cgroup, the fix that raising it is (``host_memory.py``)."""
    host = host_memory_free()
    if host is None:
        return None, "", ""
    return host.free, f" {host.limit}", "; or raise that limit" if host.raisable else ""


def device_memory_available(device: Any) -> int | None:
    """An accelerator's free memory as its allocator reports it, in bytes."""
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def _bytes(shape: tuple[int, ...], dtype: Any) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"
