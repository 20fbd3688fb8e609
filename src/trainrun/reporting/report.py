"""What a user looks at after (or during) a run: ``trainrun report``, ``compare`` and ``runs``.

    report RUN_DIR        RUN_DIR/report.html with PNG plots in RUN_DIR/report/: train and eval
                          loss, lr, grad norm, throughput, step-time histogram, the wall-time
                          split, plus the summary and provenance tables
    compare RUN_A RUN_B   their curves overlaid in one PNG and a table of final metrics
    runs                  every run under runs/: status, last step, best eval metric

Everything is read from the files a run leaves (see ``rundir``); nothing here imports JAX.
The plots need the report extra (matplotlib); ``runs`` does not. A run directory, ``--root`` or
``--out`` may be on object storage (``gs://``, ``s3://``): every file is read and written
through ``storage.location``, a report's files and a plot each as one whole object.
"""

from __future__ import annotations

import dataclasses
import html
import io
import json
import logging
import os
import statistics
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import yaml

from trainrun import extras, rundir
from trainrun.errors import UserError, WriteFailed, path_refused, printable
from trainrun.reporting.units import duration, time_unit
from trainrun.rundir.run_config import saved_config_file
from trainrun.storage import location
from trainrun.storage.location import Location

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REPORT_HTML = "report.html"
PLOT_DIR = "report"
# Eval metrics where higher is better; for any other metric (loss, bits_per_byte) lower is.
HIGHER_IS_BETTER = ("accuracy",)
MAX_POINTS = 20_000  # per curve


class ReportError(UserError):
    """A path that holds no run to report on."""


