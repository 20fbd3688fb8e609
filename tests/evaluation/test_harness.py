"""``trainrun lm-eval``: lm-evaluation-harness's CLI with the model ``trainrun``, on local
tasks over local files (nothing from the hub). On one exported model, ``trainrun`` and
lm-eval's own ``hf`` give the same accuracy, log-likelihoods within 1e-4 and the same generated
text; the run directory scores as its export; a path without a model, and a missing lm-eval,
are one line and exit 2."""

from __future__ import annotations

import functools
import io
import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from trainrun import extras
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.models.transformer import AttentionPath
from trainrun.training.loop import run

TASKS = ("tiny_mc", "tiny_ppl", "tiny_gen")
CORPUS = ("The cat sat on the mat. The dog ran in the park.\n"
          "A bird sang a song. Question: what is two plus two? Answer: four.\n") * 30
MC = [{"question": "The cat sat on the", "choices": [" mat.", " dog.", " park.", " song."],
       "answer": 0},
      {"question": "The dog ran in the", "choices": [" mat.", " park.", " bird.", " cat."],
       "answer": 1},
      {"question": "A bird sang a ", "choices": ["song.", "cat.", "four.", "mat."], "answer": 0},
      {"question": "Question: what is two plus two? Answer:",
       "choices": [" four.", " song.", " park."], "answer": 0},
      {"question": "", "choices": ["The cat", "A bird"], "answer": 1}]  # the prefix id alone
PPL = [{"text": "The cat sat on the mat. The dog ran in the park.\nA bird sang a song. " * 3},
       {"text": "Question: what is two plus two? Answer: four."},
       {"text": "héllo wörld, a cat in the park\n\nthe end"}]
GEN = [{"prompt": "The cat sat on", "answer": " the mat"},
       {"prompt": "Question: what is two plus two? Answer:", "answer": " four"},
       {"prompt": "A bird", "answer": " sang a song"}]
