"""The run directory's layout: what a run leaves on disk, and under which names.

    <run dir>/trainrun.json     the marker: this folder is a trainrun run (format version)
              trainrun.lock     held (flock) by the one process writing the run
              config.yaml       the resolved config
              provenance.json   what the run was measured on
              data_files.json   the content fingerprint of each data file the run reads
              metrics.jsonl     one line per training step (and per eval)
              summary.json      written at the end: final loss, timing, throughput
              timing.jsonl      one line per timing window: device time per step
              completions.jsonl sampled completions of an rl run (rl.log_completions)
              tokenizer/        the tokenizer the run reads text with (data/kept_tokenizer.py)
              status.json       running | finished | preempted | failed, and by which process
              tensorboard/      TensorBoard event files
              checkpoints/      Orbax step directories (see checkpoint.py)
"""

from __future__ import annotations

from pathlib import Path

from trainrun.config import RunConfig
from trainrun.data.kept_tokenizer import FOLDER as TOKENIZER
from trainrun.rundir.lock import LOCK
from trainrun.storage import location
from trainrun.storage.location import LocalLocation

MARKER = "trainrun.json"
FORMAT = 1  # the run directory layout this trainrun reads and writes
CONFIG = "config.yaml"
PROVENANCE = "provenance.json"
DATA_FILES = "data_files.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TIMING = "timing.jsonl"
COMPLETIONS = "completions.jsonl"
STATUS = "status.json"
CHECKPOINTS = "checkpoints"  # the checkpoint folder in a run directory, unless checkpoint.dir
ORBAX_TMP = ".orbax-checkpoint-tmp"  # Orbax's suffix for a step still being written
COMMIT_FILE = "commit_success.txt"  # Orbax's mark of a committed step on object storage

# The files a run writes at its top: none may be a link, which a write would follow out of it.
RUN_FILES = (MARKER, LOCK, CONFIG, PROVENANCE, DATA_FILES, METRICS, SUMMARY, TIMING, STATUS,
             COMPLETIONS, TOKENIZER)


def default_run_dir(config: RunConfig) -> LocalLocation:
    return location.local(Path("runs") / config.name)
