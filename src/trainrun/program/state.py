"""TrainState: everything that decides the future of a run, as one registered pytree, and how a
run builds it (abstract shapes, a fresh sharded init), and the nested dicts a checkpoint holds
it as. No IO."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from trainrun.program.precision import LossScale, Policy

if TYPE_CHECKING:
    from trainrun.config import RunConfig
    from trainrun.models import Model
    from trainrun.program.optim import Optimizer

PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """One pytree for the whole run state.

    step: int32 scalar, the number of steps taken (batches consumed).
    params: the model's parameters (float32 masters unless ``precision.params`` says else).
    opt_state: the Optax state for ``params``.
    key: typed PRNG key (``jax.random.key``); never changes. Step ``s`` draws from
        ``fold_in(key, s)``, so a resumed run draws the same bits as an uninterrupted one.
        The pytree carries it as its raw uint32 data (field ``key_data``; ``key`` is a property
        that wraps it): JAX dispatches a call with a typed key array argument in Python, not
        in C++, which costs a small model most of its step; and Orbax stores the raw data as a
        plain array.
    nonfinite_steps: int32 scalar, steps whose loss or gradients were not finite; their update
        was skipped (params and opt_state kept), so the optimizer has done
        ``step - nonfinite_steps`` updates and its schedule stands at that count.
    loss_scale: the dynamic loss scale (float16 compute); ``(1.0, 0)`` and unused otherwise.
    model_state: the model's non-trainable variables (BatchNorm's running statistics: see
        ``Model.init_model_state``); updated by the step, never by the optimizer; None without.
    ema: the params' exponential moving average (``optimizer.ema``), shaped and stored like
        ``params``; None without it.

    A new piece of run state is a new field here: then it is donated, checkpointed and covered
    by the resume check with no other change.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    key_data: jax.Array
    nonfinite_steps: jax.Array
    loss_scale: LossScale
    model_state: PyTree = None
    ema: PyTree = None

    @property
    def key(self) -> jax.Array:
        return jax.random.wrap_key_data(self.key_data)

    def replace(self, **changes: Any) -> TrainState:
        if "key" in changes:
            changes["key_data"] = jax.random.key_data(changes.pop("key"))
        return dataclasses.replace(self, **changes)


