"""The sections of a run's configuration: one frozen pydantic model per concept (model, data,
eval, optimizer and its schedules, precision, checkpoints, mesh, processes, metrics, profiling),
every field typed, defaulted and bounded. ``run.py`` puts them together into ``RunConfig``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from trainrun import extras
from trainrun.config import renamed


class Section(BaseModel):
    # No float in a run's config may be infinite or NaN (an `optimizer.lr=.inf` would be taken
    # and skip every step as non-finite).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


Width = Annotated[int, Field(gt=0)]  # a layer's size: at least 1
SEED_MAX = 2**32 - 1  # jax.random.key's range without wrapping


# ---- model -----------------------------------------------------------------------------------


class MLPModel(Section):
    """The reference chapter's MLP as plain functions: features -> hidden (ReLU) -> outputs."""

    kind: Literal["mlp"] = "mlp"
    features: int = Field(default=8, gt=0)
    hidden: list[Width] = Field(default_factory=lambda: [32])
    outputs: int = Field(default=1, gt=0)
    init_scale: float = Field(default=0.1, gt=0)


class NNXMLPModel(Section):
    """An MLP as a Flax NNX module: flattened ``x`` -> hidden (GELU, dropout) -> outputs.

    task: the loss and metrics: ``regression`` (mean squared error against ``y``) or
        ``classification`` (cross-entropy against ``label``, accuracy). Not set, it follows the
        run's data: ``classification`` on digits, ``regression`` on the synthetic regression
        and on arrays (set it for arrays with a ``label``); the resolved config shows it.
    """

    kind: Literal["nnx_mlp"] = "nnx_mlp"
    features: int = Field(default=8, gt=0)
    hidden: list[Width] = Field(default_factory=lambda: [64])
    outputs: int = Field(default=1, gt=0)
    task: Literal["regression", "classification"] = "regression"
    dropout: float = Field(default=0.0, ge=0, lt=1)


class CNNModel(Section):
    """A small image classifier: 3x3 conv blocks (ReLU, 2x2 max-pool) -> dense -> classes."""

    kind: Literal["cnn"] = "cnn"
    image_size: int = Field(default=8, gt=0)
    in_channels: int = Field(default=1, gt=0)
    channels: list[Width] = Field(default_factory=lambda: [32, 64])
    hidden: int = Field(default=128, gt=0)
    classes: int = Field(default=10, gt=1)
    dropout: float = Field(default=0.0, ge=0, lt=1)


class ResNetModel(Section):
    """A small residual network with batch normalization (running statistics are the model
    state): 3x3 conv stem, ``blocks`` residual blocks of two conv-BN layers, average pool."""

    kind: Literal["resnet"] = "resnet"
    image_size: int = Field(default=8, gt=0)
    in_channels: int = Field(default=1, gt=0)
    width: int = Field(default=32, gt=0)
    blocks: int = Field(default=2, ge=0)
    classes: int = Field(default=10, gt=1)
    # running = momentum * running + (1 - m) * batch
    bn_momentum: float = Field(default=0.9, gt=0, lt=1)


# all-linear: every linear layer of the blocks the model has (PEFT's name for it); router: a
# mixture of experts' router
LoraTarget = Literal["q", "k", "v", "o", "gate", "up", "down", "router", "all-linear"]