@dataclasses.dataclass
class RunRecord:
    """The files of one run directory, parsed."""

    path: Location
    config: dict[str, Any]
    summary: dict[str, Any]
    status: dict[str, Any]
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    timing: list[dict[str, Any]]
    problems: list[str] = dataclasses.field(default_factory=list)  # in metrics.jsonl

    def series(self, rows: list[dict[str, Any]], name: str,
               most: int = MAX_POINTS) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, every ``len // most``-th point of a long run (a plot
        has fewer pixels than that) plus the last."""
        points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
        if len(points) > most:
            points = [*points[::len(points) // most], points[-1]]
        return [s for s, _ in points], [v for _, v in points]

    @property
    def last_step(self) -> int:
        return self.train[-1]["step"] if self.train else 0


def _read_jsonl(path: Location, unreadable: list[str] | None = None,
                ) -> dict[str, list[dict[str, Any]]]:
    """A JSONL file's records by ``split`` (train when absent). A line that is not a record (a
    torn last line of a killed writer, a file cut or damaged) is skipped and, with
    ``unreadable``, listed there; where steps go back (a resumed run appending), the later pass
    wins."""
    splits: dict[str, list[dict[str, Any]]] = {}
    if not path.exists():
        return splits
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            if unreadable is not None and line.strip():
                unreadable.append(line)
            continue
        rows = splits.setdefault(record.get("split", "train"), [])
        while rows and rows[-1]["step"] >= record["step"]:
            rows.pop()
        rows.append(record)
    return splits


def load_run(path: Location | str) -> RunRecord:
    run_dir = location.location(path)
    if not (run_dir / rundir.CONFIG).exists():
        run_dir.require_bucket()
        raise ReportError(f"{run_dir} holds no trainrun run (no {rundir.CONFIG}); give a run "
                          "directory such as runs/mlp (`trainrun runs` lists them)")
    if saved_config_file(run_dir) is None:  # the test `train` makes before writing there
        raise ReportError(f"{run_dir} is not a trainrun run directory: its {rundir.CONFIG} is "
                          f"not one trainrun wrote (no {rundir.MARKER} beside it); give a run "
                          "directory such as runs/mlp (`trainrun runs` lists them)")
    unreadable: list[str] = []
    metrics = _read_jsonl(run_dir / rundir.METRICS, unreadable)
    config = rundir.read_yaml(run_dir / rundir.CONFIG)
    status = rundir.read_status(run_dir)
    train = metrics.get("train", [])
    return RunRecord(
        path=run_dir, config=config, summary=rundir.read_summary(run_dir), status=status,
        train=train, eval=metrics.get("eval", []),
        timing=_read_jsonl(run_dir / rundir.TIMING).get("train", []),
        problems=_metrics_problems(train, unreadable, status, config))


def _metrics_problems(train: list[dict[str, Any]], unreadable: list[str],
                      status: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """What is wrong with a run's metrics file: lines that are not records, and training
    steps without a row (one row per step is written) before the step the run reached."""
    problems = []
    if unreadable:
        problems.append(f"{len(unreadable)} unreadable line{'s' * (len(unreadable) > 1)}")
    steps = [row["step"] for row in train]
    recorded = status.get("step")
    reached: int = recorded if isinstance(recorded, int) else 0
    total = config.get("steps")
    if status.get("status") == "finished" and isinstance(total, int):
        reached = max(reached, total)
    start = steps[0] - 1 if steps else reached  # a run started from a checkpoint's step
    expected = max(reached, steps[-1] if steps else 0) - start
    missing = expected - len(steps)
    if missing > 0:
        problems.append(f"{missing} step{'s' * (missing > 1)} without a row")
    return problems


def best_eval(run: RunRecord) -> tuple[str, float, int] | None:
    """(metric, best value, its step) over the eval lines: accuracy if there is one, else
    bits_per_byte, else loss."""
    for name in ("accuracy", "bits_per_byte", "loss"):
        steps, values = run.series(run.eval, name, most=len(run.eval))
        if values:
            pick = max if name in HIGHER_IS_BETTER else min
            value = pick(values)
            return name, value, steps[values.index(value)]
    return None


# ---- plots -----------------------------------------------------------------------------------


def _new_figure(**kwargs: Any) -> Figure:
    # Without a writable home matplotlib warns, on import, that its cache is a temporary folder:
    # the plots do not need a lasting cache, so that record is left out.
    quiet = logging.getLogger("matplotlib")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        from matplotlib.figure import Figure  # the object API: files only, no pyplot state
    finally:
        quiet.setLevel(level)
    return Figure(layout="constrained", **kwargs)


def _figure(title: str, xlabel: str = "step", ylabel: str = "") -> tuple[Figure, Any]:
    fig = _new_figure(figsize=(7, 3.6), dpi=110)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _log_scale_if_wide(ax: Any, values: list[float]) -> None:
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values) and max(positive) > 20 * min(positive):
        ax.set_yscale("log")


def _metric_plots(run: RunRecord) -> list[tuple[str, Figure]]:
    """Train and eval loss, each eval metric, the learning rate and the gradient norm: those the
    run logged."""
    plots: list[tuple[str, Figure]] = []
    steps, loss = run.series(run.train, "loss")
    if loss:
        fig, ax = _figure("loss", ylabel="loss")
        ax.plot(steps, loss, lw=1.2, label="train")
        eval_steps, eval_loss = run.series(run.eval, "loss")
        if eval_loss:
            ax.plot(eval_steps, eval_loss, "o-", ms=4, label="eval")
        _log_scale_if_wide(ax, loss + eval_loss)
        ax.legend()
        plots.append(("train and eval loss", fig))
    for name in ("accuracy", "bits_per_byte", "exact_match", "normalised_match"):
        eval_steps, values = run.series(run.eval, name)
        if values:
            fig, ax = _figure(f"eval {name}", ylabel=name)
            ax.plot(eval_steps, values, "o-", ms=4, color="tab:green")
            plots.append((f"eval {name}", fig))
    for name, caption in (("lr", "learning rate"), ("grad_norm", "gradient global norm")):
        s, values = run.series(run.train, name)
        if values:
            fig, ax = _figure(caption, ylabel=name)
            ax.plot(s, values, lw=1.2, color="tab:purple" if name == "lr" else "tab:red")
            if name == "grad_norm":
                _log_scale_if_wide(ax, values)
            plots.append((caption, fig))
    return plots


def _timing_plots(run: RunRecord) -> list[tuple[str, Figure]]:
    """Throughput and a histogram of step time per timing window, when the run timed any."""
    if not run.timing:
        return []
    plots: list[tuple[str, Figure]] = []
    s, rate = run.series(run.timing, "examples_per_s")
    fig, ax = _figure("throughput (device time per timing window)", ylabel="examples/s")
    ax.plot(s, rate, "o-", ms=3, color="tab:orange")
    ax.set_ylim(bottom=0)
    plots.append(("throughput", fig))
    _, step_s = run.series(run.timing[1:] or run.timing, "step_time_s")  # first: warmup
    size, unit = time_unit(statistics.median(step_s)) if step_s else (1e-6, "µs")
    fig, ax = _figure("step time per timing window (after warmup)",
                      xlabel=f"{unit} per step", ylabel="windows")
    ax.hist([t / size for t in step_s], bins=min(30, max(5, len(step_s))), color="tab:cyan",
            edgecolor="black")
    plots.append(("step-time histogram", fig))
    return plots


def _wall_time_plots(run: RunRecord) -> list[tuple[str, Figure]]:
    """Where the wall time went, when the run's summary splits it."""
    split = run.summary.get("wall_time_split_s")
    if not split:
        return []
    parts = [(name, seconds) for name, seconds in split.items() if seconds > 0]
    fig, ax = _figure("where the wall time went", xlabel="seconds", ylabel="")
    ax.barh([n for n, _ in parts], [s for _, s in parts], color="tab:blue")
    ax.invert_yaxis()
    return [("wall-time split", fig)]


