"""Each optional feature without its extra's package: one line naming the ``pip install`` to
run, exit 2, nothing written. Without any extra, every module of trainrun imports and
``metrics.tensorboard`` defaults to off."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainrun import extras
from trainrun.cli import main
from trainrun.config import load_config

REPO = Path(__file__).resolve().parents[1]


def hide(monkeypatch, extra: str) -> None:
    """As if ``extra`` were not installed: importing its modules raises ImportError."""
    for module in extras.MODULES[extra]:
        monkeypatch.setitem(sys.modules, module, None)


def refusal(extra: str, feature: str) -> str:
    return f"error: {feature} needs the {extra} extra: pip install 'trainrun[{extra}]'\n"


def cli(capsys, *args: object) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else b""
            for p in sorted(path.rglob("*"))}


def test_report_and_compare_without_matplotlib(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: run\n")
    before = snapshot(tmp_path)
    hide(monkeypatch, "report")
    assert cli(capsys, "report", run) == (2, refusal("report", "trainrun report"))
    assert cli(capsys, "compare", run, run, "--out", tmp_path / "c.png") == \
        (2, refusal("report", "trainrun compare"))
    assert snapshot(tmp_path) == before


def test_digits_without_scikit_learn(tmp_path, monkeypatch, capsys):
    hide(monkeypatch, "datasets")
    # an unusual batch size: no earlier test's digits splits are cached for this config
    assert cli(capsys, "train", "--config", "digits", "--run-dir", tmp_path / "run",
               "data.batch_size=37") == (2, refusal("datasets", "data.kind=digits"))
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_defaults_to_installed_and_asked_for_without_it_is_refused(
        tmp_path, monkeypatch, capsys):
    assert load_config("mlp").metrics.tensorboard is extras.installed("tensorboard")
    hide(monkeypatch, "tensorboard")
    assert load_config("mlp").metrics.tensorboard is False
    code, err = cli(capsys, "train", "--run-dir", tmp_path / "run", "steps=2",
                    "metrics.tensorboard=true")
    assert (code, err) == (2, "error: config key 'metrics.tensorboard': true needs the "
                              "tensorboard extra: pip install 'trainrun[tensorboard]', or set "
                              "it false\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_safetensors_init_and_export_without_safetensors(tmp_path, monkeypatch, capsys):
    weights = tmp_path / "gpt2.safetensors"
    weights.write_bytes(b"\0" * 8)
    hide(monkeypatch, "huggingface")
    code, err = cli(capsys, "train", "--config", "lm", "--run-dir", tmp_path / "run",
                    "model.d_model=16", "model.layers=1", "model.heads=2",
                    f"init.from={weights}")
    assert (code, err) == (2, refusal("huggingface", f"init.from {weights}"))
    assert cli(capsys, "export", tmp_path / "run", "--to", tmp_path / "out") == \
        (2, refusal("huggingface", "trainrun export"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.safetensors"]


def _without(modules: list[str], code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python whose imports of ``modules`` fail, as where they are not
    installed."""
    blocker = (f"import sys\nfor name in {modules!r}:\n    sys.modules[name] = None\n")
    return subprocess.run([sys.executable, "-c", blocker + code, *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_every_module_imports_without_any_extra(tmp_path):
    done = _without(sorted({m for modules in extras.MODULES.values() for m in modules}), """
import pkgutil, importlib, trainrun
names = [m.name for m in pkgutil.walk_packages(trainrun.__path__, "trainrun.")
         if m.name != "trainrun.__main__"]
for name in names:
    importlib.import_module(name)
print(len(names), "modules")
""", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[0]) > 20


LM_VS_TORCH = "import runpy, sys\nsys.argv[0] = {path!r}\nrunpy.run_path({path!r}, " \
              "run_name='__main__')\n".format(path=str(REPO / "benchmarks" / "lm_vs_torch.py"))


@pytest.mark.slow
@pytest.mark.parametrize("hidden", [["pytest"], ["pytest", "torch"]])
def test_lm_vs_torch_runs_without_the_tests_or_pytest(tmp_path, hidden):
    """Its --help with the package and the bench extra alone (nothing from tests/, no pytest,
    from another directory); without torch, its PyTorch side is refused on one line."""
    done = _without(hidden, LM_VS_TORCH, "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: lm_vs_torch.py")
    if "torch" in hidden:
        done = _without(hidden, LM_VS_TORCH, "--rounds", "1", cwd=tmp_path)
        assert (done.returncode, done.stderr) == (2, refusal("bench", "the PyTorch side"))


def test_no_benchmark_reaches_into_the_tests():
    for script in sorted((REPO / "benchmarks").glob("*.py")):
        text = script.read_text()
        assert "sys.path" not in text and "from test_" not in text and "import test_" not in \
            text, f"{script.name} imports from tests/; benchmarks use the package alone"
