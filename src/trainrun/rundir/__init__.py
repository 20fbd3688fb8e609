"""The run directory: what a run leaves on disk, and where (``layout.py``).

A run directory with a committed checkpoint resumes from it; ``--fresh`` moves the run aside.
trainrun writes only into a folder it can tell is its own (``ownership.py``). The modules:
``layout.py`` (the names), ``run_files.py`` (its JSON and YAML, written whole),
``run_start.py`` (the files as a run starts), ``status.py`` (where a run stands),
``checkpoint_steps.py`` (committed saves), ``path_checks.py`` (paths refused up front),
``ownership.py`` (whose folder it is), ``run_directory.py`` (claim and lock), ``lock.py``,
``lease.py``, ``remote_run.py``, ``write_failures.py`` (a refused write, one line),
``export_dir.py``, ``run_config.py``. Every file is read and written through the storage layer
below (``trainrun.storage``).

These names are re-exported here so that callers write ``rundir.METRICS``,
``rundir.read_status(...)``.
"""

from trainrun.rundir.checkpoint_steps import committed_steps, uncommitted_steps
from trainrun.rundir.layout import (
    CHECKPOINTS,
    COMMIT_FILE,
    COMPLETIONS,
    CONFIG,
    DATA_FILES,
    FORMAT,
    MARKER,
    METRICS,
    ORBAX_TMP,
    PROVENANCE,
    RUN_FILES,
    STATUS,
    SUMMARY,
    TIMING,
    default_run_dir,
)
from trainrun.rundir.ownership import Found, enclosing_run, inspect, write_marker
from trainrun.rundir.run_directory import RunDirectory, move_aside
from trainrun.rundir.run_files import DamagedFile, read_json, read_yaml, write_json, write_text
from trainrun.rundir.run_start import read_data_files, start, truncate_metrics
from trainrun.rundir.status import (
    STATUSES,
    finished_message,
    mark_failed,
    read_status,
    read_summary,
    record_stopped,
    write_status,
)

__all__ = [
    "CHECKPOINTS",
    "COMMIT_FILE",
    "COMPLETIONS",
    "CONFIG",
    "DATA_FILES",
    "FORMAT",
    "MARKER",
    "METRICS",
    "ORBAX_TMP",
    "PROVENANCE",
    "RUN_FILES",
    "STATUS",
    "STATUSES",
    "SUMMARY",
    "TIMING",
    "DamagedFile",
    "Found",
    "RunDirectory",
    "committed_steps",
    "default_run_dir",
    "enclosing_run",
    "finished_message",
    "inspect",
    "mark_failed",
    "move_aside",
    "read_data_files",
    "read_json",
    "read_status",
    "read_summary",
    "read_yaml",
    "record_stopped",
    "start",
    "truncate_metrics",
    "uncommitted_steps",
    "write_json",
    "write_marker",
    "write_status",
    "write_text",
]