YAML = {
    "tiny_mc": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list: [{metric: acc}, {metric: acc_norm}]
""",
    "tiny_ppl": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]
""",
    "tiny_gen": """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: [".", "\\n\\n"], max_gen_toks: 12, do_sample: false}
metric_list: [{metric: exact_match}]
"""}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """The three tasks' YAML files and JSONL data in one folder (lm-eval's --include_path), and
    Hugging Face's caches in the module's temporary folder, offline."""
    manager = pytest.importorskip("lm_eval.tasks.manager")
    folder = tmp_path_factory.mktemp("tasks")
    for name, rows in (("tiny_mc", MC), ("tiny_ppl", PPL), ("tiny_gen", GEN)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n{YAML[name]}")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (("HF_HOME", str(folder / "hf")), ("HF_DATASETS_OFFLINE", "1"),
                            ("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
            patch.setenv(name, value)
        # lm-eval indexes its thousands of built-in tasks per run; these runs need theirs alone
        patch.setattr(manager.TaskManager, "__init__", functools.partialmethod(
            manager.TaskManager.__init__, include_defaults=False))
        yield folder


@pytest.fixture(scope="module")
def tiny(tasks, tmp_path_factory) -> Path:
    """A GPT-2-shaped run on a BPE tokenizer trained here, exported (with its tokenizer.json):
    ``run`` and ``export`` in the returned folder. Trained enough to continue the corpus."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tiny")
    corpus = folder / "corpus.txt"
    corpus.write_text(CORPUS)
    config = load_config("lm_bpe", [
        "steps=80", "steps_per_call=40", "optimizer.lr=0.01", "checkpoint.every=0",
        "eval.every=0", "optimizer.schedule.warmup=1", "metrics.tensorboard=false",
        "model.d_model=32", "model.layers=2", "model.heads=2", "model.seq_len=64",
        "model.positions=learned", "model.bias=true", "model.vocab=320",
        f"data.paths=[{corpus}]", "data.seq_len=64", "data.batch_size=4",
        f"data.tokenizer={folder / 'tok.json'}", "data.vocab_size=300"])
    run(config, folder / "run", out=io.StringIO())
    assert main(["export", str(folder / "run"), "--to", str(folder / "export")]) == 0
    return folder


def lm_eval_cli(tasks: Path, out: Path, *args: str) -> dict[str, Any]:
    """``trainrun lm-eval ARGS`` on the three tasks, in-process; its results and samples."""
    code = main(["lm-eval", *args, "--tasks", *TASKS, "--include_path", str(tasks),
                 "--output_path", str(out), "--log_samples"])
    assert code == 0
    return read_output(out)


def read_output(out: Path) -> dict[str, Any]:
    (results,) = out.glob("*/results_*.json")
    found: dict[str, Any] = {"results": json.loads(results.read_text())["results"]}
    for task in TASKS:
        (samples,) = out.glob(f"*/samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in samples.read_text().splitlines()]
        found[task] = [row["filtered_resps"] for row in sorted(rows, key=lambda r: r["doc_id"])]
    return found


def assert_same_scores(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Equal accuracy and generated text; log-likelihoods within 1e-4."""
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == theirs["results"]["tiny_mc"][metric]
    assert ours["results"]["tiny_gen"]["exact_match,none"] == \
        theirs["results"]["tiny_gen"]["exact_match,none"]
    for doc, (mine, other) in enumerate(zip(ours["tiny_mc"], theirs["tiny_mc"], strict=True)):
        for (logp, greedy), (their_logp, their_greedy) in zip(mine, other, strict=True):
            assert float(logp) == pytest.approx(float(their_logp), abs=1e-4), doc
            assert greedy == their_greedy, doc
    for doc, (mine, other) in enumerate(zip(ours["tiny_ppl"], theirs["tiny_ppl"], strict=True)):
        assert float(mine[0]) == pytest.approx(float(other[0]), abs=1e-4), doc
    assert ours["tiny_gen"] == theirs["tiny_gen"]


@pytest.fixture(scope="module")
def hf_scores(tiny, tasks, tmp_path_factory) -> dict[str, Any]:
    """lm-eval's ``hf`` model on the export: the scores to match."""
    return lm_eval_cli(tasks, tmp_path_factory.mktemp("hf"), "--model", "hf", "--model_args",
                       f"pretrained={tiny / 'export'},dtype=float32", "--device", "cpu",
                       "--batch_size", "4")


@pytest.mark.slow
def test_trainrun_and_hf_score_the_export_alike(tiny, tasks, hf_scores, tmp_path):
    """On one export: the same accuracy, log-likelihoods (continuations, an empty context and
    rolling windows) and generated text, on a model that has learned some of the tasks."""
    ours = lm_eval_cli(tasks, tmp_path, "--model", "trainrun", "--model_args",
                       f"path={tiny / 'export'}", "--batch_size", "auto")
    assert_same_scores(ours, hf_scores)
    assert len(PPL[0]["text"]) > 3 * 64  # the 64-position model reads it in several windows
    assert ours["results"]["tiny_mc"]["acc,none"] > 0
    assert ours["results"]["tiny_gen"]["exact_match,none"] > 0


@pytest.mark.slow
def test_the_run_from_python_scores_as_its_export(tiny, tasks, hf_scores, tmp_path):
    """``lm_eval.simple_evaluate(model="trainrun")`` once ``trainrun.evaluation.harness`` is
    imported, on the run directory (its own tokenizer), with a fixed batch size that leaves a
    short last batch: the export's scores."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    import trainrun.evaluation.harness  # noqa: F401

    tracker = EvaluationTracker(output_path=str(tmp_path))
    results = lm_eval.simple_evaluate(
        model="trainrun", model_args={"path": str(tiny / "run")}, tasks=list(TASKS),
        batch_size=3, log_samples=True, evaluation_tracker=tracker,
        task_manager=TaskManager(include_path=str(tasks)))
    assert results is not None
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in TASKS:
        tracker.save_results_samples(task_name=task, samples=samples[task])
    assert_same_scores(read_output(tmp_path), hf_scores)


def test_a_path_without_a_model_is_one_line(tasks, tmp_path, capfd):
    pytest.importorskip("lm_eval")
    empty = tmp_path / "empty"
    empty.mkdir()
    code = main(["lm-eval", "--model", "trainrun", "--model_args", f"path={empty}", "--tasks",
                 "tiny_mc", "--include_path", str(tasks)])
    err = capfd.readouterr().err.rstrip("\n").splitlines()
    assert code == 2
    assert err[-1].startswith(f"error: trainrun.load {empty}: not a trainrun run directory"), \
        err[-1]
    assert list(empty.iterdir()) == []


def test_model_args_it_does_not_take_are_one_line(tasks, capfd):
    pytest.importorskip("lm_eval")
    code = main(["lm-eval", "--model", "trainrun", "--model_args", "pretrained=gpt2",
                 "--tasks", "tiny_mc", "--include_path", str(tasks)])
    err = capfd.readouterr().err.rstrip("\n").splitlines()
    assert (code, err[-1]) == (2, "error: --model_args pretrained: not an option of --model "
                                  "trainrun; give path=RUN_OR_MODEL_DIR and any of ema, "
                                  "max_length, max_gen_toks, chat_template, seed")


def test_an_unknown_task_is_one_line_naming_it_and_how_to_list_tasks(tasks, capfd):
    """Before, lm-eval's ValueError ended the command in a traceback."""
    pytest.importorskip("lm_eval")
    code = main(["lm-eval", "--model", "trainrun", "--model_args", "path=unused",
                 "--tasks", "tiny_mc,nosuchtask", "--include_path", str(tasks)])
    err = capfd.readouterr().err.rstrip("\n").splitlines()
    assert (code, err) == (2, ["error: --tasks nosuchtask: lm-eval has no such task; "
                               "`trainrun lm-eval ls tasks` lists them (with --include_path "
                               "DIR, your own as well)"])


def test_without_lm_eval_the_command_names_the_extra(monkeypatch, capsys):
    for module in extras.MODULES["eval"]:
        monkeypatch.setitem(sys.modules, module, None)
    assert main(["lm-eval", "--model", "trainrun", "--tasks", "tiny_mc"]) == 2
    assert capsys.readouterr().err == ("error: trainrun lm-eval needs the eval extra: pip "
                                       "install 'trainrun[eval]'\n")


@pytest.mark.slow
def test_chat_turns_render_as_transformers_renders_them(tiny):
    """--apply_chat_template: the turns as ``hf`` renders them with the same template, with
    the assistant's opening or ending in the turn to continue; no template is one line."""
    transformers = pytest.importorskip("transformers")
    from trainrun.data.chat import CHATML
    from trainrun.evaluation.harness import HarnessError, TrainrunLM

    ours = TrainrunLM(path=str(tiny / "export"), chat_template="chatml")
    theirs = transformers.AutoTokenizer.from_pretrained(tiny / "export")
    theirs.chat_template = CHATML
    turns = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "The cat sat on"},
             {"role": "assistant", "content": " the mat"}]
    for history, opening in ((turns[:2], True), (turns, False)):
        assert ours.apply_chat_template(history, opening) == theirs.apply_chat_template(
            history, tokenize=False, add_generation_prompt=opening,
            continue_final_message=not opening)
    assert ours.chat_template(True) == CHATML
    with pytest.raises(HarnessError, match="has no chat template: give --model_args "
                                           "chat_template=chatml"):
        TrainrunLM(path=str(tiny / "export")).apply_chat_template(turns[:2])


