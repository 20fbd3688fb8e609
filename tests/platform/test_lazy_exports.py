"""A package's lazily exported names (PEP 562 ``__getattr__``) are usable from the package's
own functions as from outside: each public function of ``trainrun.data`` and ``trainrun`` runs
in a fresh process, with none of the lazy names imported before it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import cli_env

from trainrun.platform.lazy_exports import lazy_exports, serve_own_reads

FRESH_CALLS = """
    import inspect, json, sys
    import trainrun
    import trainrun.data as data

    corpus = sys.argv[1]
    cfg = trainrun.load_config("lm", [f"data.paths=[{corpus}]", "data.seq_len=16",
                                      "data.batch_size=2", "data.eval_fraction=0.25"]).data
    calls = {  # every public function a lazily exporting package defines itself
        (data, "build_dataset"): lambda f: type(f(cfg, seed=0)).__name__,
        (data, "build_eval_dataset"): lambda f: type(f(cfg)).__name__,
        (data, "held_out_arrays"): lambda f: sorted(f(cfg)),
        (data, "data_counts"): lambda f: f(cfg),
        (data, "data_notices"): lambda f: f(cfg),
        (data, "data_files"): lambda f: len(f(cfg)),
    }
    answers = {}
    for package in (trainrun, data):
        homes = package._HOME
        for name in package.__all__:
            value = getattr(package, name)
            if not (inspect.isfunction(value) and value.__module__ == package.__name__):
                continue
            assert (package, name) in calls, f"{package.__name__}.{name} is not called here"
            for lazy in homes:  # as in a fresh process: no lazy name imported yet
                vars(package).pop(lazy, None)
            answers[f"{package.__name__}.{name}"] = calls[package, name](value)
    # and every lazily exported name reads as what its home module defines
    for package in (trainrun, data):
        for name, home in package._HOME.items():
            assert getattr(package, name) is getattr(sys.modules[home], name), name
    print(json.dumps(answers))
"""


@pytest.mark.slow
def test_each_public_function_of_a_lazy_package_runs_first_in_a_fresh_process(tmp_path):
    """Before, ``trainrun.data.build_dataset`` as a process's first use raised NameError: its
    ``ArrayBatches`` is a lazy export, which ``__getattr__`` serves only to outside reads."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 8)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(FRESH_CALLS), str(corpus)],
                          capture_output=True, text=True, timeout=120, env=cli_env())
    assert done.returncode == 0, done.stderr[-2000:]
    answers = json.loads(done.stdout)
    assert answers["trainrun.data.build_dataset"] == "ArrayBatches"
    assert answers["trainrun.data.build_eval_dataset"] == "ArrayBatches"
    assert answers["trainrun.data.data_counts"] is None
    assert answers["trainrun.data.data_notices"] == []
    assert answers["trainrun.data.held_out_arrays"] == ["tokens"]


def test_a_lazy_name_read_by_the_package_itself_is_imported_before_it_runs(tmp_path,
                                                                          monkeypatch):
    """The package's own function reads the lazy name as a global; it is there when it runs,
    and a function reading none is left as it was."""
    home = tmp_path / "home_of_names.py"
    home.write_text("VALUE = 42\n")
    package = tmp_path / "lazy_package.py"
    package.write_text(textwrap.dedent("""
        def reads():
            return (lambda: VALUE + 1)()

        def reads_none():
            return 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import lazy_package

    homes = {"VALUE": "home_of_names"}
    lazy_package.__getattr__, lazy_package.__dir__ = lazy_exports("lazy_package", homes)
    plain = lazy_package.reads_none
    serve_own_reads("lazy_package", homes)
    assert "VALUE" not in vars(lazy_package)
    assert lazy_package.reads() == 43
    assert lazy_package.reads_none is plain
    monkeypatch.delitem(sys.modules, "lazy_package")
    monkeypatch.delitem(sys.modules, "home_of_names")