def _plot_run(run: RunRecord, out_dir: Location,
              ) -> list[tuple[str, Location]]:
    """Each plot the run's files allow, as ``(caption, png path)``."""
    plots = [*_metric_plots(run), *_timing_plots(run), *_wall_time_plots(run)]

    out_dir.make_dirs()
    written = []
    for caption, fig in plots:
        path = out_dir / (caption.replace(" ", "_").replace("-", "_") + ".png")
        path.write_bytes(_image(fig))
        written.append((caption, path))
    return written


def _image(fig: Figure, image_format: str = "png") -> bytes:
    """The figure as the bytes of an image file, for ``location.write_bytes``: matplotlib's own
    ``savefig(path)`` would write through a link at that name."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=image_format)
    return buffer.getvalue()


# ---- the HTML report -------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    return "" if value is None else str(value)


def _table(rows: list[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>"
                    for k, v in rows)
    return f"<table>{cells}</table>"


def _num(value: Any, spec: str, scale: float = 1.0, suffix: str = "") -> str | None:
    return None if value is None else f"{value * scale:{spec}}{suffix}"


def _summary_rows(run: RunRecord) -> list[tuple[str, Any]]:
    s = run.summary
    best = best_eval(run)
    rows: list[tuple[str, Any]] = [
        ("status", run.status.get("status")),
        ("steps", f"{run.last_step:,} of {run.config.get('steps'):,}"),
        ("final train loss", s.get("final_loss")),
        ("best eval", f"{best[0]} {best[1]:.6g} at step {best[2]}" if best else "no eval"),
    ]
    if s:
        peak = s.get("peak") or {}
        rows += [
            ("median step time", None if s.get("step_time_median_s") is None
             else duration(s["step_time_median_s"])),
            ("throughput", f"{_num(s.get('steps_per_s'), ',.1f')} steps/s, "
                           f"{_num(s.get('examples_per_s'), ',.0f')} examples/s"),
            ("compile", _num(s.get("compile_s"), ".2f", suffix=" s")),
            ("wall time", _num(s.get("wall_s"), ".2f", suffix=" s")),
            ("goodput (step compute / wall)", _num(s.get("goodput"), ".1%")),
            ("FLOPs per step", _num(s.get("flops_per_step"), ",.0f")),
            ("achieved", _num(s.get("flops_per_s"), ",.2f", 1e-9, " GFLOP/s")),
            ("MFU", _num(s.get("mfu"), ".2%") or s.get("mfu_note")),
            ("peak used", f"{peak['flops_per_s'] / 1e9:,.1f} GFLOP/s: {peak['source']}"
             if peak else None),
        ]
    return rows


def _split_rows(split: dict[str, float], wall_s: float) -> list[tuple[str, Any]]:
    return [(name, f"{duration(seconds)} ({seconds / wall_s:.1%})") for name, seconds in
            split.items()] if wall_s else []


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1000px;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em}th,td{border:1px solid #ccc;
padding:3px 10px;text-align:left;font-size:14px}th{background:#f3f3f3;font-weight:600}
.plots{display:grid;grid-template-columns:1fr 1fr;gap:12px}.plots img{width:100%}
figure{margin:0}figcaption{font-size:13px;color:#555}pre{background:#f7f7f7;padding:1em;
font-size:12px;overflow:auto}"""