def create_state(params: PyTree, optimizer: optax.GradientTransformation,
                 key: jax.Array, loss_scale: LossScale | None = None,
                 ema: bool = False, model_state: PyTree = None) -> TrainState:
    """A fresh state at step 0 (with ``ema``: the moving average starts at the params). Call
    under ``jax.jit`` to create it already placed/sharded."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        key_data=jax.random.key_data(key),
        nonfinite_steps=jnp.zeros((), jnp.int32),
        loss_scale=loss_scale if loss_scale is not None else LossScale.create(),
        model_state=model_state,
        ema=jax.tree.map(jnp.copy, params) if ema else None,
    )


def state_tree(state: TrainState) -> dict[str, PyTree]:
    """The state as the nested dicts its checkpoint holds, each field (the loss scale's too) by
    name: a restore target Orbax fills without building the state's classes."""
    tree = {field.name: getattr(state, field.name) for field in dataclasses.fields(state)}
    scale = state.loss_scale
    tree["loss_scale"] = {field.name: getattr(scale, field.name)
                          for field in dataclasses.fields(scale)}
    return tree


def state_from_tree(tree: dict[str, PyTree]) -> TrainState:
    """The state ``state_tree`` gave as nested dicts, as the ``TrainState`` it was."""
    return TrainState(**{**tree, "loss_scale": LossScale(**tree["loss_scale"])})


def step_key(state: TrainState) -> jax.Array:
    """The randomness of the step about to run: ``fold_in(state.key, state.step)``."""
    return jax.random.fold_in(state.key, state.step)


# ---- building the state of a run -------------------------------------------------------------


def root_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """(init key, base step key) from the run's seed.

    The init key is ``jax.random.key(seed)`` itself, as a hand-written loop would use it; the
    step key is folded off it so that init and per-step draws never share a stream.
    """
    root = jax.random.key(seed)
    return root, jax.random.fold_in(root, 0x7374)  # "st"


# Init runs once, so it is compiled without XLA's algebraic simplifier: that pass would fold a
# user's `normal(k, shape) * 0.1` into the sampler's own sqrt(2) factor and round differently
# from the same function run op by op. Without it, a jitted (and sharded) init gives the very
# bits a hand-written eager `init(key)` gives.
INIT_COMPILER_OPTIONS: dict[str, str | bool] = {"xla_disable_hlo_passes": "algsimp"}


def _state_builder(model: Model, optimizer: Optimizer, seed: int, policy: Policy | None):
    policy = policy or Policy()

    def build() -> TrainState:
        init_key, base_key = root_keys(seed)  # traced: the same bits as eager, on every process
        model_state = (model.init_model_state(init_key) if model.init_model_state is not None
                       else None)
        return create_state(policy.cast_to_param(model.init(init_key)), optimizer.tx, base_key,
                            policy.initial_loss_scale(), ema=optimizer.ema is not None,
                            model_state=model_state)

    return build


def abstract_state(model: Model, optimizer: Optimizer, seed: int,
                   policy: Policy | None = None) -> TrainState:
    """The state's shapes and dtypes, computed without allocating it: from the params' shapes
    where the model's adapter knows them already (``adapters.init_shapes``), else by tracing
    its init."""
    from trainrun.models.adapters import init_shapes

    shapes = init_shapes(model.init) if model.init_model_state is None else None
    if shapes is None:
        return jax.eval_shape(_state_builder(model, optimizer, seed, policy))
    policy = policy or Policy()

    def around(params: PyTree) -> TrainState:  # what _state_builder's build returns
        _, base_key = root_keys(seed)
        return create_state(policy.cast_to_param(params), optimizer.tx, base_key,
                            policy.initial_loss_scale(), ema=optimizer.ema is not None)

    return jax.eval_shape(around, shapes)


def run_abstract_state(config: RunConfig, model: Model | None = None) -> TrainState:
    """The state's shapes and dtypes (``abstract_state``) for a run of ``config``: of ``model``
    where the caller built it, else of the model its kind trains (``models/kind_models.py``),
    under the optimizer and precision policy its config gives."""
    from trainrun.models.kind_models import kind_model
    from trainrun.program.optim import build_optimizer
    from trainrun.program.precision import policy_from_config

    return abstract_state(model or kind_model(config),
                          build_optimizer(config.optimizer, config.steps), config.seed,
                          policy_from_config(config.precision))


def init_state(model: Model, optimizer: Optimizer, seed: int, policy: Policy | None = None,
               shardings: TrainState | None = None, op_by_op: bool = False) -> TrainState:
    """A fresh state, created where ``shardings`` puts it: each device computes only its own
    shards, so a model never has to fit whole on one device. op_by_op: built as a
    hand-written eager init runs, each op's small program compiled on its own, then placed
    (for one device: the whole state is made there); the same bits as the program."""
    if op_by_op:
        state = _state_builder(model, optimizer, seed, policy)()
        return state if shardings is None else jax.device_put(state, shardings)
    return compile_init(init_program(model, optimizer, seed, policy, shardings))()


def init_program(model: Model, optimizer: Optimizer, seed: int, policy: Policy | None = None,
                 shardings: TrainState | None = None) -> jax.stages.Lowered:
    """The program ``init_state`` runs, traced and lowered, not yet compiled."""
    build = jax.jit(_state_builder(model, optimizer, seed, policy), out_shardings=shardings)
    return build.lower()


def compile_init(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """``init_program``'s program compiled as init is (``INIT_COMPILER_OPTIONS``)."""
    return lowered.compile(compiler_options=INIT_COMPILER_OPTIONS)


def state_from_params(params: PyTree, optimizer: Optimizer, seed: int,
                      policy: Policy | None = None, shardings: TrainState | None = None,
                      model_state: PyTree = None) -> TrainState:
    """A state at step 0 around given params (a fine-tune's start): a fresh optimizer state and
    the run's keys and loss scale, created where ``shardings`` puts it."""
    policy = policy or Policy()

    def build(params: PyTree, model_state: PyTree) -> TrainState:
        _, base_key = root_keys(seed)
        return create_state(policy.cast_to_param(params), optimizer.tx, base_key,
                            policy.initial_loss_scale(), ema=optimizer.ema is not None,
                            model_state=model_state)

    return jax.jit(build, out_shardings=shardings)(params, model_state)
