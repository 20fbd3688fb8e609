"""lm-evaluation-harness wall time: trainrun's model class against lm-eval's ``hf`` class on
one exported model, on three local tasks (multiple choice, rolling perplexity, generation).

    python benchmarks/lm_eval_speed.py [--rounds 3] [--docs 40] [--cores 2] [--d-model 64]
        [--layers 2] [--export DIR | --llama] [--batch-size 16] [--commands]

Without ``--export``, a small GPT-2-shaped model on a BPE tokenizer is trained here for a few
steps on text made here, and exported as ``trainrun export`` writes it; with it, any Hugging
Face model directory with a tokenizer.json that ``trainrun.load`` reads. The tasks' data are
JSONL files written in a temporary folder from that text: nothing is downloaded.

With ``--llama``, a random Llama-layout directory (8 layers, 512 wide, grouped queries, about
24M params) saved by transformers, with the same tokenizer.

Each class is built once (the load is timed apart), then every round evaluates each task with
each class in turn, interleaved, through ``lm_eval.simple_evaluate``; the table gives the first
round (trainrun's compiles in it) and the best of the rounds after. With ``--commands``, what a
user waits for instead: the whole command, ``trainrun lm-eval --model trainrun`` with an empty
compiled-program cache and again with the one it filled, against ``lm_eval --model hf``, all
three tasks in one command, interleaved in each round. Both run on the first
``--cores`` cores (the process's CPU affinity, set before JAX starts, and PyTorch's thread
count). The tasks' main metric is printed for both: they should agree.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORDS = ["the", "cat", "dog", "bird", "sat", "ran", "sang", "on", "in", "a", "mat", "park",
         "song", "tree", "house", "red", "blue", "small", "big", "fast", "slow", "and", "then"]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--docs", type=int, default=40, help="documents per task (default 40)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="cores both classes run on (default: all)")
    parser.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    parser.add_argument("--export", type=Path, default=None,
                        help="a Hugging Face model directory to score instead of training one")
    parser.add_argument("--batch-size", default="16",
                        help="requests per forward pass for both classes (default 16)")
    parser.add_argument("--max-gen-toks", type=int, default=16,
                        help="most tokens generated per request (default 16)")
    parser.add_argument("--llama", action="store_true",
                        help="score a random Llama-layout directory of about 24M params")
    parser.add_argument("--commands", action="store_true",
                        help="time whole commands (cold and warm cache) instead of classes")
    args = parser.parse_args()
    if args.rounds < 1 or args.docs < 2 or not 1 <= args.cores <= (os.cpu_count() or 1):
        parser.error(f"give --rounds >= 1, --docs >= 2 and --cores from 1 to {os.cpu_count()}")
    return args


def text(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize()
                    + "." for _ in range(sentences))


def make_model(folder: Path, d_model: int, layers: int) -> Path:
    """A GPT-2-shaped run on a BPE tokenizer trained here, exported."""
    from trainrun.cli import main
    from trainrun.config import load_config
    from trainrun.training.loop import run

    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(text(i, 8) for i in range(200)))
    heads = max(1, d_model // 32)
    config = load_config("lm_bpe", [
        "steps=40", "steps_per_call=20", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup=1", "metrics.tensorboard=false",
        f"model.d_model={d_model}", f"model.layers={layers}", f"model.heads={heads}",
        "model.seq_len=256", "model.positions=learned", "model.bias=true", "model.vocab=512",
        f"data.paths=[{corpus}]", "data.seq_len=256", "data.batch_size=8",
        f"data.tokenizer={folder / 'tok.json'}", "data.vocab_size=512"])
    run(config, folder / "run", out=io.StringIO())
    if main(["export", str(folder / "run"), "--to", str(folder / "export")]) != 0:
        sys.exit("the export failed")
    return folder / "export"


def make_llama(folder: Path, export: Path) -> Path:
    """A random Llama-layout directory saved by transformers, with ``export``'s tokenizer."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    path = folder / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    shutil.copy(export / "tokenizer.json", path / "tokenizer.json")
    end = json.loads((export / "tokenizer.json").read_text())["added_tokens"][0]["content"]
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": end, "eos_token": end}))
    return path