def _shown(path: Location) -> object:
    """A run directory as its report names it: a local one resolved (links followed)."""
    local = path.local_path
    return path if local is None else local.resolve()


def write_report(run_dir: Location | str) -> tuple[Location, list[str]]:
    """Write ``report.html`` and its PNGs into the run directory; returns the HTML's path and
    what is wrong with the run's metrics file (its rows that could not be plotted)."""
    extras.require("report", "trainrun report")
    run = load_run(run_dir)
    plot_dir = run.path / PLOT_DIR
    if plot_dir.is_symlink():
        raise ReportError(f"{plot_dir} is a symbolic link (to {os.readlink(str(plot_dir))}), not "
                          "the folder trainrun report writes its plots in; remove the link (what "
                          "it points to is left alone) and run the report again")
    plots = _plot_run(run, plot_dir)
    figures = "".join(
        f'<figure><img src="{PLOT_DIR}/{p.name}" alt="{html.escape(c)}">'
        f"<figcaption>{html.escape(c)}</figcaption></figure>" for c, p in plots)
    split = run.summary.get("wall_time_split_s") or {}
    prov = run.summary.get("provenance") or _read_json(run.path / rundir.PROVENANCE)
    name = html.escape(printable(str(run.config.get("name", run.path.name))))
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>trainrun report: {name}</title><style>{STYLE}</style></head><body>
<h1>{name}</h1><p>{html.escape(printable(str(_shown(run.path))))}</p>
<h2>Summary</h2>{_table(_summary_rows(run))}
<h2>Plots</h2><div class="plots">{figures or "<p>no metrics written yet</p>"}</div>
<h2>Wall time</h2>{_table(_split_rows(split, run.summary.get("wall_s") or 0))
                    if split else "<p>run not finished</p>"}
