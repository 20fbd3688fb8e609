"""trainrun's transformer LM written in PyTorch the nanoGPT way, with its training step: the other
side of ``benchmarks/gpu_lm.py``.

    python benchmarks/torch_gpt.py [--steps 3]        # a tiny model on the CPU: a quick check

The model is trainrun's (``trainrun.models.transformer``): pre-LayerNorm (LayerNorm with a bias,
eps 1e-5), rotary positions on queries and keys (the same halves convention), causal attention
through ``F.scaled_dot_product_attention(is_causal=True)`` (flash attention on a GPU), a
tanh-GELU MLP of 4 x d_model, no biases in the matmuls, tied input and output embeddings; normal
init with std 0.02, and 0.02 / sqrt(2 x layers) on the residual projections. As nanoGPT writes
it: one fused query/key/value matmul, ``torch.compile`` of the model, bfloat16 autocast around
the forward pass (float32 master weights), the fused AdamW (decay on matrices only) and the
gradient norm computed every step (trainrun's step reports it too).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    vocab: int = 50304
    d_model: int = 768
    layers: int = 12
    heads: int = 12
    seq_len: int = 1024
    mlp_ratio: int = 4
    init_std: float = 0.02


TINY = Shape(vocab=512, d_model=64, layers=2, heads=2, seq_len=64)


def _linear(d_in: int, d_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(d_in, d_out, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


class Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        d, residual_std = s.d_model, s.init_std / math.sqrt(2 * s.layers)
        self.heads, self.head_dim = s.heads, d // s.heads
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
        self.qkv = _linear(d, 3 * d, s.init_std)
        self.o = _linear(d, d, residual_std)
        self.up = _linear(d, s.mlp_ratio * d, s.init_std)
        self.down = _linear(s.mlp_ratio * d, d, residual_std)

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, self.head_dim).unbind(2)

        def rotate(y: torch.Tensor) -> torch.Tensor:  # [b, t, heads, head_dim]
            # the tables in y's dtype, as trainrun does (float32 ones would promote q and k)
            s, c = sin.to(y.dtype), cos.to(y.dtype)
            y1, y2 = y[..., : self.head_dim // 2], y[..., self.head_dim // 2:]
            return torch.cat([y1 * c - y2 * s, y1 * s + y2 * c], dim=-1)

        q, k, v = rotate(q).transpose(1, 2), rotate(k).transpose(1, 2), v.transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.shape = s
        self.embed = nn.Embedding(s.vocab, s.d_model)
        nn.init.normal_(self.embed.weight, std=s.init_std)
        self.blocks = nn.ModuleList([Block(s) for _ in range(s.layers)])
        self.ln_f = nn.LayerNorm(s.d_model, eps=1e-5)
        head_dim = s.d_model // s.heads
        freqs = 10_000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.arange(s.seq_len, dtype=torch.float32)[:, None] * freqs[None]
        self.register_buffer("sin", torch.sin(angles)[:, None, :], persistent=False)
        self.register_buffer("cos", torch.cos(angles)[:, None, :], persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``tokens`` ``[batch, seq_len + 1]``."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        t = inputs.shape[1]
        sin, cos = self.sin[:t], self.cos[:t]
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x, sin, cos)
        logits = self.ln_f(x) @ self.embed.weight.T  # the tied head
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class TorchTrainer:
    """The model and its AdamW on ``device``; ``run(tokens)`` trains one step per row of
    ``tokens`` ``[k, batch, seq_len + 1]`` and returns the last loss (a blocking read)."""

    def __init__(self, shape: Shape, device: str, *, lr: float = 6e-4, b1: float = 0.9,
                 b2: float = 0.95, weight_decay: float = 0.1, compile: bool = True,
                 bf16: bool = True, seed: int = 0):
        torch.manual_seed(seed)
        self.device, self.bf16 = device, bf16
        self.model = self.build(shape).to(device)
        self.params = param_count(self.model)
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        fused = device.startswith("cuda")
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=(b1, b2), eps=1e-8, fused=fused)
        self.forward = torch.compile(self.model) if compile else self.model
        self.grad_norm = float("nan")

    def build(self, shape: Shape) -> nn.Module:
        """The model to train (``torch_llama.LlamaTrainer`` gives its own)."""
        return GPT(shape)

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.split(":")[0], dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.forward(batch)
        loss.backward()
        # the norm as nanoGPT computes it for clipping (no clipping: trainrun's step has none)
        self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def run(self, tokens: torch.Tensor) -> float:
        for batch in tokens:
            loss = self.step(batch)
        return float(loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="eager PyTorch")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = TINY if device == "cpu" else Shape()
    trainer = TorchTrainer(shape, device, compile=not args.no_compile)
    tokens = torch.randint(0, shape.vocab, (args.steps, 4, shape.seq_len + 1), device=device)
    start = time.perf_counter()
    loss = trainer.run(tokens)
    print(f"{device}: {trainer.params:,} params, {args.steps} steps in "
          f"{time.perf_counter() - start:.2f} s (compile included), last loss {loss:.4f} "
          f"(ln vocab {math.log(shape.vocab):.4f}), grad norm {float(trainer.grad_norm):.4f}")


if __name__ == "__main__":
    main()
