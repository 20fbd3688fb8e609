"""trainrun's Llama-family transformer written in PyTorch the nanoGPT way, with its training step:
the other side of ``benchmarks/gpu_llama.py``.

    python benchmarks/torch_llama.py [--steps 3]      # a tiny model on the CPU: a quick check

The model is trainrun's ``trainrun.models.transformer`` with ``model.norm=rmsnorm
model.mlp=swiglu model.kv_heads=...`` (no dropout, no biases): pre-RMSNorm blocks, rotary
positions on queries and keys (trainrun's halves convention, base ``rope_theta``), grouped-query
attention (each key/value head repeated for its group of query heads, as trainrun does before
``scaled_dot_product_attention(is_causal=True)``, flash attention on a GPU), a SwiGLU MLP
``down(silu(gate(x)) * up(x))``, and the output head tied to the embedding table (Llama 3.2
1B's ``tie_word_embeddings``) or a table of its own. Init as trainrun's: normal with std 0.02,
0.02 / sqrt(2 x layers) on the residual projections (o, down), RMSNorm scales at one.

Precision as trainrun's policy (``precision.compute=bfloat16``): float32 master weights, which
the optimizer updates; the forward pass in bfloat16, the residual stream included (the
embedding's rows are cast, as trainrun casts every param to the compute dtype before the
model); RMSNorm's statistics in float32 and its output in bfloat16 (flax's ``nnx.RMSNorm``);
the rotary tables in bfloat16; the loss in float32. Autocast does the casts of the matmuls'
weights (and their gradients back to float32); the residual stream it would leave in float32,
hence the explicit cast of the embedding's rows. One difference is left: trainrun's head
returns float32 logits from the bfloat16 GEMM's float32 accumulator (and runs the head and
loss in chunks of tokens); here the head's GEMM rounds them to bfloat16 and ``.float()``
widens them, as nanoGPT's does.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch_gpt import TorchTrainer, _linear, param_count


@dataclass(frozen=True)
class LlamaShape:
    """Llama 3.2 1B's shape by default (1.24B params)."""

    vocab: int = 128256
    d_model: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    hidden: int = 8192
    seq_len: int = 2048
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02


TINY = LlamaShape(vocab=512, d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, hidden=192,
                  seq_len=64)


class RMSNorm(nn.Module):
    """flax ``nnx.RMSNorm`` under trainrun's policy: the scale cast to ``x``'s dtype (as the
    policy casts every param), ``x * rsqrt(mean(x²) + eps) * scale`` in float32, the result in
    ``x``'s dtype."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        mul = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (mul * self.weight.to(x.dtype).float())).to(x.dtype)


class Block(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        d, std = s.d_model, s.init_std
        residual_std = std / math.sqrt(2 * s.layers)
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.ln1, self.ln2 = RMSNorm(d, s.norm_eps), RMSNorm(d, s.norm_eps)
        # q, k, v as one matmul (nanoGPT's fused layout); the same FLOPs as trainrun's three
        self.qkv = _linear(d, (s.heads + 2 * s.kv_heads) * s.head_dim, std)
        self.o = _linear(s.heads * s.head_dim, d, residual_std)
        self.gate = _linear(d, s.hidden, std)
        self.up = _linear(d, s.hidden, std)
        self.down = _linear(s.hidden, d, residual_std)

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        q, k, v = self.qkv(self.ln1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim,
             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        v = v.view(b, t, self.kv_heads, self.head_dim)

        def rotate(y: torch.Tensor) -> torch.Tensor:  # [b, t, heads, head_dim]
            # the tables in y's dtype, as trainrun does (float32 ones would promote q and k)
            s, c = sin.to(y.dtype), cos.to(y.dtype)
            y1, y2 = y[..., : self.head_dim // 2], y[..., self.head_dim // 2:]
            return torch.cat([y1 * c - y2 * s, y1 * s + y2 * c], dim=-1)

        q, k, v = rotate(q).transpose(1, 2), rotate(k).transpose(1, 2), v.transpose(1, 2)
        group = self.heads // self.kv_heads
        if group > 1:  # query head h reads key/value head h // group: trainrun's jnp.repeat
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        h = self.ln2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, s: LlamaShape, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.shape, self.compute_dtype = s, compute_dtype
        self.embed = nn.Embedding(s.vocab, s.d_model)
        nn.init.normal_(self.embed.weight, std=s.init_std)
        self.blocks = nn.ModuleList([Block(s) for _ in range(s.layers)])
        self.ln_f = RMSNorm(s.d_model, s.norm_eps)
        self.head = None
        if not s.tie_embeddings:
            self.head = nn.Parameter(torch.empty(s.vocab, s.d_model))
            nn.init.normal_(self.head, std=s.init_std)
        freqs = 1.0 / s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32)
                                       / s.head_dim)
        angles = torch.arange(s.seq_len, dtype=torch.float32)[:, None] * freqs[None]
        self.register_buffer("sin", torch.sin(angles)[:, None, :], persistent=False)
        self.register_buffer("cos", torch.cos(angles)[:, None, :], persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``tokens`` ``[batch, seq_len + 1]``."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        t = inputs.shape[1]
        sin, cos = self.sin[:t], self.cos[:t]
        x = self.embed(inputs)
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)  # the residual stream in the compute dtype
        for block in self.blocks:
            x = block(x, sin, cos)
        table = self.embed.weight if self.head is None else self.head
        logits = F.linear(self.ln_f(x), table)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class LlamaTrainer(TorchTrainer):
    """``torch_gpt.TorchTrainer`` (torch.compile, bf16 autocast, fused AdamW with decay on
    matrices, the grad norm every step) around the Llama-shaped model."""

    def build(self, shape: LlamaShape) -> nn.Module:  # type: ignore[override]
        return Llama(shape, torch.bfloat16 if self.bf16 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="eager PyTorch")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = TINY if device == "cpu" else LlamaShape()
    trainer = LlamaTrainer(shape, device, compile=not args.no_compile)
    tokens = torch.randint(0, shape.vocab, (args.steps, 4, shape.seq_len + 1), device=device)
    start = time.perf_counter()
    loss = trainer.run(tokens)
    print(f"{device}: {param_count(trainer.model):,} params, {args.steps} steps in "
          f"{time.perf_counter() - start:.2f} s (compile included), last loss {loss:.4f} "
          f"(ln vocab {math.log(shape.vocab):.4f}), grad norm {float(trainer.grad_norm):.4f}")


if __name__ == "__main__":
    main()