@pytest.mark.slow
def test_an_adapter_directory_scores_as_hf_with_peft_scores_it(tiny, tasks, tmp_path):
    """LoRA adapters trained on an export and written as a PEFT directory: ``trainrun`` on the
    adapter directory and ``hf`` with ``peft=`` on its base give the same scores. (The base's
    vocabulary is the tokenizer's: lm-eval's ``hf`` cuts a PEFT model's to the tokenizer's.)"""
    pytest.importorskip("peft")
    common = ["checkpoint.every=0", "eval.every=0", "optimizer.schedule.warmup=1",
              "metrics.tensorboard=false", f"data.paths=[{tiny / 'corpus.txt'}]",
              "data.seq_len=64", "data.batch_size=4", f"data.tokenizer={tiny / 'tok.json'}",
              "data.vocab_size=300"]
    base = load_config("lm_bpe", [
        *common, "steps=40", "steps_per_call=20", "optimizer.lr=0.01", "model.d_model=32",
        "model.layers=2", "model.heads=2", "model.seq_len=64", "model.positions=learned",
        "model.bias=true", "model.vocab=300"])
    run(base, tmp_path / "base-run", out=io.StringIO())
    assert main(["export", str(tmp_path / "base-run"), "--to", str(tmp_path / "base")]) == 0
    config = load_config("finetune", [
        *common, "steps=20", "steps_per_call=10", "optimizer.lr=0.02",
        f"init.from={tmp_path / 'base'}", "model.lora={rank: 4, targets: [q, v]}",
        "model.vocab=300"])
    run(config, tmp_path / "run", out=io.StringIO())
    adapter = tmp_path / "adapter"
    assert main(["export", str(tmp_path / "run"), "--to", str(adapter)]) == 0
    assert (adapter / "adapter_config.json").is_file()
    ours = lm_eval_cli(tasks, tmp_path / "ours", "--model", "trainrun", "--model_args",
                       f"path={adapter}", "--batch_size", "auto")
    theirs = lm_eval_cli(tasks, tmp_path / "theirs", "--model", "hf", "--model_args",
                         f"pretrained={tmp_path / 'base'},peft={adapter},dtype=float32",
                         "--device", "cpu", "--batch_size", "4")
    assert_same_scores(ours, theirs)
    plain = lm_eval_cli(tasks, tmp_path / "plain", "--model", "trainrun", "--model_args",
                        f"path={tmp_path / 'base'}", "--batch_size", "auto")
    assert plain["tiny_mc"] != ours["tiny_mc"]  # the adapters were read


