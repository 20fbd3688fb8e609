"""Where arrays live: the device mesh, and the shardings of the batch and of the train state.

    mesh       axes (data, fsdp, expert, tensor); sizes from the config, -1 = the devices left
    batch      its example dim split over (data, fsdp, expert)  [B, ...] or stacked [K, B, ...]
    params     expert: a mixture's ``expert`` dim split over `expert` (each device holds its
                       share of the experts; XLA exchanges the routed tokens between them)
               tensor: the dim whose logical name is in ``mesh.tensor_axes`` split over `tensor`
               (an MLP's ``(embed, mlp)`` then ``(mlp, embed)`` is column- then row-parallel)
               fsdp:   of a param with >= ``mesh.fsdp_min_size`` elements, the largest other
                       dim that `fsdp` divides
               a dim that does not divide stays whole (replicated)
    opt state  each param-shaped part follows its param; scalars, step and key replicated

The same program runs on 1 device, N devices and N hosts: only the mesh changes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainrun.config import BATCH_AXES, MESH_AXES, MeshConfig
from trainrun.errors import UserError

PyTree = Any
AXES = MESH_AXES


class MeshError(UserError):
    """A mesh that does not fit the devices or the model; one line, exit 2."""


def mesh_shape(cfg: MeshConfig, device_count: int) -> dict[str, int]:
    """Axis sizes with a ``-1`` resolved; their product is exactly ``device_count``."""
    sizes = {axis: getattr(cfg, axis) for axis in AXES}
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise MeshError(f"mesh axes {' and '.join(free)} are both -1; only one axis can take "
                        "the remaining devices, give the others a size")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    # an expert axis of 1 (every dense model's) is left out of the one line
    named = " x ".join(f"{axis}={size}" for axis, size in sizes.items()
                       if size != -1 and (axis != "expert" or size != 1))
    if free:
        if device_count % fixed:
            raise MeshError(f"mesh {named} = {fixed} devices does not divide the "
                            f"{device_count} devices of this run; choose sizes whose product "
                            f"divides {device_count}")
        sizes[free[0]] = device_count // fixed
    elif fixed != device_count:
        raise MeshError(f"mesh {named} = {fixed} devices, but this run has {device_count}; "
                        f"make the product {device_count} or set one axis to -1")
    return sizes


# jax.Device aliases a class of jaxlib's compiled module, which ships no stubs to type it by.
def build_mesh(cfg: MeshConfig,
               devices: list[jax.Device] | None = None,  # pyright: ignore[reportInvalidTypeForm]
               ) -> Mesh:
    """The run's mesh over ``devices`` (default: every device of every process).

    Axes are ``Auto``: the model's code carries no sharding annotations; XLA propagates the
    shardings of the params and the batch through it.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = mesh_shape(cfg, len(devices))
    return jax.make_mesh(tuple(sizes.values()), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices)