def time_commands(args: argparse.Namespace, folder: Path, export: Path,
                  tasks: list[str]) -> None:
    """Whole commands, as a user runs them: trainrun's class from an empty compiled-program
    cache and from the one it filled, and hf's, interleaved in every round."""
    import subprocess

    bin_dir = Path(sys.executable).parent
    common = ["--tasks", ",".join(tasks), "--include_path", str(folder / "tasks"),
              "--batch_size", str(args.batch_size)]
    commands = {
        "trainrun (cold)": [str(bin_dir / "trainrun"), "lm-eval", "--model", "trainrun",
                            "--model_args", f"path={export}", *common],
        "trainrun (warm)": [str(bin_dir / "trainrun"), "lm-eval", "--model", "trainrun",
                            "--model_args", f"path={export}", *common],
        "hf": [str(bin_dir / "lm_eval"), "--model", "hf", "--model_args",
               f"pretrained={export},dtype=float32", "--device", "cpu", *common]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for round_ in range(args.rounds):
        cache = folder / f"cache-{round_}"  # empty for the cold command, filled by it
        for name, command in commands.items():
            env = {**os.environ, "TRAINRUN_CACHE_DIR": str(cache)}
            start = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            times[name].append(time.perf_counter() - start)
            if done.returncode != 0:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    hf = min(times["hf"])
    print(f"\n{export}: {args.docs} documents per task, {args.cores} core(s), batch size "
          f"{args.batch_size}, {args.rounds} round(s), whole commands")
    print(f"{'command':<18} {'best':>8} {'median':>8} {'hf / it (best)':>15}")
    for name, seconds in times.items():
        print(f"{name:<18} {min(seconds):>6.2f} s {sorted(seconds)[len(seconds) // 2]:>6.2f} s "
              f"{hf / min(seconds):>14.2f}x")


def write_tasks(folder: Path, docs: int, max_gen_toks: int) -> list[str]:
    """The three tasks' YAML and JSONL files in ``folder``; their names."""
    rng = random.Random(0)
    rows: dict[str, list[dict[str, Any]]] = {"speed_mc": [], "speed_ppl": [], "speed_gen": []}
    for i in range(docs):
        words = text(1000 + i, 2).split()
        cut = len(words) // 2
        others = [" " + " ".join(text(5000 + 4 * i + k, 1).split()[:len(words) - cut])
                  for k in range(3)]
        answer = rng.randrange(4)
        choices = [*others[:answer], " " + " ".join(words[cut:]), *others[answer:]]
        rows["speed_mc"].append({"question": " ".join(words[:cut]), "choices": choices,
                                 "answer": answer})
        rows["speed_ppl"].append({"text": text(9000 + i, rng.randint(3, 30))})
        rows["speed_gen"].append({"prompt": " ".join(words[:cut]),
                                  "answer": " " + " ".join(words[cut:])})
    specs = {
        "speed_mc": 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
                    'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
                    "metric_list: [{metric: acc}]\n",
        "speed_ppl": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
                     'doc_to_target: "{{text}}"\nmetric_list: [{metric: word_perplexity}]\n',
        "speed_gen": 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\n'
                     'doc_to_target: "{{answer}}"\ngeneration_kwargs: {until: ["\\n"], '
                     f"max_gen_toks: {max_gen_toks}, do_sample: false}}\n"
                     "metric_list: [{metric: exact_match}]\n"}
    for name, spec in specs.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n{spec}")
    return list(specs)


def main() -> None:
    args = parse()
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.cores]))
    folder = Path(tempfile.mkdtemp(prefix="lm-eval-speed-"))
    try:
        measure(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def measure(args: argparse.Namespace, folder: Path) -> None:
    for name, value in (("HF_HOME", str(folder / "hf")), ("HF_DATASETS_OFFLINE", "1"),
                        ("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ[name] = value

    import trainrun

    trainrun.configure_process()  # before JAX starts its backend, as `trainrun train` does
    from trainrun import extras

    if not extras.installed("eval"):  # lm-eval brings PyTorch and transformers for hf
        sys.exit(f"error: {extras.message('eval', 'this benchmark')}")
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from trainrun.evaluation.harness import TrainrunLM

    torch.set_num_threads(args.cores)
    export = args.export or make_model(folder, args.d_model, args.layers)
    if args.llama:
        export = make_llama(folder, export)
    (folder / "tasks").mkdir()
    tasks = write_tasks(folder / "tasks", args.docs, args.max_gen_toks)
    if args.commands:
        time_commands(args, folder, export, tasks)
        return
    manager = TaskManager(include_path=str(folder / "tasks"), include_defaults=False)
    batch = int(args.batch_size) if args.batch_size.isdigit() else args.batch_size

    start = time.perf_counter()
    ours = TrainrunLM(path=str(export), batch_size=batch)
    loaded = {"trainrun": time.perf_counter() - start}
    start = time.perf_counter()
    theirs = HFLM(pretrained=str(export), dtype="float32", device="cpu", batch_size=batch)
    loaded["hf"] = time.perf_counter() - start
    sides = {"trainrun": ours, "hf": theirs}

    times: dict[tuple[str, str], list[float]] = {}
    metrics: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for task in tasks:
            for name, model in sides.items():
                start = time.perf_counter()
                out = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager,
                                              verbosity="ERROR")
                times.setdefault((task, name), []).append(time.perf_counter() - start)
                assert out is not None
                metric = next(k for k in out["results"][task] if k.endswith(",none")
                              and "stderr" not in k)
                metrics[(task, name)] = float(out["results"][task][metric])

    print(f"\n{export}: {args.docs} documents per task, {args.cores} core(s), batch size "
          f"{args.batch_size}, {args.rounds} round(s); load: trainrun "
          f"{loaded['trainrun']:.2f} s, hf {loaded['hf']:.2f} s")
    print(f"{'task':<10} {'first: trainrun':>16} {'hf':>8} {'best: trainrun':>15} {'hf':>8} "
          f"{'hf/trainrun':>12}   metric (trainrun, hf)")
    for task in tasks:
        first = [times[(task, side)][0] for side in sides]
        best = [min(times[(task, side)][1:] or times[(task, side)]) for side in sides]
        print(f"{task:<10} {first[0]:>14.2f} s {first[1]:>6.2f} s {best[0]:>13.2f} s "
              f"{best[1]:>6.2f} s {best[1] / best[0]:>11.2f}x   "
              f"{metrics[(task, 'trainrun')]:.4f}, {metrics[(task, 'hf')]:.4f}")


if __name__ == "__main__":
    main()