class LoraConfig(Section):
    """Low-rank adapters: ``y = x W + (alpha / rank) x A B`` on each targeted linear layer, with
    ``A`` ~ N(0, 1/d_in) and ``B`` = 0, so training starts from the base model's outputs."""

    rank: int = Field(default=8, gt=0)
    alpha: float = Field(default=16.0, gt=0)
    # A tuple, so the section hashes (a compiled sampler is cached per model config).
    targets: tuple[LoraTarget, ...] = Field(default=("q", "v"), min_length=1)

    @pydantic.field_validator("targets", mode="before")
    @classmethod
    def _one_target(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value  # `targets: all-linear`


class RopeScaling(Section):
    """Rotary frequencies stretched for a longer context than pretraining's: ``linear`` divides
    every frequency by ``factor``; ``llama3`` divides the low ones, keeps the high ones and
    blends between (Llama 3.1's scheme, with its four numbers)."""

    type: Literal["linear", "llama3"]
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(default=1.0, gt=0)
    high_freq_factor: float = Field(default=4.0, gt=0)
    original_max_positions: int = Field(default=8192, gt=0)


def _and(names: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


class TransformerModel(Section):
    """A decoder-only transformer LM of pre-norm blocks and causal attention. The defaults are
    GPT-style (LayerNorm, GELU MLP, tied embeddings); the Llama family's choices are fields:
    RMSNorm, a SwiGLU MLP, fewer key/value heads than query heads, rotary base and scaling, an
    output head of its own, biases on q/k/v alone (Qwen2)."""

    kind: Literal["transformer"] = "transformer"
    vocab: int = Field(default=256, gt=1)
    d_model: int = Field(default=128, gt=0)
    layers: int = Field(default=4, gt=0)
    heads: int = Field(default=4, gt=0)
    kv_heads: int | None = Field(default=None, gt=0)  # grouped-query attention; None: one per head
    head_dim: int | None = Field(default=None, gt=0)  # None: d_model // heads
    mlp: Literal["gelu", "swiglu", "geglu"] = "gelu"  # geglu: down(gelu_tanh(gate(x)) * up(x))
    mlp_ratio: int = Field(default=4, gt=0)
    mlp_hidden: int | None = Field(default=None, gt=0)  # the MLP's width; None: mlp_ratio * d_model
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = Field(default=1e-5, gt=0)
    seq_len: int = Field(default=128, gt=0)
    positions: Literal["rope", "learned"] = "rope"
    rope_theta: float = Field(default=10_000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = True  # the output head is the input embedding table
    dropout: float = Field(default=0.0, ge=0, lt=1)
    init_std: float = Field(default=0.02, gt=0)
    bias: bool = False  # biases on every linear layer (GPT-2's layout)
    qkv_bias: bool = False  # biases on the query, key and value projections alone (Qwen2's)
    attention_bias: bool = False  # biases on q, k, v and the output projection (Llama's option)
    mlp_bias: bool = False  # biases on the MLP's projections (Llama's option)
    qk_norm: bool = False  # an RMSNorm over each head's queries and keys (Qwen3, Gemma 3)
    # what qk_norm's RMSNorm spans: each head, or the whole q and k projections (OLMo-2's)
    qk_norm_over: Literal["head", "projection"] = "head"
    norm_plus_one: bool = False  # RMSNorm scales by 1 + w, w starting at 0 (Gemma)
    pre_norms: bool = True  # a norm on each sublayer's input (false with post_norms: OLMo-2)
    post_norms: bool = False  # a norm on each sublayer's output before the residual (Gemma)
    embed_scale: bool = False  # the embedding rows times sqrt(d_model) (Gemma)
    # The pad token's id: its embedding row takes no gradient from its lookups, as
    # transformers' padding_idx (a tied head's gradient still reaches it). None: every row.
    pad_id: int | None = Field(default=None, ge=0)
    # attention logits' scale; 1/sqrt(head_dim)
    query_scale: float | None = Field(default=None, gt=0)
    # Soft-capping to cap * tanh(logits / cap) (None: none), of the attention logits before
    # the mask and of the output head's logits (Gemma 2's).
    attention_logit_softcap: float | None = Field(default=None, gt=0)
    final_logit_softcap: float | None = Field(default=None, gt=0)
    # Attention to the last sliding_window positions (the token's own included) on the layers
    # sliding_layers lists (None: every layer); those layers' rotary base is local_rope_theta
    # where set, unscaled (Gemma 3's local layers).
    sliding_window: int | None = Field(default=None, gt=0)
    sliding_layers: tuple[int, ...] | None = None
    local_rope_theta: float | None = Field(default=None, gt=0)
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the MLP of each layer but
    # dense_layers is experts gated MLPs of width expert_hidden, each token through the
    # experts_per_token its router picks (weights renormalised to sum 1 where
    # router_renormalise), beside a shared expert of width shared_expert_hidden where set.
    # The load-balancing loss is added times router_aux_loss.
    experts: int | None = Field(default=None, gt=1)
    experts_per_token: int = Field(default=2, gt=0)
    expert_hidden: int | None = Field(default=None, gt=0)
    shared_expert_hidden: int | None = Field(default=None, gt=0)
    router_renormalise: bool = True
    router_aux_loss: float = Field(default=0.01, ge=0)
    dense_layers: tuple[int, ...] = ()
    # q/k/v and gate/up each one layer (Phi-3's qkv_proj and gate_up_proj): a LoRA adapter spans
    # the layer's whole output, so q, k and v (and gate and up) are adapted together or not
    fused_projections: bool = False
    lora: LoraConfig | None = None  # adapters; with them only the adapters train by default
    # How the program is built; the maths and the params' layout stay the same, so a checkpoint
    # written under one setting restores under any other.
    scan_layers: bool = False  # one compiled block under lax.scan: compile time flat in depth
    remat: Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"] = "none"
    loss_chunk: int = Field(default=4096, ge=0)  # tokens per chunk of the head and loss; 0: one

    @pydantic.model_validator(mode="after")
    def _shapes_fit(self) -> TransformerModel:
        self._check_heads()
        self._check_layers()
        if self.pad_id is not None and self.pad_id >= self.vocab:
            raise ValueError(f"model.pad_id={self.pad_id} is not a token of the vocabulary "
                             f"(model.vocab={self.vocab}); give an id below {self.vocab}, or "
                             "null for none")
        self._check_experts()
        if self.lora is not None:
            self._check_lora_targets(self.lora)
        return self

    def _check_heads(self) -> None:
        """The width splits into the heads, the query heads into groups of one key/value head,
        qk_norm_over goes with qk_norm, and a rotary head dimension is even."""
        if self.head_dim is None and self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of heads={self.heads}; "
                             "change one, or set head_dim")
        if self.heads % self.kv_key_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads="
                             f"{self.kv_key_heads}; each key/value head serves a group of query "
                             "heads")
        if self.qk_norm_over != "head" and not self.qk_norm:
            raise ValueError(f"model.qk_norm_over={self.qk_norm_over} is set without "
                             "model.qk_norm; set qk_norm=true, or drop qk_norm_over")
        if self.positions == "rope" and self.attention_head_dim % 2:
            raise ValueError(f"rotary positions need an even head dimension, not "
                             f"{self.attention_head_dim}; change d_model, heads or head_dim")

    def _check_layers(self) -> None:
        """The sliding layers are layers of the model and have a window; under scan_layers
        every layer is alike."""
        if self.sliding_layers is not None and any(not 0 <= i < self.layers
                                                   for i in self.sliding_layers):
            raise ValueError(f"model.sliding_layers={list(self.sliding_layers)} names a layer "
                             f"outside 0..{self.layers - 1}")
        if self.sliding_layers is not None and self.sliding_window is None:
            raise ValueError("model.sliding_layers is set without model.sliding_window; give "
                             "the window's length")
        if self.scan_layers and len({(self.local_layer(i), self.expert_layer(i))
                                     for i in range(self.layers)}) > 1:
            raise ValueError("model.scan_layers=true needs every layer alike, but "
                             "model.sliding_layers or model.dense_layers make them differ; "
                             "set scan_layers=false")

    def _check_experts(self) -> None:
        """A mixture of experts routes each token to no more experts than it has, each a gated
        MLP."""
        if self.experts is not None:
            if self.experts_per_token > self.experts:
                raise ValueError(f"model.experts_per_token={self.experts_per_token} is more "
                                 f"than model.experts={self.experts}")
            if not self.gated:
                raise ValueError("model.experts needs a gated MLP (model.mlp=swiglu or geglu)")

    def _check_lora_targets(self, lora: LoraConfig) -> None:
        """``lora.targets`` (this model's ``lora``) names layers this model has, and a fused
        layer's parts all or none."""
        if self.mlp == "gelu" and "gate" in lora.targets:
            raise ValueError("model.lora.targets names gate, which only model.mlp=swiglu has; "
                             "drop it, or give all-linear")
        if self.experts is None and "router" in lora.targets:
            raise ValueError("model.lora.targets names router, which only a mixture of experts "
                             "(model.experts) has; drop it, or give all-linear")
        if self.fused_projections:
            for group, layer in ((("q", "k", "v"), "qkv_proj"), (("gate", "up"), "gate_up_proj")):
                named = [t for t in group if t in self.adapted]
                if named and len(named) < len(group):
                    raise ValueError(
                        f"model.lora.targets names {_and(named)} without "
                        f"{_and([t for t in group if t not in named])}; this model fuses "
                        f"{_and(group)} into one {layer}, which takes one adapter: name "
                        f"{_and(group)} all, or give all-linear")

    @property
    def adapted(self) -> frozenset[str]:
        """The linear layers that carry LoRA adapters (``all-linear`` resolved). In a mixture of
        experts, gate, up and down are each expert's (the dense layers' MLPs carry none, as
        PEFT's ``all-linear`` leaves them) and ``router`` is the router's."""
        if self.lora is None:
            return frozenset()
        if "all-linear" in self.lora.targets:
            return frozenset(("q", "k", "v", "o", "up", "down")
                             + (("gate",) if self.gated else ())
                             + (("router",) if self.experts is not None else ()))
        return frozenset(self.lora.targets)

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate projection (SwiGLU, GeGLU)."""
        return self.mlp != "gelu"

    @property
    def expert_width(self) -> int:
        return self.expert_hidden or self.hidden

    def expert_layer(self, index: int) -> bool:
        """Whether layer ``index``'s MLP is a mixture of experts."""
        return self.experts is not None and index not in self.dense_layers

    def expert_layer_count(self) -> int:
        """How many layers ``expert_layer`` holds, counted without visiting every layer (a
        config may name more layers than could be looped over)."""
        if self.experts is None:
            return 0
        return self.layers - len({i for i in self.dense_layers if 0 <= i < self.layers})

    def local_layer(self, index: int) -> bool:
        """Whether layer ``index`` attends within the sliding window."""
        return self.sliding_window is not None and (
            self.sliding_layers is None or index in self.sliding_layers)

    @property
    def kv_key_heads(self) -> int:
        """Key/value heads: ``kv_heads``, or one per query head."""
        return self.kv_heads or self.heads

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.heads

    @property
    def hidden(self) -> int:
        """The MLP's width."""
        return self.mlp_hidden or self.mlp_ratio * self.d_model


# What a transformer started from a model (``init.from``: a run, a Hugging Face or adapter
# directory) takes from it: the maths and the params' shapes.
ARCHITECTURE = ("vocab", "d_model", "layers", "heads", "kv_heads", "head_dim", "mlp", "mlp_ratio",
                "mlp_hidden", "norm", "norm_eps", "seq_len", "positions", "rope_theta",
                "rope_scaling", "tie_embeddings", "bias", "qkv_bias", "attention_bias",
                "mlp_bias", "qk_norm", "qk_norm_over", "norm_plus_one", "pre_norms",
                "post_norms", "embed_scale", "query_scale", "attention_logit_softcap",
                "final_logit_softcap", "sliding_window", "sliding_layers", "local_rope_theta",
                "experts", "experts_per_token", "expert_hidden", "shared_expert_hidden",
                "router_renormalise", "router_aux_loss", "dense_layers", "fused_projections",
                "pad_id")


ModelConfig = Annotated[
    Union[MLPModel, NNXMLPModel, CNNModel, ResNetModel, TransformerModel],  # noqa: UP007
    Field(discriminator="kind")]


# ---- data ------------------------------------------------------------------------------------

BatchSize = Annotated[int, Field(gt=0)]  # a section that changes the default keeps the bound


class DataSection(Section):
    """How training batches are drawn, the same in every data section.

    batch_size: examples per step, over all processes.
    shuffle: a new order of the examples each epoch (from the run's seed).
    prefetch_threads: host threads loading batches ahead (0: in the loop's thread).
    """

    batch_size: BatchSize = 32
    shuffle: bool = True
    prefetch_threads: int = Field(default=0, ge=0)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        return renamed.upgrade(raw, "the config", root="data")


def data_seed(run_seed: int) -> int:
    """The seed synthetic examples are drawn from when ``data.seed`` is not set: the run's plus
    one (wrapping within jax.random.key's range), so the default run (seed 0) keeps its data
    seed 1 and one ``seed`` changes init, dropout, order and examples together."""
    return (run_seed + 1) % (SEED_MAX + 1)


class RegressionData(DataSection):
    """The chapter's synthetic regression: x ~ N(0, 1) from jax.random.key(seed), y = sum(x).

    seed: the examples' seed; not set, it follows the run's (``data_seed``: ``seed + 1``, the
        resolved config shows the value). A section outside a run: the default run's, 1.
    """

    kind: Literal["regression"] = "regression"
    examples: int = Field(default=256, gt=0)
    features: int = Field(default=8, gt=0)
    seed: int = Field(default=1, ge=0, le=SEED_MAX)
    batch_size: BatchSize = 256
    shuffle: bool = False


class DigitsData(DataSection):
    """scikit-learn's 8x8 digits (1,797 images shipped with it): a fixed split of 1,437 train and
    360 test images, pixels scaled to [0, 1]. Batches: ``x`` [B, 8, 8, 1], ``label`` [B]."""

    kind: Literal["digits"] = "digits"
    batch_size: BatchSize = 64


class MixSource(Section):
    """One source of a data mixture: files by glob (as ``data.paths``) and its share of the
    training rows (weights are relative: 3 and 1 give three rows of the first to one of the
    second)."""

    source: tuple[str, ...]
    weight: float = Field(default=1.0, gt=0)

    @pydantic.field_validator("source", mode="before")
    @classmethod
    def _one_pattern(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value  # `source: "docs/**/*.md"`


class TextData(DataSection):
    """Text files as an LM corpus. No paths: the ``.py`` files of this Python's standard
    library. The last ``eval_fraction`` of the bytes is the held-out split.

    Without ``tokenizer``: bytes, in windows of ``seq_len + 1`` over the joined files
    (``tokens``). With it: each file is a document of ``tokenizer.json`` token ids (the file is
    trained on the training split at first use when missing, with ``vocab_size`` tokens),
    packed into rows of ``seq_len + 1`` with ``segment_ids`` and ``positions``.
    ``mix``: instead of ``paths``, sources with weights; each training batch takes its rows
    from them in proportion to the weights.
    """

    kind: Literal["text"] = "text"
    paths: tuple[str, ...] = ()
    mix: tuple[MixSource, ...] = ()
    tokenizer: str | None = None
    vocab_size: int = Field(default=4096, gt=0)
    seq_len: int = Field(default=128, gt=0)
    eval_fraction: float = Field(default=0.01, gt=0, lt=1)

    @pydantic.model_validator(mode="after")
    def _sources(self) -> TextData:
        if self.paths and self.mix:
            raise ValueError("give data.paths or data.mix, not both (a mix names its own files "
                             "in each source)")
        if self.tokenizer is not None and self.vocab_size < 257:
            raise ValueError(f"vocab_size={self.vocab_size} is below 257: a byte-level "
                             "tokenizer holds the 256 bytes and the document token")
        return self


class ArrayData(DataSection):
    """User arrays: ``paths``, a ``.npz`` file (its arrays by name) or ``{name: file.npy}``;
    every array has one entry per example. ``eval_paths``: the held-out split in the same form
    (optional)."""

    kind: Literal["arrays"] = "arrays"
    paths: str | dict[str, str] | None = None
    eval_paths: str | dict[str, str] | None = None
    batch_size: BatchSize = 64


class TokenData(DataSection):
    """Pre-tokenized text, nanoGPT-style: ``paths``, a flat binary file of token ids (``.bin``),
    read through a memory map; windows of ``seq_len + 1`` tokens. ``eval_paths``: a held-out
    ``.bin``."""

    kind: Literal["tokens"] = "tokens"
    paths: str | None = None
    eval_paths: str | None = None
    dtype: Literal["uint16", "uint32"] = "uint16"
    seq_len: int = Field(default=128, gt=0)


class RecordFields(Section):
    """The names of the record fields each format reads (``prompt`` also a preference pair's
    and a reinforcement-learning prompt's; ``chosen`` and ``rejected`` a pair's answers)."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"
    chosen: str = "chosen"
    rejected: str = "rejected"


class RecordsData(DataSection):
    """Records from JSONL (``.jsonl``, ``.jsonl.gz``) and Parquet files, or a synthetic task
    made on the spot, tokenized and packed into rows of ``seq_len + 1`` with ``segment_ids``,
    ``positions`` and ``loss_mask``: the targets the loss counts.

    batch_size: rows per step, over all processes; a row is packed with as many records as fit
        (with ``format: preference``, as many pairs: a step trains more pairs than rows; the
        run says how many as it starts, and logs each step's count as ``pairs``).
    format: ``text`` (a ``text`` field; every token counts), ``completion`` (``prompt`` and
        ``completion``; the completion counts), ``chat`` (``messages``, rendered with the chat
        template; the assistant turns count), ``preference`` (``prompt``, ``chosen`` and
        ``rejected``, or ``chosen`` and ``rejected`` alone: pairs for preference tuning, the
        ``preference`` section's); ``auto``: from the first record's fields (never
        ``preference``: name it).
    fields: the field names of each format.
    tokenizer: a Hugging Face model directory, a ``tokenizer.json`` or ``bytes``; none given:
        ``init.from``'s model when it is a model or adapter directory, else ``bytes``.
    chat_template: ``chatml``, ``llama3`` or Jinja text, in place of the tokenizer's own.
    loss: ``answers`` (the completion, the assistant turns) or ``all`` tokens.
    eval_paths: held-out record files; none given, every ``1 / eval_fraction``-th record is
        held out (0: no held-out split).
    bad_records: ``refuse`` (the run stops at the first, naming its file and line) or ``skip``
        (they are counted and reported).
    too_long: an example longer than ``seq_len + 1`` tokens is ``cut`` to it, ``dropped``, or
        ``split`` over rows as text documents are; counted either way.
    synthetic: ``reverse``, ``add`` or ``letter``: a synthetic chat task whose answer is a
        function of the prompt, ``synthetic_examples`` records of it (held out as above);
        ``last``: a synthetic preference task (``format: preference``): the last letter of a
        word chosen over another of its letters.
    """

    kind: Literal["records"] = "records"
    paths: tuple[str, ...] = ()
    mix: tuple[MixSource, ...] = ()
    eval_paths: tuple[str, ...] = ()
    format: Literal["auto", "text", "completion", "chat", "preference"] = "auto"
    fields: RecordFields = RecordFields()
    tokenizer: str | None = None
    chat_template: str | None = None
    loss: Literal["answers", "all"] = "answers"
    seq_len: int = Field(default=128, gt=0)
    eval_fraction: float = Field(default=0.01, ge=0, lt=1)
    bad_records: Literal["refuse", "skip"] = "refuse"
    too_long: Literal["cut", "drop", "split"] = "cut"
    synthetic: Literal["reverse", "add", "last", "letter"] | None = None
    synthetic_examples: int = Field(default=4096, gt=0)

    @pydantic.field_validator("paths", "eval_paths", mode="before")
    @classmethod
    def _one_path(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @pydantic.model_validator(mode="after")
    def _sources(self) -> RecordsData:
        given = [name for name, value in (("data.paths", self.paths), ("data.mix", self.mix),
                                          ("data.synthetic", self.synthetic)) if value]
        if len(given) != 1:
            raise ValueError("give one of data.paths (record files), data.mix (record files "
                             "with weights) or data.synthetic (reverse, add, letter, last)"
                             + (f"; got {' and '.join(given)}" if given else ""))
        if (self.synthetic == "last") != (self.synthetic is not None
                                           and self.format == "preference"):
            raise ValueError(f"data.synthetic={self.synthetic} does not make data.format="
                             f"{self.format} records; pair data.synthetic=last with "
                             "data.format=preference, reverse, add or letter with chat")
        return self


class PreferenceConfig(Section):
    """Preference tuning (DPO and its kin) on pairs (``data.format: preference``): the loss
    and its settings, with TRL's defaults (``models/preference_losses.py`` has the formulas).

    loss: ``sigmoid`` (DPO), ``ipo``, ``hinge``, ``robust``, ``simpo`` or ``orpo``.
    beta: the inverse temperature (DPO's KL weight; IPO's tau; ORPO's lambda).
    label_smoothing: the assumed fraction of flipped labels (``sigmoid``, ``robust``,
        ``simpo``).
    simpo_gamma: SimPO's target reward margin.
    nll_weight: weight of the chosen answers' next-token loss added to the loss (TRL's
        ``rpo_alpha``, ``cpo_alpha``).
    max_prompt, max_completion: the most tokens kept of a prompt (its end) and of each
        completion (its start); 0: no limit. A pair is its prompt once, both completions and
        the prompt's last token again, in one row of ``data.seq_len + 1`` tokens: a longer one
        is dropped and counted.
    reference: where the reference model's log-probabilities come from: ``cached`` (computed
        once before training from the starting params, kept on disk beside the rows and read
        as a batch column) or ``in_step`` (computed in each step: the starting params kept in
        the state, or the same params with the LoRA adapters off). The reference-free losses
        (``simpo``, ``orpo``) need none.
    reference_batch_size: rows per forward pass of the cached reference's computation.
    """

    loss: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"] = "sigmoid"
    beta: float = Field(default=0.1, gt=0)
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    simpo_gamma: float = Field(default=0.5, ge=0)
    nll_weight: float = Field(default=0.0, ge=0)
    max_prompt: int = Field(default=512, ge=0)
    max_completion: int = Field(default=0, ge=0)
    reference: Literal["cached", "in_step"] = "cached"
    reference_batch_size: int = Field(default=32, gt=0)

    @pydantic.model_validator(mode="after")
    def _smoothed_losses(self) -> PreferenceConfig:
        if self.label_smoothing and self.loss not in ("sigmoid", "robust", "simpo"):
            raise ValueError(f"preference.label_smoothing applies to the sigmoid, robust and "
                             f"simpo losses, not {self.loss}; set it to 0")
        return self


class RewardModelConfig(Section):
    """Reward modelling on pairs (``data.format: preference``): a scalar score head on the
    transformer, trained with the Bradley-Terry loss ``-log sig(r_chosen - r_rejected)``
    (``models/reward_losses.py``; names and defaults are TRL's ``RewardConfig``'s).

    center_rewards_coefficient: the weight of ``mean((r_chosen + r_rejected)^2)`` added to
        the loss, which pulls the rewards towards mean zero (None: none; TRL suggests 0.01).
    margin: read each record's ``margin`` field and train on ``-log sig(r_chosen - r_rejected
        - margin)``.
    max_prompt, max_completion: the most tokens kept of a prompt (its end) and of each
        completion (its start); 0: no limit. Pairs are packed as preference tuning packs them.
    """

    center_rewards_coefficient: float | None = Field(default=None, ge=0)
    margin: bool = False
    max_prompt: int = Field(default=512, ge=0)
    max_completion: int = Field(default=0, ge=0)


class RewardSpec(Section):
    """One reward of an ``rl`` run: ``name`` a built-in (``exact_match``, ``numeric_answer``,
    ``format_regex``, ``length_penalty``, ``reward_model``) or ``module:function`` (a ``.py``
    file's too), its ``weight`` in the total, and ``args``: a built-in's settings, or keyword
    arguments bound to each call of a function (``data/rewards.py``)."""

    name: str = Field(min_length=1)
    weight: float = 1.0
    args: dict[str, Any] = Field(default_factory=dict)


class CompletionLog(Section):
    """Sampled completions of a reinforcement-learning run, as TRL's ``log_completions``:
    ``count`` completions of the rollout batch of every ``every``-th step (0: none), spread
    over its prompts, each with its prompt, its rewards and its advantage, written to the run
    directory's ``completions.jsonl``."""

    every: int = Field(default=0, ge=0)
    count: int = Field(default=4, gt=0)


class RLConfig(Section):
    """Reinforcement learning with group-relative advantages (GRPO and its variants) on prompt
    records: each step draws ``group`` completions of ``prompts`` prompts from the current
    params, scores them with the rewards and takes ``updates`` optimizer steps on them
    (``models/policy_gradient.py`` has the formulas; defaults are TRL's).

    group: completions per prompt (G).
    prompts: prompts per rollout batch (the batch holds ``prompts x group`` completions).
    completion_tokens: the most tokens a completion has.
    temperature, top_p: sampling (temperature 0: greedy).
    stop_strings: texts that end a completion (besides the tokenizer's turn end).
    rewards: the reward functions, their total weighted by each one's ``weight``.
    reward_timeout: the seconds a reward's call (on one batch's completions) may take before
        the run fails in one line naming it; None: no limit. The default is far beyond any
        reward that returns (``platform/time_limit.py`` says how a call is stopped).
    beta: the KL term's weight to the reference (the starting params, or the base model under
        LoRA adapters); 0: no reference is computed.
    clip_low, clip_high: the ratio's clip range ``[1 - clip_low, 1 + clip_high]``.
    normalisation: ``grpo``, ``dapo`` or ``dr_grpo``.
    updates: optimizer steps per rollout batch (mu); the run's steps count each of them.
    scale_rewards: divide each group's centred rewards by their standard deviation.
    log_completions: sampled completions written to ``completions.jsonl`` (``CompletionLog``).
    """

    group: int = Field(default=8, ge=2)
    prompts: int = Field(default=4, gt=0)
    completion_tokens: int = Field(default=64, gt=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop_strings: tuple[str, ...] = ()
    rewards: tuple[RewardSpec, ...] = Field(min_length=1)
    reward_timeout: float | None = Field(default=3600.0, gt=0)
    beta: float = Field(default=0.0, ge=0)
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    clip_high: float = Field(default=0.2, ge=0)
    normalisation: Literal["grpo", "dapo", "dr_grpo"] = "dapo"
    updates: int = Field(default=1, gt=0)
    scale_rewards: bool = True
    log_completions: CompletionLog = Field(default_factory=CompletionLog)

    @pydantic.field_validator("stop_strings", mode="before")
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @pydantic.field_validator("stop_strings")
    @classmethod
    def _no_empty_stop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not text for text in value):
            raise ValueError("a stop string is empty; give each at least one character")
        return value


DataConfig = Annotated[
    Union[RegressionData, DigitsData, TextData, ArrayData, TokenData, RecordsData],  # noqa: UP007
    Field(discriminator="kind")]


class EvalConfig(Section):
    """Evaluation on the data's held-out split; it never changes the training trajectory."""

    every: int = Field(default=0, ge=0)
    batches: int = Field(default=0, ge=0)
    batch_size: int | None = Field(default=None, gt=0)
    params: Literal["live", "ema"] = "live"  # ema: the moving average (needs optimizer.ema)
    # held-out answers generated and scored at each evaluation (runs on chat or completion
    # records): the split's first so many, each at most answer_tokens long
    generate: int = Field(default=0, ge=0)
    answer_tokens: int = Field(default=64, gt=0)


# ---- optimizer -------------------------------------------------------------------------------


class ConstantSchedule(Section):
    """``optimizer.lr`` at every step."""

    kind: Literal["constant"] = "constant"


def _fraction_or_steps(value: Any) -> Any:
    if isinstance(value, bool) or (isinstance(value, float) and value >= 1):
        raise ValueError(f"{value!r} is neither a fraction of the run below 1 nor a whole "
                         "number of steps; give e.g. 0.1 (a tenth of the run) or 100")
    return value


# A fraction in (0, 1) of the schedule's steps (0.1: the first tenth of the run, to the nearest
# step), or a whole number of steps (100); 0: no warm-up.
Warmup = Annotated[int | float, Field(ge=0), pydantic.BeforeValidator(_fraction_or_steps)]


class WarmedSchedule(Section):
    """A schedule that starts with a linear warm-up from ``init_lr`` to ``optimizer.lr`` over
    ``warmup`` (a fraction of the run, or steps)."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        return renamed.upgrade(raw, "the config", root="optimizer.schedule")


class WarmupSchedule(WarmedSchedule):
    """Linear from ``init_lr`` to ``optimizer.lr`` over ``warmup``, then constant."""

    kind: Literal["warmup"] = "warmup"
    warmup: Warmup = 100
    init_lr: float = Field(default=0.0, ge=0)


class CosineSchedule(WarmedSchedule):
    """Linear warmup to ``optimizer.lr``, then cosine decay reaching ``end_lr`` at the run's
    last step. ``total_steps`` (null: the run's ``steps``) gives the schedule a length of its
    own, for a run stopped before its schedule ends."""

    kind: Literal["cosine"] = "cosine"
    warmup: Warmup = 0
    total_steps: int | None = Field(default=None, gt=0)
    init_lr: float = Field(default=0.0, ge=0)
    end_lr: float = Field(default=0.0, ge=0)


class ExponentialSchedule(WarmedSchedule):
    """Linear warmup to ``optimizer.lr``, then ``lr * decay_rate ** (t / transition_steps)``
    (``t`` counted from the end of warmup; floored at ``end_lr`` when given)."""

    kind: Literal["exponential"] = "exponential"
    warmup: Warmup = 0
    init_lr: float = Field(default=0.0, ge=0)
    transition_steps: int = Field(default=1000, gt=0)
    decay_rate: float = Field(default=0.96, gt=0)
    staircase: bool = False
    end_lr: float | None = Field(default=None, ge=0)


class WSDSchedule(WarmedSchedule):
    """Warmup-stable-decay: linear warmup to ``optimizer.lr``, hold it, then decay to ``end_lr``
    over the last ``decay_fraction`` of the run (``total_steps``: as cosine's)."""

    kind: Literal["wsd"] = "wsd"
    warmup: Warmup = 0
    total_steps: int | None = Field(default=None, gt=0)
    decay_fraction: float = Field(default=0.2, gt=0, le=1)
    decay: Literal["linear", "cosine", "sqrt"] = "linear"
    init_lr: float = Field(default=0.0, ge=0)
    end_lr: float = Field(default=0.0, ge=0)


class PiecewiseSchedule(Section):
    """``optimizer.lr`` multiplied by ``scales[i]`` from step ``boundaries[i]`` on (cumulative)."""

    kind: Literal["piecewise"] = "piecewise"
    boundaries: list[int] = Field(default_factory=list)
    scales: list[float] = Field(default_factory=list)

    @pydantic.model_validator(mode="after")
    def _pairs(self) -> PiecewiseSchedule:
        if len(self.boundaries) != len(self.scales):
            raise ValueError(f"{len(self.boundaries)} boundaries but {len(self.scales)} scales; "
                             "give one scale per boundary")
        if any(b <= 0 for b in self.boundaries) or self.boundaries != sorted(set(self.boundaries)):
            raise ValueError(f"boundaries {self.boundaries} must be positive steps in increasing "
                             "order")
        if any(s < 0 for s in self.scales):
            raise ValueError(f"scales {self.scales} must be >= 0")
        return self


ScheduleConfig = Annotated[
    Union[ConstantSchedule, WarmupSchedule, CosineSchedule,  # noqa: UP007
          ExponentialSchedule, WSDSchedule, PiecewiseSchedule], Field(discriminator="kind")]


def schedule_steps(schedule: ScheduleConfig, run_steps: int) -> int:
    """The schedule's length: its ``total_steps`` where it has one, else the run's steps."""
    return getattr(schedule, "total_steps", None) or run_steps


def warmup_steps(schedule: ScheduleConfig, total: int | None) -> int:
    """The schedule's warm-up in steps, out of ``total`` (its length; needed for a fraction)."""
    return warmup_in_steps(getattr(schedule, "warmup", 0), total)


def warmup_in_steps(warmup: float, total: int | None) -> int:
    """A warm-up (whole steps, or a fraction of ``total``, the schedule's length) in steps."""
    if isinstance(warmup, int):
        return warmup
    if total is None:
        raise ValueError(f"optimizer.schedule.warmup={warmup} is a fraction of the run: give "
                         "the run's length")
    return int(warmup * total + 0.5)  # to the nearest step, halves up


class OptimizerConfig(Section):
    name: Literal["adam", "adamw", "sgd", "lion"] = "adam"
    lr: float = Field(default=1e-3, gt=0)
    schedule: ScheduleConfig = Field(default_factory=ConstantSchedule)
    clip_norm: float | None = Field(default=None, gt=0)
    b1: float = 0.9
    b2: float = 0.999
    # Adam divides by sqrt(nu) + eps: 0 gives 0/0 at a zero gradient
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    momentum: float = Field(default=0.0, ge=0)
    # Regexes searched in each param's dotted path (``blocks.0.attn.q.kernel``): only matching
    # params are updated, the rest frozen with no optimizer state. None: every param (with
    # model.lora: the adapters only).
    trainable: list[str] | None = None
    # Decay of an exponential moving average of the params kept in the state (checkpointed,
    # resumed bit for bit): ema = decay * ema + (1 - decay) * params after each applied update.
    ema: float | None = Field(default=None, gt=0, lt=1)

    @pydantic.field_validator("trainable")
    @classmethod
    def _valid_patterns(cls, value: list[str] | None) -> list[str] | None:
        import re

        for pattern in value or []:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"{pattern!r} is not a regular expression: {err}") from None
        if value is not None and not value:
            raise ValueError("an empty list freezes every param; give at least one pattern")
        return value


# ---- where a fresh run starts ----------------------------------------------------------------


class InitConfig(Section):
    """``from``: start a fresh run (one without checkpoints) from another run's newest
    checkpoint, a Hugging Face model directory (``huggingface.MODEL_TYPES``), a PEFT adapter
    directory or a ``.safetensors`` file instead of random init
    (``trainrun.checkpointing.init_from``). ``load``: ``params`` takes the params only (a
    fine-tune: new optimizer state, step 0); ``state`` takes a run's whole state (a fork: its
    optimizer moments, step and key; the data starts from its beginning). A run that resumes
    from its own checkpoint ignores both."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              serialize_by_alias=True, allow_inf_nan=False)

    from_: str | None = Field(default=None, alias="from")
    load: Literal["params", "state"] = "params"

    @property
    def model_source(self) -> str | None:
        """``from`` where it names a model, which gives the run its architecture (and records
        their tokenizer): a run, a Hugging Face or adapter directory; None for none, or a bare
        ``.safetensors`` file."""
        return self.from_ if self.from_ is not None and names_a_model(self.from_) else None


def names_a_model(source: str) -> bool:
    """Whether an ``init.from`` names a model (a directory) rather than a bare weights file."""
    return not source.endswith(".safetensors")


# ---- precision -------------------------------------------------------------------------------


class PrecisionConfig(Section):
    """dtypes of the stored params, of the model's computation, and of its loss; the dynamic
    loss scale used with float16 compute."""

    params: Literal["float32", "bfloat16"] = "float32"
    compute: Literal["float32", "bfloat16", "float16"] = "float32"
    output: Literal["float32", "bfloat16", "float16"] = "float32"
    loss_scale: float = Field(default=2.0**15, gt=0)
    loss_scale_growth_interval: int = Field(default=2000, gt=0)
    loss_scale_factor: float = Field(default=2.0, gt=1)


# ---- checkpoints -----------------------------------------------------------------------------


class CheckpointConfig(Section):
    """Whole-state checkpoints (state, data position, metadata) through Orbax, saved every
    ``every`` steps or every ``every_seconds``, whichever comes first, and always at the end
    and when the run stops (``checkpoint_policy.py``).

    every: steps between checkpoints; 0: none by steps.
    every_seconds: seconds between checkpoints; 0: none by time. The default saves a small
        model only at its end, a large one every five minutes.
    keep: how many of the latest committed checkpoints are kept.
    keep_best: ``eval/<metric>``: also save at every evaluation and keep the best one by that
        metric (beside the latest ``keep``); needs ``eval.every``.
    keep_best_mode: ``min`` (a loss) or ``max`` (an accuracy).
    async: write in the background; the loop blocks only while the state is copied out.
    dir: where step directories go (default ``<run dir>/checkpoints``).
    """

    # ``async`` is a Python keyword: the field is ``async_``, read and written as ``async``.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              serialize_by_alias=True)

    every: int = Field(default=0, ge=0)
    every_seconds: float = Field(default=300.0, ge=0)
    keep: int = Field(default=3, gt=0)
    keep_best: str | None = None
    keep_best_mode: Literal["min", "max"] = "min"
    async_: bool = Field(default=True, alias="async")
    dir: str | None = None

    @pydantic.field_validator("keep_best")
    @classmethod
    def _eval_metric(cls, name: str | None) -> str | None:
        if name is not None and (not name.startswith("eval/") or name == "eval/"):
            raise ValueError("keep_best names an eval metric, e.g. eval/loss or eval/accuracy")
        return name


# ---- placement: mesh and processes -----------------------------------------------------------


MESH_AXES = ("data", "fsdp", "expert", "tensor")  # the device mesh's axes, in its order
BATCH_AXES = ("data", "fsdp", "expert")  # the mesh axes a batch's examples are split over


class MeshConfig(Section):
    """The device mesh: a size per axis, or -1 for the devices the other axes leave. By default
    every device (of every process) is on ``data``: plain data parallelism."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1  # a mixture's experts split over it; the batch too, as over data
    tensor: int = 1
    fsdp_min_size: int = Field(default=16384, ge=0)
    tensor_axes: list[str] = Field(default_factory=lambda: ["mlp", "heads", "kv_heads", "vocab"])

    @pydantic.field_validator("data", "fsdp", "expert", "tensor")
    @classmethod
    def _size(cls, size: int) -> int:
        if size == 0 or size < -1:
            raise ValueError("an axis size is a number of devices >= 1, or -1 for the rest")
        return size


class SingleProcess(Section):
    """One process driving the devices it sees."""

    kind: Literal["none"] = "none"


class AutoDistributed(Section):
    """Processes found by ``jax.distributed.initialize()``'s cluster detection (SLURM, Open MPI,
    Cloud TPU, ...). A process silent for ``peer_timeout_s`` is taken as lost: the others stop
    with an error naming it (JAX's own heartbeat, at twice that, is the backstop)."""

    kind: Literal["auto"] = "auto"
    peer_timeout_s: float = Field(default=20.0, gt=0)
    init_timeout_s: int = Field(default=300, gt=0)


class ExplicitDistributed(AutoDistributed):
    """Processes named by hand: the coordinator's host:port, the process count, this one's id."""

    kind: Literal["explicit"] = "explicit"  # type: ignore[assignment]
    coordinator: str | None = None
    num_processes: int | None = Field(default=None, gt=0)
    process_id: int | None = Field(default=None, ge=0)


DistributedConfig = Annotated[
    Union[SingleProcess, AutoDistributed, ExplicitDistributed],  # noqa: UP007
    Field(discriminator="kind")]


# ---- what the run writes --------------------------------------------------------------------


SAVED = "saved"  # the validation context of a config a run wrote, read back to use its model


def _to_train(info: pydantic.ValidationInfo) -> bool:
    """Whether the config is validated to train with: a saved one read back does not need the
    metric sinks its run wrote to."""
    return not (info.context or {}).get(SAVED, False)


class MetricsConfig(Section):
    """How often training metrics are read and shown, where they go besides ``metrics.jsonl``
    (always written, a row per step), and how they leave the device.

    every: steps between reads of the metrics off the device, each a console line (and a
        W&B row); the loop waits for the device only there.
    stream: with steps_per_call > 1, send each step's metrics to the host from inside the fused
        call (an ordered io_callback) instead of when the call is done.
    tensorboard: TensorBoard event files in ``<run dir>/tensorboard``; ``auto`` (the default):
        where the tensorboard extra is installed (``pip install 'trainrun[tensorboard]'``).
    wandb: Weights & Biases: ``off``, ``offline`` (files under the run dir, no network) or
        ``online``; needs the wandb extra.
    """

    every: int = Field(default=50, gt=0)
    stream: bool = False
    tensorboard: bool = Field(default_factory=lambda: extras.installed("tensorboard"))
    wandb: Literal["off", "offline", "online"] = "off"
    wandb_project: str = "trainrun"

    @pydantic.field_validator("wandb", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @pydantic.field_validator("tensorboard", mode="before")
    @classmethod
    def _tensorboard_auto(cls, value: Any) -> Any:
        return extras.installed("tensorboard") if value == "auto" else value

    @pydantic.field_validator("tensorboard")
    @classmethod
    def _tensorboard_installed(cls, value: bool, info: pydantic.ValidationInfo) -> bool:
        if value and _to_train(info) and not extras.installed("tensorboard"):
            raise ValueError(extras.message("tensorboard", "true") + ", or set it false")
        return value

    @pydantic.field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, value: str, info: pydantic.ValidationInfo) -> str:
        if value != "off" and _to_train(info) and not extras.installed("wandb"):
            raise ValueError(extras.message("wandb", repr(value)) + ", or set metrics.wandb=off")
        return value


class StorageConfig(Section):
    """How a run keeps its directory on object storage (``gs://``, ``s3://``;
    ``storage/remote.py``); a local run directory ignores it.

    lease_s: how long the run's lock holds without renewal. The run renews it four times per
        lease; a job whose process died leaves it to expire, and another may then take it.
    deadline_s: how long requests may keep failing for reasons that may pass (the store not
        answering, errors 5xx) before the run stops in one line, status ``failed``, at its last
        committed checkpoint. A request's wait for an answer ends by then (2 s at least).
    sync_every_s: the most seconds between uploads of the appended files (``metrics.jsonl``,
        ``timing.jsonl``, TensorBoard events), which also go up at each checkpoint and at the end.
    """

    lease_s: float = Field(default=60.0, ge=5)
    deadline_s: float = Field(default=300.0, gt=0)
    sync_every_s: float = Field(default=30.0, gt=0)


class ProfileConfig(Section):
    """``steps: [a, b]`` writes a jax.profiler trace of steps a..b to ``<run dir>/profile``;
    empty (the default) traces nothing."""

    steps: list[int] = Field(default_factory=list)

    @pydantic.field_validator("steps")
    @classmethod
    def _window(cls, steps: list[int]) -> list[int]:
        if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise ValueError("give two step numbers [first, last] with 1 <= first <= last, "
                             "e.g. profile.steps=[10,20]")
        return steps