def test_a_request_list_is_packed_into_rows_of_one_width():
    """Requests share rows of the longest one's padded width, longest first, first fit, and
    every batch of a list takes one shape: one program a list, no request padded to another's
    length; a list of few rows takes the power of two at or above them."""
    from trainrun.evaluation.harness import TrainrunLM

    scorer = TrainrunLM.__new__(TrainrunLM)  # the batch shapes alone: no model read
    scorer._rows, scorer._max_length = 2, 120
    inputs = [3, 42, 14, 22, 49, 32, 5]
    rows, shape = scorer._packed(inputs)
    assert shape == (2, 64)
    assert rows == [[4, 2], [1, 3], [5, 6, 0]]  # 49 + 14, 42 + 22, 32 + 5 + 3
    assert sorted(i for row in rows for i in row) == list(range(len(inputs)))
    assert all(sum(inputs[i] for i in row) <= 64 for row in rows)
    scorer._rows = 16
    assert scorer._packed(inputs)[1] == (4, 64)  # three rows: a batch of four
    assert scorer._packed([100] * 40)[1] == (16, 120)  # batches of 16, max_length wide
    assert scorer._packed([1, 2])[1] == (1, 16)  # the narrowest rows


@pytest.mark.parametrize("layout", ["learned", "llama", "sliding"])
def test_requests_packed_in_a_row_score_as_each_alone(layout):
    """The score program on a row of three requests (segments 1, 2, 3, positions from 0 in
    each, padding after) gives each request's log-probabilities and argmax flags as the row
    of that request alone: learned positions, rotary ones, a sliding window."""
    from conftest import llama_shaped

    from trainrun.config import TransformerModel
    from trainrun.evaluation.harness import _scorer
    from trainrun.models import build_model

    cfg = TransformerModel(d_model=32, layers=2, heads=2, seq_len=64, init_std=0.1, vocab=97,
                           positions="learned")
    if layout != "learned":
        cfg = llama_shaped(cfg, kv_heads=1)
    if layout == "sliding":
        cfg = cfg.model_copy(update={"sliding_window": 5})
    params = build_model(cfg).init(jax.random.key(0))
    score = _scorer(cfg, "float32", AttentionPath(block=16))
    texts = [np.random.default_rng(n).integers(1, 97, size) for n, size in enumerate((21, 9, 30))]

    def row(members):
        tokens, targets, segments, positions = (np.zeros((1, 64), np.int32) for _ in range(4))
        at = 0
        for segment, text in enumerate(members, 1):
            end = at + text.size - 1
            tokens[0, at:end], targets[0, at:end] = text[:-1], text[1:]
            segments[0, at:end], positions[0, at:end] = segment, np.arange(end - at)
            at = end
        return [np.asarray(a)[0] for a in score(params, tokens, targets, segments, positions)]

    logp, greedy = row(texts)
    at = 0
    for text in texts:
        alone, alone_greedy = row([text])
        n = text.size - 1
        np.testing.assert_allclose(logp[at:at + n], alone[:n], rtol=0, atol=1e-5)
        np.testing.assert_array_equal(greedy[at:at + n], alone_greedy[:n])
        at += n