def traced_on(mesh: Mesh | AbstractMesh, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` traced with ``mesh`` as JAX's current abstract mesh, where code that splits work
    by hand (a mixture's experts, under ``shard_map``) finds the mesh's axes."""

    @functools.wraps(fn)
    def on_mesh(*args: Any) -> Any:
        abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
        with jax.sharding.use_abstract_mesh(abstract):
            return fn(*args)

    return on_mesh


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ---- params and state ------------------------------------------------------------------------


def param_spec(shape: tuple[int, ...], names: tuple[str | None, ...] | None,
               sizes: dict[str, int], cfg: MeshConfig, where: str = "param") -> P:
    """The PartitionSpec of one param of ``shape`` whose dims are named ``names``."""
    spec: list[str | None] = [None] * len(shape)
    if names is not None and len(names) != len(shape):
        raise MeshError(f"{where} has shape {shape} but its logical axes {names} name "
                        f"{len(names)} dims; give one name (or None) per dim")
    tensor, fsdp, expert = sizes["tensor"], sizes["fsdp"], sizes.get("expert", 1)
    if expert > 1 and names is not None:
        _shard_experts(spec, shape, names, expert, where)
    if tensor > 1 and names is not None:
        _shard_over_tensor(spec, shape, names, tensor, cfg.tensor_axes)
    if fsdp > 1 and math.prod(shape) >= cfg.fsdp_min_size:
        _shard_over_fsdp(spec, shape, fsdp)
    return P(*spec)


def _shard_experts(spec: list[str | None], shape: tuple[int, ...],
                   names: tuple[str | None, ...], expert: int, where: str) -> None:
    """Put each dim named ``expert`` on the ``expert`` mesh axis (of size ``expert``), which
    must divide it."""
    for dim, (size, name) in enumerate(zip(shape, names, strict=True)):
        if name == "expert":
            if size % expert:
                raise MeshError(f"{where} has {size} experts, which mesh.expert={expert} "
                                "does not divide; choose a mesh.expert that divides the "
                                "number of experts")
            spec[dim] = "expert"


def _shard_over_tensor(spec: list[str | None], shape: tuple[int, ...],
                       names: tuple[str | None, ...], tensor: int,
                       tensor_axes: Sequence[str]) -> None:
    """Put the first dim named in ``tensor_axes`` that ``tensor`` divides on the ``tensor``
    mesh axis."""
    for dim, (size, name) in enumerate(zip(shape, names, strict=True)):
        if name in tensor_axes and size % tensor == 0:
            spec[dim] = "tensor"
            break  # a mesh axis shards one dim at most


def _shard_over_fsdp(spec: list[str | None], shape: tuple[int, ...], fsdp: int) -> None:
    """Put the largest dim still unsharded that ``fsdp`` divides on the ``fsdp`` mesh axis."""
    free = [dim for dim in range(len(shape)) if spec[dim] is None and shape[dim] % fsdp == 0]
    if free:
        spec[max(free, key=lambda dim: shape[dim])] = "fsdp"  # max keeps the first of ties


def param_shardings(mesh: Mesh, params: PyTree, logical_axes: PyTree | None,
                    cfg: MeshConfig) -> PyTree:
    """A NamedSharding per param; ``params`` may be abstract (``jax.eval_shape``)."""
    sizes = dict(mesh.shape)
    if sizes["tensor"] > 1 and logical_axes is None:
        raise MeshError(f"mesh.tensor={sizes['tensor']} but the model names no param axes "
                        "(Model.logical_axes), so nothing could be split over tensor; set "
                        "mesh.tensor=1 or give the model logical axes")
    paths, treedef = jax.tree.flatten_with_path(params)
    # jaxlib ships no type for PyTreeDef, so mypy cannot see its methods
    names = ([None] * len(paths) if logical_axes is None
             else treedef.flatten_up_to(logical_axes))  # type: ignore[attr-defined]
    specs = [param_spec(tuple(leaf.shape), axes, sizes, cfg, jax.tree_util.keystr(path))
             for (path, leaf), axes in zip(paths, names, strict=True)]
    return jax.tree.unflatten(treedef, [NamedSharding(mesh, spec) for spec in specs])


def state_shardings(mesh: Mesh, abstract_state: Any, logical_axes: PyTree | None,
                    tx: optax.GradientTransformation, cfg: MeshConfig) -> Any:
    """Shardings for a whole TrainState: params by the rules, optimizer state following them,
    a moving average and a model state (or an entry of a dict model state) shaped as the params
    lying as they do; the rest replicated."""
    params = param_shardings(mesh, abstract_state.params, logical_axes, cfg)
    whole = replicated(mesh)
    # A frozen param's slot in a masked state (optimizer.trainable) is an empty MaskedNode.
    masked = lambda x: isinstance(x, optax.MaskedNode)
    opt_state = optax.tree_map_params(
        tx, lambda value, sharding: value if masked(value) else sharding,
        abstract_state.opt_state, params, transform_non_params=lambda _: whole, is_leaf=masked)
    ema = params if abstract_state.ema is not None else None  # the average lies as params do
    placed = jax.tree.map(lambda _: whole, abstract_state).replace(params=params,
                                                                   opt_state=opt_state, ema=ema)
    model_state = abstract_state.model_state
    # a copy of the params (a preference run's reference) is sharded as they are
    if _shaped_like(model_state, abstract_state.params):
        placed = placed.replace(model_state=params)
    elif isinstance(model_state, dict):
        placed = placed.replace(model_state={
            name: params if _shaped_like(part, abstract_state.params) else placed_part
            for (name, part), placed_part in zip(model_state.items(),
                                                 placed.model_state.values(), strict=True)})
    return placed


def _shaped_like(tree: PyTree, params: PyTree) -> bool:
    """Whether ``tree`` has the params' structure and each leaf their shape."""
    # jaxlib ships no type for PyTreeDef, so mypy cannot see its comparison
    if tree is None or jax.tree.structure(tree) != jax.tree.structure(params):  # type: ignore[operator]
        return False
    return all(a.shape == b.shape for a, b in zip(jax.tree.leaves(tree),
                                                  jax.tree.leaves(params), strict=True))


# ---- the batch -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BatchPlacement:
    """How a global batch of ``global_size`` examples is split over the mesh and the processes.

    sharding: of each batch leaf (the example dim is ``axis``: 1 for stacked ``[K, B, ...]``).
    rows: ``(index, count)``: this process loads rows ``[index * B / count, (index+1) * B /
        count)`` of each global batch, the rows its devices hold. Processes whose devices hold
        the same rows (a `tensor` axis across hosts) load the same rows.
    """

    sharding: NamedSharding
    axis: int
    global_size: int
    rows: tuple[int, int]

    def put(self, batch: PyTree) -> PyTree:
        """This process's host rows -> the global batch.

        One process: the host arrays are returned as they are; the jitted step places them by
        its ``in_shardings`` inside its C++ dispatch, with no per-step Python ``device_put``.
        Several: each process contributes the rows it holds.
        """
        if jax.process_count() == 1:
            return batch

        def global_array(leaf: np.ndarray) -> jax.Array:
            shape = list(leaf.shape)
            shape[self.axis] = self.global_size
            return jax.make_array_from_process_local_data(self.sharding, leaf, tuple(shape))

        return jax.tree.map(global_array, batch)


def on_host(array: jax.Array | np.ndarray) -> np.ndarray:
    """The whole of ``array`` on this host: as it is where this process holds all of it (one
    process, or a replicated array), else gathered from every process (each holds its rows)."""
    if isinstance(array, np.ndarray) or array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def every_process_rows(local: np.ndarray, rows: tuple[int, int]) -> np.ndarray:
    """``local`` (this process's ``rows``, ``(index, count)``, of a batch along the last axis)
    joined with every other process's into the whole batch, in row order; processes that hold
    the same rows (a ``tensor`` axis across hosts) give them once."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    gathered = np.asarray(multihost_utils.process_allgather(local))  # [processes, ...]
    indices = np.asarray(multihost_utils.process_allgather(np.int32(rows[0])))
    first = [int(np.flatnonzero(indices == index)[0]) for index in range(rows[1])]
    return np.concatenate([gathered[process] for process in first], axis=-1)


def batch_placement(mesh: Mesh, global_size: int, stacked: bool) -> BatchPlacement:
    split = math.prod(mesh.shape[axis] for axis in BATCH_AXES)
    if global_size % split:
        raise MeshError(f"data.batch_size {global_size} does not split over data x fsdp x "
                        f"expert = {split} devices; make it a multiple of {split}")
    spec = P(None, BATCH_AXES) if stacked else P(BATCH_AXES)
    return BatchPlacement(NamedSharding(mesh, spec), 1 if stacked else 0, global_size,
                          _process_rows(mesh, global_size))


def _process_rows(mesh: Mesh, global_size: int) -> tuple[int, int]:
    held = NamedSharding(mesh, P(BATCH_AXES)).addressable_devices_indices_map((global_size,))
    # jax types each device's index as optional; a NamedSharding's are all set
    spans = sorted({index[0].indices(global_size)[:2] for index in held.values()
                    if index is not None})
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start:
        raise MeshError(f"this process's devices hold rows {spans} of the batch, which are not "
                        "one block; order the devices so each process's are adjacent on "
                        "(data, fsdp, expert)")
    return start // (stop - start), global_size // (stop - start)
