"""Greedy decoding tokens/s: trainrun's batched generation against transformers' ``generate``
on the same Llama-shaped model, side by side in one process.

    python benchmarks/decode_speed.py [--layers 8] [--batches 1,16] [--new 64] [--rounds 3]

The model is a random Llama (d_model 768, 12 query heads sharing 4 key/value heads, SwiGLU
2048, RMSNorm, rotary positions, a 32000-token vocabulary, an untied head: about 100M params
at 8 layers) written as a Hugging Face directory; trainrun reads it with ``trainrun.load`` and
transformers with ``from_pretrained``, both in float32. Each batch holds prompts of different
lengths (the longest ``--prompt`` tokens; transformers gets them left-padded with their
attention mask). Each round times every contender once, interleaved, after a warmup call
(trainrun's compile is in the warmup, not in the figure); tokens/s is ``batch x new`` tokens
over the wall time of one ``generate`` call, trainrun's results read back to the host.
torch runs on as many threads as the CPUs XLA uses. Both outputs are checked token for token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import torch
import transformers

import trainrun
from trainrun.platform.process import configure_process


def llama_dir(path: Path, layers: int) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    return path


def prompts_of(batch: int, longest: int) -> list[np.ndarray]:
    rng = np.random.default_rng(batch)
    lengths = [longest, *rng.integers(longest // 2, longest + 1, batch - 1).tolist()]
    return [rng.integers(3, 32000, n) for n in lengths]


def torch_generate(model, prompts: list[np.ndarray], new: int) -> list[np.ndarray]:
    width = max(p.size for p in prompts)
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.size:], mask[row, width - prompt.size:] = prompt, 1
    with torch.no_grad():
        out = model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return [row[width:] for row in out.numpy()]


def main() -> None:
    configure_process()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt", type=int, default=32, help="the longest prompt's tokens")
    parser.add_argument("--new", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = llama_dir(Path(tmp) / "llama", args.layers)
        ours = trainrun.load(path, context=args.prompt + args.new)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).eval()
        theirs.generation_config.eos_token_id = None
        count = sum(np.asarray(x).size for x in jax.tree.leaves(ours.params))
        print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, torch "
              f"{torch.__version__} ({torch.get_num_threads()} threads), transformers "
              f"{transformers.__version__}; Llama {args.layers} layers, {count / 1e6:.0f}M "
              f"params, prompts up to {args.prompt} tokens, {args.new} new; best and median "
              f"of {args.rounds} interleaved rounds\n")
        print("| batch | trainrun tok/s best / median | transformers tok/s best / median "
              "| ratio (best) |")
        print("|---:|---:|---:|---:|")
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = prompts_of(batch, args.prompt)
            contenders = {
                "trainrun": lambda p=prompts, b=batch: ours.generate_batch(p, args.new,
                                                                          batch_size=b),
                "transformers": lambda p=prompts: torch_generate(theirs, p, args.new)}
            outputs = {name: fn() for name, fn in contenders.items()}  # warmup, compile
            same = all(np.array_equal(a, b) for a, b in zip(*outputs.values(), strict=True))
            rates: dict[str, list[float]] = {name: [] for name in contenders}
            for _ in range(args.rounds):
                for name, fn in contenders.items():
                    start = time.perf_counter()
                    fn()
                    rates[name].append(batch * args.new / (time.perf_counter() - start))
            best = {name: max(r) for name, r in rates.items()}
            cells = [f"{best[n]:,.0f} / {statistics.median(rates[n]):,.0f}" for n in rates]
            print(f"| {batch} | {cells[0]} | {cells[1]} | "
                  f"{best['trainrun'] / best['transformers']:.2f}x |"
                  + ("" if same else "  (outputs differ)"))


if __name__ == "__main__":
    main()
