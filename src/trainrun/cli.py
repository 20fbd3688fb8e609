"""The ``trainrun`` command line: parse, then call the library. Nothing else lives here."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn, TypeAlias

from trainrun.errors import (
    LineWarning,
    OutOfMemory,
    ReadFailed,
    UserCodeFailed,
    UserError,
    WriteFailed,
    path_refused,
    printable,
)


def _train(args: argparse.Namespace) -> int:

    from trainrun.platform.distributed import session
    from trainrun.platform.process import configure_process
    from trainrun.rundir.lock import refuse_joining
    from trainrun.rundir.run_config import command_config
    from trainrun.training.loop import run

    configure_process()  # before anything starts JAX's backend
    resolved = command_config(args.config, args.overrides, args.run_dir)
    run_dir = resolved.run_dir
    # joins the other processes, if any, before JAX starts; not a job that runs already
    with session(resolved.config.distributed, lambda: refuse_joining(run_dir)):
        run(resolved.config, run_dir, fresh=args.fresh,
            allow_config_change=args.allow_config_change,
            allow_data_change=args.allow_data_change)
    return 0


def _verify_resume(args: argparse.Namespace) -> int:
    from trainrun.platform.accelerator import start_here_on_cpu
    from trainrun.platform.process import keep_compiled_programs, require_backend
    from trainrun.verify_resume import verify_resume

    held = start_here_on_cpu()  # a TPU is left to the runs, one after another
    keep_compiled_programs()
    require_backend()  # the runs' states are compared here: one line if JAX cannot start
    return verify_resume(args.config, args.overrides, kill_at=args.kill_at,
                         kill_in_save=args.kill_in_save,
                         kill_in_reference=args.kill_in_reference,
                         kill_in_generation=args.kill_in_generation, work_dir=args.work_dir,
                         keep=args.keep, one_process_device=held)


def _config_show(args: argparse.Namespace) -> int:
    from trainrun.config import show_layers
    from trainrun.rundir.run_config import command_config

    print(show_layers(command_config(args.config, args.overrides, args.run_dir).layers), end="")
    return 0


def _verify_checkpoint(args: argparse.Namespace) -> int:
    from trainrun.checkpointing.integrity import verify_run_checkpoint

    ok, line = verify_run_checkpoint(args.run_dir, args.step)
    print(line)
    return 0 if ok else 1


def _launch(args: argparse.Namespace) -> int:
    from trainrun.platform.distributed import launch

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    return launch(args.n, command, args.devices_per_process, args.grace_s,
                  on_job_stopped=_record_stopped)


def _record_stopped(reason: str, command: list[str], pid: int) -> str:
    """For ``launch``: a job its processes did not end themselves, recorded in the run that
    ``command`` (process 0's ``train ...``, run by ``pid``) names; returns the line to print."""
    from trainrun import rundir
    from trainrun.checkpointing.checkpoints import checkpoint_dir
    from trainrun.rundir.run_config import command_config

    args = build_parser().parse_args(command)
    resolved = command_config(args.config, args.overrides, args.run_dir)
    return rundir.record_stopped(resolved.run_dir,
                                 checkpoint_dir(resolved.config, resolved.run_dir), reason, pid)


def _report(args: argparse.Namespace) -> int:
    from trainrun.reporting.report import write_report

    path, notes = write_report(args.run_dir)
    print(f"wrote {printable(str(path))}")
    for note in notes:
        print(f"warning: {printable(note)}", file=sys.stderr)
    return 0


def _compare(args: argparse.Namespace) -> int:
    from trainrun.reporting.report import compare

    png, table, notes = compare(args.run_dirs, args.out)
    print(table)
    print(f"curves: {printable(str(png))}")
    for note in notes:
        print(f"warning: {printable(note)}", file=sys.stderr)
    return 0


def _sample(args: argparse.Namespace) -> int:
    from trainrun.evaluation.sample import sample_run
    from trainrun.platform.process import keep_compiled_programs, require_backend

    keep_compiled_programs()
    require_backend()
    if args.file is not None:
        from trainrun.evaluation.sample import SampleError, chat_answers, read_conversations

        if args.chat is not None:
            raise SampleError("--chat and --file both give the turns to answer; give one")
        conversations = read_conversations(args.file)
        answers = chat_answers(args.run_dir, conversations, args.tokens,
                               temperature=args.temperature, seed=args.seed, ema=args.ema,
                               system=args.system, context=args.context)
        for turns, answer in zip(conversations, answers, strict=True):
            print(json.dumps({"messages": turns, "answer": answer}, ensure_ascii=False))
        return 0
    print(sample_run(args.run_dir, args.prompt, args.tokens, temperature=args.temperature,
                     seed=args.seed, ema=args.ema, chat=args.chat, system=args.system,
                     context=args.context))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from trainrun.evaluation import evaluate
    from trainrun.platform.process import keep_compiled_programs, require_backend
    from trainrun.storage import location

    keep_compiled_programs()
    require_backend()
    if args.out:  # refused before the checkpoint is read
        evaluate.require_writable(location.location(args.out))
    result = evaluate.evaluate_run(args.run_dir, data=args.data, tokens=args.tokens,
                                   temperature=args.temperature, seed=args.seed, ema=args.ema,
                                   batch_size=args.batch_size, limit=args.limit,
                                   progress=evaluate.print_progress)
    out = (location.location(args.out) if args.out else
           evaluate.default_out(args.run_dir, result.step))
    written = evaluate.write_result(result, out)
    shown = "  ".join(f"{name} {value:.4g}" for name, value in result.scores.items())
    print(f"eval step {result.step}  {shown}")
    print(f"wrote {' and '.join([str(written[0]), *(p.name for p in written[1:])])}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from trainrun import extras
    from trainrun.export import export_run
    from trainrun.platform.process import keep_compiled_programs, require_backend

    extras.require("huggingface", "trainrun export")
    keep_compiled_programs()
    require_backend()
    done = export_run(args.run_dir, args.to, merge=args.merge, replace=args.replace,
                      dtype=args.dtype, shard_size=args.shard_size, step=args.step)
    print(printable(f"step {done.step} of {args.run_dir} written to {done.path} "
                    f"({', '.join(done.files)})"))
    return 0


def _lm_eval(args: argparse.Namespace) -> int:
    from trainrun import extras

    extras.require("eval", "trainrun lm-eval")
    from trainrun.evaluation import harness  # registers the model "trainrun" with lm-eval
    from trainrun.platform.process import keep_compiled_programs

    keep_compiled_programs()
    return harness.main(args.lm_eval_args)


def _runs(args: argparse.Namespace) -> int:
    from trainrun.reporting.report import list_runs

    print(list_runs(args.root))
    return 0


def _bench_ceiling(args: argparse.Namespace) -> int:
    from trainrun.platform.process import require_backend
    from trainrun.reporting import mfu

    if args.size < 64 or args.repeats < 1:
        raise UserError(f"bench ceiling needs --size >= 64 and --repeats >= 1 (got --size "
                        f"{args.size}, --repeats {args.repeats}); the defaults are 2048 and 10")
    mfu.ceiling_file()  # a cache directory that cannot hold it is refused before measuring
    require_backend()
    record = mfu.measure_ceiling(args.size, args.repeats)
    path, best = mfu.save_ceiling(record)
    print(f"{record['size']}x{record['size']} float32 matmul on {record['cpu']} "
          f"({record['cores']} cores, {record['device_kind']}): "
          f"{record['flops_per_s'] / 1e9:,.1f} GFLOP/s best of {record['repeats']} "
          f"({record['median_flops_per_s'] / 1e9:,.1f} median)")
    if best["flops_per_s"] > record["flops_per_s"]:
        print(f"kept the higher ceiling measured {best['measured_at']}: "
              f"{best['flops_per_s'] / 1e9:,.1f} GFLOP/s (a busy machine measures low); {path}")
    else:
        print(f"saved as this machine's ceiling to {path}")
    return 0


class _IntermixedParser(argparse.ArgumentParser):
    """A command's options may come before, between or after its ``key.path=value`` overrides
    (``train steps=5 --run-dir x steps_per_call=2``; ``launch`` appends its overrides after
    the user's options): argparse's intermixed parsing, for every command it can parse."""

    _intermixing = False

    def parse_known_args(self, args: Iterable[str] | None = None,
                         namespace: Any = None) -> tuple[Any, list[str]]:
        # argparse cannot intermix a command that has subcommands or takes the rest verbatim
        verbatim = any(action.nargs in (argparse.PARSER, argparse.REMAINDER)
                       for action in self._actions if not action.option_strings)
        if verbatim or self._intermixing:  # the intermixed parse calls back in, per pass
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


CONFIG_HELP = ("a built-in config's name (mlp, digits, lm, ...), which wins over a file or "
               "folder of that name (write ./NAME for the file), or a path to a YAML file")
# The subcommands of `trainrun`: each _add_<command> below adds one, its arguments and handler.
Commands: TypeAlias = "argparse._SubParsersAction[_IntermixedParser]"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainrun",
        description="JAX training runs: fast, sharded, and resumable bit for bit.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=_IntermixedParser)
    _add_train(commands)
    _add_verify_resume(commands)
    _add_verify_checkpoint(commands)
    _add_config(commands)
    _add_launch(commands)
    _add_report(commands)
    _add_compare(commands)
    _add_sample(commands)
    _add_eval(commands)
    _add_export(commands)
    _add_lm_eval(commands)
    _add_runs(commands)
    _add_bench(commands)
    return parser


def _add_train(commands: Commands) -> None:
    train = commands.add_parser(
        "train", help="run a training run (resumes one that has a checkpoint)",
        description="Train a config. Overrides are key.path=value, e.g. optimizer.lr=0.003.")
    train.add_argument("--config", default=None,
                       help=CONFIG_HELP + "; default: the run directory's own config when it "
                            "holds a run (to resume or extend it), else mlp")
    train.add_argument("--run-dir", default=None,
                       help="where the run writes its files (default runs/<config name>)")
    train.add_argument("--fresh", action="store_true",
                       help="move an existing run in --run-dir aside and start over")
    train.add_argument("--allow-config-change", action="store_true",
                       help="resume even though config keys that alter the run changed "
                            "(model, optimizer, data, seed, ...); steps may always change")
    train.add_argument("--allow-data-change", action="store_true",
                       help="resume even though a data file the run reads is not the one it "
                            "trained on (appended to, rewritten or replaced)")
    train.add_argument("overrides", nargs="*", metavar="key.path=value")
    train.set_defaults(handler=_train)


def _add_verify_resume(commands: Commands) -> None:
    verify = commands.add_parser(
        "verify-resume", help="prove that a killed and resumed run equals an uninterrupted one",
        description="Run the config uninterrupted; run it again, SIGKILL it at checkpoint kill "
                    "points and resume it in a new process; compare every step's loss and the "
                    "final state bit for bit. Exit 0 only if all match. Without --kill-at and "
                    "--kill-in-save: one kill after a committed checkpoint and one during an "
                    "asynchronous save, and for a preference run with a cached reference one "
                    "in its reference pass.")
    verify.add_argument("--config", default="mlp", help=CONFIG_HELP)
    verify.add_argument("--kill-at", type=int, action="append", default=[], metavar="STEP",
                        help="kill -9 once the checkpoint at STEP is committed (repeatable)")
    verify.add_argument("--kill-in-save", type=int, action="append", default=[],
                        metavar="STEP",
                        help="kill -9 while the asynchronous save of STEP is still being "
                             "written (repeatable)")
    verify.add_argument("--kill-in-reference", action="store_true",
                        help="kill -9 in a preference run's reference pass, its column written "
                             "and not yet committed")
    verify.add_argument("--kill-in-generation", type=int, action="append", default=[],
                        metavar="STEP",
                        help="kill -9 in a reinforcement-learning run while its decoder draws "
                             "the rollouts after the checkpoint at STEP (repeatable)")
    verify.add_argument("--work-dir", default=None,
                        help="where the runs go (default: a new temporary directory)")
    verify.add_argument("--keep", action="store_true",
                        help="keep the runs' directories (kept anyway when a check fails)")
    verify.add_argument("overrides", nargs="*", metavar="key.path=value")
    verify.set_defaults(handler=_verify_resume)


def _add_verify_checkpoint(commands: Commands) -> None:
    check = commands.add_parser(
        "verify-checkpoint", help="check a run's checkpoint against its checksums",
        description="Read every file of one committed checkpoint of RUN_DIR (default its "
                    "newest) and compare it with the sha256 saved with it. Exit 0 if all match, "
                    "1 if a file changed, is missing or has no checksum; nothing is written.")
    check.add_argument("run_dir", metavar="RUN_DIR")
    check.add_argument("step", nargs="?", type=int, default=None, metavar="STEP")
    check.set_defaults(handler=_verify_checkpoint)


def _add_config(commands: Commands) -> None:
    config = commands.add_parser("config", help="inspect a config before running it")
    config_kinds = config.add_subparsers(dest="config_command", metavar="WHAT", required=True)
    show = config_kinds.add_parser(
        "show", help="print the resolved config and where each value comes from",
        description="Print the config a run would use, as YAML, each value followed by its "
                    "origin: default, file (the --config file), base (a file it extends "
                    "through base:) or override (a key.path=value).")
    show.add_argument("--config", default=None,
                      help=CONFIG_HELP + "; default: --run-dir's own config, else mlp")
    show.add_argument("--run-dir", default=None,
                      help="a run directory: its saved config is the base (as train "
                           "--run-dir DIR without --config takes it)")
    show.add_argument("overrides", nargs="*", metavar="key.path=value")
    show.set_defaults(handler=_config_show)


def _add_launch(commands: Commands) -> None:
    launch = commands.add_parser(
        "launch", help="run one training run as N processes on this machine (CPU)",
        description="Start N processes of one run (jax.distributed, CPU collectives over gloo, "
                    "a coordinator on 127.0.0.1), stream their output prefixed [i], and exit "
                    "non-zero if any fails. Example: trainrun launch -n 2 "
                    "--devices-per-process 2 -- train --config mlp")
    launch.add_argument("-n", type=int, required=True, help="number of processes")
    launch.add_argument("--devices-per-process", type=int, default=None,
                        help="simulated CPU devices in each process (default: JAX's, one)")
    launch.add_argument("--grace-s", type=float, default=90.0,
                        help="after one process fails, seconds the others get to stop by "
                             "themselves before they are terminated")
    launch.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- train ...")
    launch.set_defaults(handler=_launch)


def _add_report(commands: Commands) -> None:
    report = commands.add_parser(
        "report", help="write RUN_DIR/report.html with plots of a run",
        description="Plots (loss, eval, lr, grad norm, throughput, step-time histogram, "
                    "wall-time split) as PNGs in RUN_DIR/report/, and report.html with them, "
                    "the summary and the provenance.")
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.set_defaults(handler=_report)


def _add_compare(commands: Commands) -> None:
    compare = commands.add_parser(
        "compare", help="overlay the curves of runs in one PNG; print their final metrics",
        description="Train loss, eval loss, lr and grad norm of each run, overlaid.")
    compare.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    compare.add_argument("--out", default="compare.png", help="the PNG (default compare.png)")
    compare.set_defaults(handler=_compare)


def _add_sample(commands: Commands) -> None:
    sample = commands.add_parser(
        "sample", help="print text generated by a language-model run, or a chat answer",
        description="Loads the latest checkpoint of RUN_DIR (a transformer trained on text or "
                    "records), or the model of a Hugging Face model or adapter directory (what "
                    "trainrun export writes, read through its own tokenizer), and prints the "
                    "prompt followed by generated text, or with --chat the answer to a user "
                    "turn. Decoding is one jitted program with a key/value cache.")
    sample.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run directory, or a model or adapter directory")
    sample.add_argument("--prompt", default="\n", help="text to continue (default a newline)")
    sample.add_argument("--chat", metavar="TEXT",
                        help="a user turn: print the answer of a run on chat records (its chat "
                             "template renders the turn; the answer ends at the turn's end)")
    sample.add_argument("--tokens", type=int, default=200,
                        help="tokens to generate, at most (default 200)")
    sample.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy, the most likely token each time (the default, as "
                             "eval's); above 0, divide logits by this and sample with --seed")
    sample.add_argument("--seed", type=int, default=0, help="sampling randomness (default 0)")
    sample.add_argument("--context", type=int, metavar="N",
                        help="positions prompt and answer take together, at most (default: "
                             "what the architecture reads: the init.from model's "
                             "max_position_embeddings, a learned position table's size, or "
                             "2048 for rotary positions from scratch); an answer that reaches "
                             "it stops there, with a warning")
    sample.add_argument("--ema", action="store_true",
                        help="sample from the params' moving average (runs with optimizer.ema)")
    sample.add_argument("--system", metavar="TEXT",
                        help="a system prompt rendered before each --chat or --file turn, as "
                             "records that carry one were trained")
    sample.add_argument("--file", metavar="CONVERSATIONS",
                        help="a JSONL file, one conversation a line ({\"messages\": [{\"role\": "
                             "..., \"content\": ...}, ...]}): print each with its \"answer\" "
                             "as JSONL, the checkpoint and tokenizer read once and the "
                             "conversations decoded in batches by one compiled program")
    sample.set_defaults(handler=_sample)


def _add_eval(commands: Commands) -> None:
    evaluate = commands.add_parser(
        "eval", help="score a language-model run on held-out records: loss, accuracy, answers",
        description="Loads the latest checkpoint of RUN_DIR and reports, on its held-out split "
                    "or the records of --data, the loss and token accuracy over the counted "
                    "tokens and, for chat and completion records, each answer generated from "
                    "the turns before it, scored by exact and normalised match (whitespace, "
                    "case). Writes scores.json and answers.jsonl (each record's prompt, "
                    "expected and produced answer) to --out; for a preference run, its "
                    "held-out pairs' loss and reward metrics, in scores.json alone.")
    evaluate.add_argument("run_dir", metavar="RUN_DIR")
    evaluate.add_argument("--data", metavar="RECORDS",
                          help="JSONL or Parquet records (a file, folder or pattern) to score "
                               "instead of the run's held-out split")
    evaluate.add_argument("--tokens", type=int, default=None,
                          help="tokens an answer may take, at most (default 64; an RL run's "
                               "rl.completion_tokens)")
    evaluate.add_argument("--temperature", type=float, default=0.0,
                          help="0 = greedy (the default); above 0, sample with --seed")
    evaluate.add_argument("--seed", type=int, default=0, help="sampling randomness (default 0)")
    evaluate.add_argument("--batch-size", type=int, default=16,
                          help="answers generated together (default 16)")
    evaluate.add_argument("--limit", type=int, default=0,
                          help="answers to generate, the split's first (default 0: all)")
    evaluate.add_argument("--ema", action="store_true",
                          help="score the params' moving average (runs with optimizer.ema)")
    evaluate.add_argument("--out", metavar="DIR",
                          help="folder for scores.json and answers.jsonl (default "
                               "RUN_DIR/eval/step-N)")
    evaluate.set_defaults(handler=_evaluate)


def _add_export(commands: Commands) -> None:
    export = commands.add_parser(
        "export", help="write a transformer run as a Hugging Face model or PEFT adapters",
        description="Writes the newest readable checkpoint of RUN_DIR (or --step N's) as a "
                    "Hugging Face model directory that transformers loads (config.json, "
                    "safetensors weights, the source's tokenizer files) in the family of its "
                    "init.from source (any model_type init.from reads), or, for a run with "
                    "LoRA adapters, as a PEFT adapter directory for that source.")
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--to", required=True, metavar="DIR",
                        help="directory to write: a new or empty one (or see --replace)")
    export.add_argument("--merge", action="store_true",
                        help="fold LoRA adapters into the weights: a whole model, not adapters")
    export.add_argument("--replace", action="store_true",
                        help="replace the model directory already at --to: it then holds this "
                             "export only (swapped in once complete)")
    export.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the weights' dtype in the files (default float32)")
    export.add_argument("--step", type=int, default=None, metavar="N",
                        help="export the checkpoint of step N (default: the newest readable "
                             "one)")
    export.add_argument("--shard-size", default="5GB", metavar="SIZE",
                        help="most bytes per weights file; more go into shards with an index "
                             "(default 5GB)")
    export.set_defaults(handler=_export)


def _add_lm_eval(commands: Commands) -> None:
    # No prefix characters: every argument, options and -h included, is lm-eval's, unparsed.
    lm_eval = commands.add_parser(
        "lm-eval", add_help=False, prefix_chars="\0",
        help="evaluate a model with lm-evaluation-harness (its CLI, with --model trainrun)",
        description="lm-evaluation-harness's own command line, with its model trainrun "
                    "registered: every argument goes to lm-eval unchanged and its output is "
                    "lm-eval's. Example: trainrun lm-eval --model trainrun --model_args "
                    "path=runs/lm_bpe --tasks lambada_openai --batch_size auto; --model_args "
                    "path= takes a run directory, a Hugging Face model directory or a PEFT "
                    "adapter directory, with ema, max_length, max_gen_toks, chat_template and "
                    "seed. Needs the eval extra.")
    lm_eval.add_argument("lm_eval_args", nargs=argparse.REMAINDER, metavar="ARGS",
                         help="lm-eval's arguments (trainrun lm-eval --help lists them)")
    lm_eval.set_defaults(handler=_lm_eval)


def _add_runs(commands: Commands) -> None:
    runs = commands.add_parser(
        "runs", help="list runs: status, last step, best eval metric",
        description="Every run directory under --root with its status (running, finished, "
                    "preempted, failed), last step and best eval metric.")
    runs.add_argument("--root", default="runs", help="where runs are (default runs/)")
    runs.set_defaults(handler=_runs)


def _add_bench(commands: Commands) -> None:
    bench = commands.add_parser("bench", help="measure this machine (for MFU on CPU)")
    bench_kinds = bench.add_subparsers(dest="bench", metavar="WHAT", required=True)
    ceiling = bench_kinds.add_parser(
        "ceiling", help="time a large float32 matmul; cache the FLOP/s as the CPU peak",
        description="The CPU has no datasheet peak: MFU on CPU is measured against the best "
                    "FLOP/s of a large matmul on this machine, cached per processor model, core "
                    "count and jax version ($TRAINRUN_CACHE_DIR or ~/.cache/trainrun).")
    ceiling.add_argument("--size", type=int, default=2048, help="matrix side (default 2048)")
    ceiling.add_argument("--repeats", type=int, default=10, help="timed runs (default 10)")
    ceiling.set_defaults(handler=_bench_ceiling)


@contextlib.contextmanager
def _renamed_keys_as_lines() -> Iterator[None]:
    """A config key given by its old name, a compiled-program cache that cannot be written, or
    a ``LineWarning`` (generation that reached the model's context) warns in one line, as the
    command's other warnings do; any other warning shows as Python shows it."""
    from trainrun.config.renamed import RenamedKeyWarning
    from trainrun.platform.user_cache import CompilationCacheWarning

    python_shows = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, (RenamedKeyWarning, CompilationCacheWarning, LineWarning)):
            print(f"warning: {printable(str(message))}", file=sys.stderr)
        else:
            python_shows(message, category, *args, **kwargs)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = python_shows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _renamed_keys_as_lines():
            return args.handler(args)
    except UserError as err:
        print(f"error: {printable(str(err))}", file=sys.stderr)
        return 2
    # the system, or the user's code in a run (a reward, a callback), not the input: exit 1
    except (WriteFailed, ReadFailed, OutOfMemory, UserCodeFailed) as err:
        print(f"error: {printable(str(err))}", file=sys.stderr)
        checkpoints = sys.modules.get("trainrun.checkpointing.checkpoints")
        if checkpoints is not None and checkpoints.abandoned():
            sys.stdout.flush()  # a save the store stopped answering: its thread is not joined
            sys.stderr.flush()
            os._exit(1)
        return 1
    except OSError as err:  # a path the system refused where no command checked it first
        line, code = path_refused(err)
        print(f"error: {line}", file=sys.stderr)
        return code


def command(argv: list[str] | None = None) -> NoReturn:
    """The ``trainrun`` program, in a process of its own (the console script, ``python -m
    trainrun``): ``main`` inside ``command_process``'s settings; the process exits with the
    command's code."""
    from trainrun.platform.process import command_process

    with command_process():
        code = main(argv)
    sys.exit(code)


if __name__ == "__main__":
    command()