# Continuations of 3 tokens after contexts of 1 to 47: inputs of 3 to 49 tokens.
REQUESTS = [(None, [5 + n % 7] * n, [9, 11, 13]) for n in (1, 40, 12, 20, 47, 30, 3)]


@pytest.mark.slow
def test_a_request_list_compiles_one_program_and_scores_as_each_request_alone(tiny):
    """A request list, packed, compiles one score program, once, and gives what scoring each
    request alone gives: a request does not see the others in its row."""
    from trainrun.evaluation.harness import TrainrunLM

    compiled: list[str] = []

    def listen(event: str, seconds: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name", ""))

    jax.monitoring.register_event_duration_secs_listener(listen)
    model = TrainrunLM(path=str(tiny / "export"), batch_size=2)
    requests = REQUESTS  # seven requests in three rows of 64: two batches of 2 rows
    together = model._loglikelihood_tokens(requests, disable_tqdm=True)
    assert list(model._programs.compiled) == [(2, 64)]
    assert compiled.count("jit(score)") == 1
    assert model._loglikelihood_tokens(requests, disable_tqdm=True) == together
    assert compiled.count("jit(score)") == 1  # the second time: no compile
    alone = TrainrunLM(path=str(tiny / "export"), batch_size=1)
    for request, answer in zip(requests, together, strict=True):
        logp, greedy = alone._loglikelihood_tokens([request], disable_tqdm=True)[0]
        assert greedy == answer[1] and logp == pytest.approx(answer[0], abs=1e-5)


@pytest.mark.slow
def test_the_command_freezes_the_heap_lm_eval_built_and_the_class_alone_does_not(
        tiny, monkeypatch):
    """``trainrun lm-eval``, in the program's own process, freezes what is alive when lm-eval
    builds the model (its task index) for the garbage collector; the class built from Python,
    and lm-eval's command line run in a library user's process, leave the process's collector
    alone."""
    import gc

    import lm_eval.__main__

    from trainrun.evaluation import harness
    from trainrun.platform.process import command_owns_process, command_process

    frozen: list[bool] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    harness.TrainrunLM(path=str(tiny / "export"))
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate",
                        lambda: harness.TrainrunLM(path=str(tiny / "export")))
    assert harness.main(["--model", "trainrun"]) == 0
    assert frozen == []
    with command_process():
        frozen.clear()  # the program's own freeze as the command starts
        assert harness.main(["--model", "trainrun"]) == 0
        assert frozen == [True]
    assert not command_owns_process()  # only while the command runs


@pytest.mark.slow
def test_scoring_compiled_at_llvm_level_1_gives_the_default_compiles_scores(tiny, monkeypatch):
    """The ``cpu_score_compile`` fast path changes the score programs' compile, not what they
    compute: every answer's greedy flag, and its log-probability to float32's rounding (1e-5
    on sums near 30; lm-eval's ``hf`` is matched to 1e-4)."""
    from trainrun.evaluation.harness import TrainrunLM

    requests = REQUESTS
    fast = TrainrunLM(path=str(tiny / "export"), batch_size=4)
    assert fast._programs.options == {"xla_backend_optimization_level": 1}
    monkeypatch.setenv("TRAINRUN_FAST_PATHS", "none")
    plain = TrainrunLM(path=str(tiny / "export"), batch_size=4)
    assert plain._programs.options == {}
    ours, theirs = (model._loglikelihood_tokens(requests, disable_tqdm=True)
                    for model in (fast, plain))
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs]
    assert np.allclose([logp for logp, _ in ours], [logp for logp, _ in theirs], rtol=0,
                       atol=1e-5)