<h2>Provenance</h2>{_table(list(prov.items()))}
<h2>Config</h2><pre>{html.escape(yaml.safe_dump(run.config, sort_keys=False))}</pre>
</body></html>
"""
    out = run.path / REPORT_HTML
    out.write_text(page)  # a link there is replaced by the report, never written through
    return out, metrics_notes([run])


def _read_json(path: Location) -> dict[str, Any]:
    return rundir.read_json(path) if path.exists() else {}


# ---- compare and list ------------------------------------------------------------------------


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def metrics_notes(runs: list[RunRecord]) -> list[str]:
    """A line for each run whose metrics file has lines that are not records or steps without
    a row: plots and tables leave those out."""
    return [f"{run.path / rundir.METRICS}: {', '.join(run.problems)}; plotted without them"
            for run in runs if run.problems]


def compare(run_dirs: list[Location | str], out: Location | str = "compare.png",
            ) -> tuple[Location, str, list[str]]:
    """Overlay the runs' curves (train loss, eval loss, lr, grad norm) in one PNG; return it,
    a table of their final metrics and what is wrong with their metrics files."""
    extras.require("report", "trainrun compare")
    out_path = location.location(out)
    formats = _new_figure().canvas.get_supported_filetypes()
    if out_path.suffix.lstrip(".").lower() not in formats:
        raise ReportError(f"--out {out_path}: matplotlib writes no "
                          f"{out_path.suffix or 'suffix-less'} file; give a name ending in one of "
                          f"{', '.join('.' + f for f in sorted(formats))}")
    runs = [load_run(p) for p in run_dirs]
    labels = [r.path.name for r in runs]
    if len(set(labels)) < len(labels):
        labels = [str(r.path) for r in runs]
    fig = _new_figure(figsize=(12, 7), dpi=100)
    axes = fig.subplots(2, 2)
    panels = [("train loss", "train", "loss"), ("eval loss", "eval", "loss"),
              ("learning rate", "train", "lr"), ("gradient global norm", "train", "grad_norm")]
    for ax, (title, split, name) in zip(axes.flat, panels, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        values_seen: list[float] = []
        for run, label in zip(runs, labels, strict=True):
            steps, values = run.series(run.train if split == "train" else run.eval, name)
            if values:
                ax.plot(steps, values, "o-" if split == "eval" else "-", ms=3, lw=1.2,
                        label=label)
                values_seen += values
        if values_seen:
            _log_scale_if_wide(ax, values_seen)
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "none of the runs has it", ha="center", transform=ax.transAxes)
    try:
        out_path.parent.make_dirs()
        # the format from the name, as savefig(out) would; the bytes never go through a link
        out_path.write_bytes(_image(fig, out_path.suffix.lstrip(".").lower()))
    except OSError as err:
        line, code = path_refused(err)
        if code == 2:  # a name no file system takes: the input's
            raise ReportError(f"--out {line}") from None
        raise WriteFailed(f"cannot write {out_path}: {err.strerror}; give --out a writable place "
                          "(e.g. --out /tmp/compare.png)") from None
    rows = []
    for run, label in zip(runs, labels, strict=True):
        s, best = run.summary, best_eval(run)
        rows.append([
            label, run.status.get("status", ""), f"{run.last_step}/{run.config.get('steps')}",
            _fmt(run.train[-1]["loss"]) if run.train else "",
            f"{best[0]} {best[1]:.6g}" if best else "",
            _fmt(s.get("steps_per_s")), _fmt(s.get("mfu")), _fmt(s.get("goodput"))])
    header = ["run", "status", "step", "final loss", "best eval", "steps/s", "mfu", "goodput"]
    return out_path, _text_table(header, rows), metrics_notes(runs)


def list_runs(root: Location | str = "runs") -> str:
    """A table of the trainrun runs under ``root`` (the folders one or two levels down that
    ``train`` takes for runs: ``_run_dirs``). An empty folder, bucket or prefix has none; a
    local folder that is not there, or a bucket that is not, is refused."""
    root = location.location(root)
    if not root.is_dir():
        root.require_bucket()
        # a prefix with nothing below it is an empty folder, as a bucket has no folders
        if root.local_path is not None or root.is_file():
            raise ReportError(f"no runs directory {root}; train a run first, or pass --root DIR")
    rows = []
    for name, run_dir in _run_dirs(root):
        try:
            run = load_run(run_dir)
        except rundir.DamagedFile as err:  # one damaged run does not hide the others
            rows.append([printable(name), printable(f"unreadable ({err.path.name} is damaged)"),
                         "", "", "", ""])
            continue
        best = best_eval(run)
        status = str(run.status.get("status", "unknown"))
        if run.status.get("note"):
            status += f" ({run.status['note']})"
        if run.problems:
            status += f" [{rundir.METRICS}: {', '.join(run.problems)}]"
        rows.append([
            printable(name), printable(status),
            f"{run.last_step}/{run.config.get('steps')}",
            _fmt(run.train[-1]["loss"]) if run.train else "",
            f"{best[0]} {best[1]:.6g} (step {best[2]})" if best else "",
            str(run.status.get("updated", ""))])
    if not rows:
        return f"no runs under {root}"
    return _text_table(["run", "status", "step", "last loss", "best eval", "updated"], rows)


def _run_dirs(root: Location) -> list[tuple[str, Location]]:
    """``(name relative to root, path)`` of each folder one or two levels below ``root`` that
    holds a trainrun run's ``config.yaml`` (``saved_config_file``: one with trainrun's marker,
    or locally a run from before it; someone else's ``config.yaml`` is no run), in the order of
    those files' paths. On object storage each level is one listing by prefix (a run's own
    files are not listed further)."""
    local = root.local_path
    if local is not None:  # globbed, each level at once
        configs = [*local.glob(f"*/{rundir.CONFIG}"), *local.glob(f"*/*/{rundir.CONFIG}")]
        return [(str(c.parent.relative_to(local)), location.local(c.parent))
                for c in sorted(configs) if saved_config_file(location.local(c.parent)) is not None]

    def is_run(names: list[str]) -> bool:  # saved_config_file's test, from the listing
        return rundir.CONFIG in names and rundir.MARKER in names

    found = []
    for name in root.list_names():
        names = (root / name).list_names()
        if is_run(names):
            found.append((name, root / name))
        for inner in names:
            if inner not in rundir.RUN_FILES and inner != REPORT_HTML and is_run(
                    (root / name / inner).list_names()):
                found.append((f"{name}/{inner}", root / name / inner))
    return sorted(found, key=lambda pair: PurePosixPath(pair[0], rundir.CONFIG))
