"""Training into a run directory on object storage (``--run-dir gs://...``, ``s3://...``),
against the real emulators of ``conftest.py``: the run's files and committed checkpoints are in
the bucket, another machine (another stage) resumes it bit for bit, one job holds it by its
lease, a store that pauses is waited for and one gone past the deadline stops the run in one
line at its last committed step, from which it resumes bitwise. Nothing makes a local folder
named ``gs:`` or ``s3:``: each test runs in an empty working directory that must stay empty."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FAULT_STACKS, cli_env, finish, losses, run_cli

import trainrun
from trainrun import rundir
from trainrun.config import load_config
from trainrun.errors import UserError
from trainrun.rundir.lease import LEASES, Lease, LeaseLost, job_gone
from trainrun.rundir.lock import RunDirLocked
from trainrun.storage import location, remote

MLP = ["metrics.tensorboard=false", "checkpoint.every=2"]


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """An empty working directory that stays empty (no folder named ``gs:`` or ``s3:``)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    yield work
    assert sorted(os.listdir(work)) == []


def train(url: str, steps: int, cache: Path, monkeypatch, *extra: str):
    """The mlp for ``steps`` into ``url``, with the stage in ``cache`` (one machine's)."""
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(cache))
    return trainrun.run(load_config("mlp", [*MLP, f"steps={steps}", *extra]), url,
                        out=io.StringIO())


def remote_losses(url: str) -> np.ndarray:
    text = (location.location(url) / rundir.METRICS).read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return np.array([r["loss"] for r in records if r.get("split", "train") == "train"],
                    np.float32)


def local_losses(*overrides: str) -> np.ndarray:
    """The losses of the same run on local disk: once per test process for each overrides
    (the long runs' reference is the same in every test that needs it)."""
    return _local_losses(tuple(overrides)).copy()


@functools.cache
def _local_losses(overrides: tuple[str, ...]) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "local"
        trainrun.run(load_config("mlp", list(overrides)), run_dir, out=io.StringIO())
        return losses(run_dir)


def test_a_run_in_a_bucket_resumes_on_another_machine_bit_for_bit(bucket, workdir, tmp_path,
                                                                  monkeypatch):
    url = f"{bucket}/runs/a"
    train(url, 4, tmp_path / "machine-1", monkeypatch)
    root = location.location(url)
    names = set(root.list_tree())
    assert {"trainrun.json", "config.yaml", "provenance.json", "metrics.jsonl", "status.json",
            "summary.json", "timing.jsonl", "checkpoints/2/commit_success.txt",
            "checkpoints/4/commit_success.txt", f"{LEASES}/00000001"} <= names
    assert rundir.read_json(root / rundir.STATUS)["status"] == "finished"
    assert rundir.committed_steps(root / rundir.CHECKPOINTS) == [2, 4]
    assert json.loads((root / LEASES / "00000001").read_bytes())["released"]

    summary = train(url, 6, tmp_path / "machine-2", monkeypatch)  # a new stage: from the bucket
    assert summary.start_step == 4 and summary.steps_done == 6
    got = remote_losses(url)
    want = local_losses(*MLP, "steps=6")
    assert len(got) == 6
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert rundir.read_status(root)["step"] == 6


@pytest.mark.parametrize("instances_dropped", [False, True], ids=["", "instances-dropped"])
def test_a_changed_byte_in_a_bucket_step_moves_it_aside_and_resumes_from_the_one_before(
        bucket, workdir, tmp_path, monkeypatch, instances_dropped):
    url = f"{bucket}/runs/flipped"
    train(url, 4, tmp_path / "m", monkeypatch)
    if instances_dropped:  # as another library in the process may: Orbax's client is kept
        type(remote.filesystem(url)).clear_instance_cache()
    step4 = location.location(url) / rundir.CHECKPOINTS / "4"
    name = max((n for n in (step4 / "state").list_tree() if "/d/" in f"/{n}"),
               key=lambda n: (step4 / "state").list_tree()[n])
    data = bytearray((step4 / "state" / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step4 / "state" / name).write_bytes(bytes(data))
    out = io.StringIO()
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "m2"))
    summary = trainrun.run(load_config("mlp", [*MLP, "steps=6"]), url, out=out)
    assert summary.start_step == 2
    assert re.search(r"warning: checkpoint step 4 cannot be read \(checksum mismatch in state/"
                     r".*\); moved it to .*/checkpoints/corrupt/4-", out.getvalue()), out.getvalue()
    ckpt = location.location(url) / rundir.CHECKPOINTS
    assert rundir.committed_steps(ckpt)[-2:] == [4, 6]  # 4 saved again on the way to 6
    assert [n.split("-")[0] for n in (ckpt / "corrupt").list_names()] == ["4"]
    np.testing.assert_array_equal(remote_losses(url).view(np.uint32),
                                  local_losses(*MLP, "steps=6").view(np.uint32))


@pytest.mark.slow
def test_a_bucket_run_records_its_data_files_and_refuses_them_changed(bucket, workdir, tmp_path,
                                                                      monkeypatch):
    from trainrun import data
    from trainrun.checkpointing.resume import DataChangedError

    def arrays(scale: float) -> str:
        x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) * scale
        np.savez(tmp_path / "train.npz", x=x, y=x.sum(1, keepdims=True))
        data._load.cache_clear()  # read again, as a new process would
        return str(tmp_path / "train.npz")

    url = f"{bucket}/runs/data"
    files = ["data.kind=arrays", f"data.paths={arrays(1.0)}", "data.batch_size=16"]
    digest = hashlib.sha256((tmp_path / "train.npz").read_bytes()).hexdigest()
    train(url, 2, tmp_path / "machine-1", monkeypatch, *files)
    record = location.location(url) / rundir.DATA_FILES
    assert rundir.read_json(record) == {"files": {str(tmp_path / "train.npz"): f"sha256:{digest}"}}
    arrays(2.0)  # the same name, other values
    with pytest.raises(DataChangedError, match=f"{tmp_path / 'train.npz'} changed"):
        train(url, 4, tmp_path / "machine-2", monkeypatch, *files)
    assert rundir.committed_steps(location.location(url) / rundir.CHECKPOINTS) == [2]


def test_one_job_holds_a_bucket_run_until_its_lease_runs_out(bucket, workdir, tmp_path,
                                                            monkeypatch):
    url = f"{bucket}/runs/held"
    root = location.location(url)
    other = Lease(root, 5)  # another job, alive, that stops renewing
    other.acquire()
    with pytest.raises(RunDirLocked, match=r"is held by another job \(pid \d+ on host .*\); "
                       r"its lease was renewed \d+ s ago and runs out \d+ s from now .*"
                       r"storage\.lease_s=5\)") as refused:
        train(url, 2, tmp_path / "m", monkeypatch, "storage.lease_s=5")
    assert "\n" not in str(refused.value)
    assert set(root.list_tree()) == {f"{LEASES}/00000001"}  # nothing else written
    assert not job_gone(root)
    deadline = time.monotonic() + 30
    while not job_gone(root):  # the store's clock: the object's age passes the lease
        assert time.monotonic() < deadline, "the lease did not run out"
        time.sleep(0.5)
    train(url, 2, tmp_path / "m", monkeypatch, "storage.lease_s=5")  # takes it over
    assert (root / LEASES).list_names() == ["00000002"]
    with pytest.raises(LeaseLost, match="taken over by another job"):
        other.renew()
    # a lease released by a job that ended is taken at once, however long the lease
    summary = train(url, 4, tmp_path / "m", monkeypatch, "storage.lease_s=3600")
    assert summary.start_step == 2
    assert (root / LEASES).list_names() == ["00000003"]


def test_a_refused_run_leaves_a_bucket_location_as_it_found_it(bucket, workdir, tmp_path,
                                                                monkeypatch):
    url = f"{bucket}/runs/refused"
    root = location.location(url)
    with pytest.raises(UserError, match=r"init\.from"):
        train(url, 2, tmp_path / "m", monkeypatch, f"init.from={tmp_path / 'no-such-model'}")
    assert root.list_tree() == {}

    (root / "notes.txt").write_bytes(b"mine")
    with pytest.raises(UserError, match=r"--run-dir .*/runs/refused is not a trainrun run "
                       r"directory \(it holds notes\.txt and no trainrun\.json\)"):
        train(url, 2, tmp_path / "m", monkeypatch)
    assert root.list_tree() == {"notes.txt": 4}

    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "m"))
    with pytest.raises(UserError, match="object storage cannot rename: give a new --run-dir"):
        trainrun.run(load_config("mlp", MLP), f"{bucket}/runs/fresh", fresh=True,
                     out=io.StringIO())
    assert location.location(f"{bucket}/runs/fresh").list_tree() == {}


@pytest.mark.slow
def test_verify_resume_on_a_bucket_kills_mid_upload_and_passes(bucket, workdir, tmp_path):
    done = run_cli("verify-resume", "steps=12", "checkpoint.every=4", "metrics.tensorboard=false",
                   "--work-dir", f"{bucket}/verify", TRAINRUN_CACHE_DIR=str(tmp_path / "c"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kill -9 during async save of 8        in flight (partial dir left)" in done.stdout
    assert "PASS: every step's loss and grad_norm and the final state" in done.stdout


# Four saves: the outages below begin after the first commit, while three are still to come.
LONG = ["steps=4000", "checkpoint.every=1000", "metrics.tensorboard=false",
        "storage.sync_every_s=1"]


def _start(url: str, cache: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "trainrun", "train", "--run-dir", url,
                             *LONG, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cli_env(TRAINRUN_CACHE_DIR=str(cache), **FAULT_STACKS))


def _first_commit(url: str, proc: subprocess.Popen[str]) -> None:
    ckpt = location.location(url) / rundir.CHECKPOINTS
    deadline = time.monotonic() + 240
    while not rundir.committed_steps(ckpt):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint was committed"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_store_that_stops_answering_for_30_s_is_waited_for(object_store_servers, bucket,
                                                           workdir, tmp_path):
    server = object_store_servers[remote.scheme_of(bucket)]
    url = f"{bucket}/runs/paused"
    proc = _start(url, tmp_path / "m")
    _first_commit(url, proc)
    server.pause()
    paused = time.monotonic()
    try:
        time.sleep(30)
        still_running = proc.poll() is None  # it cannot end while its last save waits
    finally:
        server.resume()
    out, err = finish(proc, 300)
    assert proc.returncode == 0, out + err
    assert still_running and time.monotonic() - paused >= 30
    # the console said what it was waiting for
    assert re.search(r"waiting for checkpoint step \d+ to (start|finish) uploading to .*"
                     r"/runs/paused/checkpoints \(\d+ s so far\)|object storage has not "
                     r"answered .*/runs/paused/.* for \d+ s \(\w+\); trying again until "
                     r"storage\.deadline_s=300", out), out[-3000:]
    got = remote_losses(url)
    np.testing.assert_array_equal(got.view(np.uint32),
                                  local_losses(*LONG).view(np.uint32))


@pytest.mark.slow
def test_a_store_gone_past_the_deadline_stops_the_run_in_one_line_and_it_resumes(
        object_store_servers, bucket, workdir, tmp_path):
    server = object_store_servers[remote.scheme_of(bucket)]
    url = f"{bucket}/runs/gone"
    proc = _start(url, tmp_path / "m", "storage.deadline_s=5")
    _first_commit(url, proc)
    server.pause()
    try:
        out, err = finish(proc, 240)
    finally:
        server.resume()
    assert proc.returncode == 1, out + err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert "object storage did not answer" in errors[0] and "storage.deadline_s=5" in errors[0]
    assert "; the last committed checkpoint is step " in errors[0]
    step = int(errors[0].split("the last committed checkpoint is step ")[1].split()[0])
    stage = next((tmp_path / "m" / "remote-runs").iterdir())
    status = json.loads((stage / rundir.STATUS).read_text())
    assert status["status"] == "failed" and status["step"] == step

    again = run_cli("train", "--run-dir", url, *LONG, TRAINRUN_CACHE_DIR=str(tmp_path / "n"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from step {step}" in again.stdout
    got = remote_losses(url)
    np.testing.assert_array_equal(got.view(np.uint32),
                                  local_losses(*LONG).view(np.uint32))


RUN = ["model.hidden=[32]", "data.examples=512", "data.batch_size=64", "data.shuffle=true",
       "metrics.every=10", "metrics.tensorboard=false", "checkpoint.every=10"]


@pytest.mark.slow
def test_two_processes_train_into_one_bucket_and_it_resumes_on_one_process_and_another_mesh(
        bucket, workdir, tmp_path):
    reference = tmp_path / "one"  # one process holding the same 4 devices, on disk
    single = run_cli("train", "--run-dir", str(reference), *RUN, "steps=30", devices=4)
    assert single.returncode == 0, single.stderr[-3000:]
    url = f"{bucket}/runs/two"
    launched = run_cli("launch", "-n", "2", "--devices-per-process", "2", "--", "train",
                       "--run-dir", url, *RUN, "steps=20", TRAINRUN_CACHE_DIR=str(tmp_path / "a"))
    assert launched.returncode == 0, launched.stdout[-3000:]
    step = location.location(url) / rundir.CHECKPOINTS / "20"
    names = set(step.list_tree())
    # each process wrote its own shards and data position into the one bucket
    assert {"data/process_0-of-2.json", "data/process_1-of-2.json",
            "state/ocdbt.process_0/manifest.ocdbt", "state/ocdbt.process_1/manifest.ocdbt",
            "commit_success.txt"} <= names
    assert len(remote_losses(url)) == 20  # process 0 wrote each step once

    # one process, 4 devices (another machine's stage) goes on to 30 ...
    resumed = run_cli("train", "--run-dir", url, *RUN, "steps=30", devices=4,
                      TRAINRUN_CACHE_DIR=str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step 20 ({url}/checkpoints/20)" in resumed.stdout
    # Not bitwise across process counts (gloo sums in another order): as from disk, within
    # 1e-6, where a fresh state or a wrong data position would be far off.
    np.testing.assert_allclose(remote_losses(url), losses(reference), rtol=1e-6, atol=0)
    # ... and its step 20 restores onto another mesh: 2 devices, FSDP
    other = run_cli("train", "--run-dir", url, *RUN, "steps=40", "mesh.data=1", "mesh.fsdp=2",
                    "--allow-config-change", devices=2, TRAINRUN_CACHE_DIR=str(tmp_path / "c"))
    assert other.returncode == 0, other.stderr[-3000:]
    assert f"resumed from step 30 ({url}/checkpoints/30)" in other.stdout
    assert len(remote_losses(url)) == 40


@pytest.mark.slow
def test_credentials_are_never_written_to_the_run_or_its_stage(bucket, workdir, tmp_path):
    secret = "k3y-" + os.urandom(8).hex()  # the emulators take any key
    variable = ("AWS_SECRET_ACCESS_KEY" if remote.scheme_of(bucket) == "s3"
                else "GOOGLE_AUTH_TOKEN_FOR_TESTING")
    url = f"{bucket}/runs/secret"
    done = run_cli("train", "--run-dir", url, *MLP, "steps=2",
                   TRAINRUN_CACHE_DIR=str(tmp_path / "c"), **{variable: secret})
    assert done.returncode == 0, done.stderr[-3000:]
    assert secret not in done.stdout + done.stderr
    root = location.location(url)
    for name in root.list_tree():
        assert secret.encode() not in (root / name).read_bytes(), name
    for path in (tmp_path / "c").rglob("*"):
        assert not path.is_file() or secret.encode() not in path.read_bytes(), path


def test_a_restore_compares_the_stores_checksums_and_verify_checkpoint_reads_every_byte(
        bucket, workdir, tmp_path, monkeypatch):
    from trainrun.checkpointing import integrity

    url = f"{bucket}/runs/sums"
    train(url, 2, tmp_path / "m", monkeypatch)
    item = location.location(url) / rundir.CHECKPOINTS / "2" / "state"
    manifest = json.loads((item / integrity.MANIFEST).read_text())
    assert all(entry["store"].startswith(remote.scheme_of(bucket) + ":")
               for entry in manifest["files"].values())
    reads: list[str] = []
    real = integrity.file_digest
    monkeypatch.setattr(integrity, "file_digest",
                        lambda path, size=None: reads.append(str(path)) or real(path, size))
    assert integrity.verify_step(item.parent, read=False).problems == []
    assert not [r for r in reads if "/state/" in r]  # the state's bytes were not read
    # a sha256 that no longer matches is found only by reading (verify-checkpoint) ...
    name = next(iter(manifest["files"]))
    manifest["files"][name]["sha256"] = "0" * 64
    (item / integrity.MANIFEST).write_text(json.dumps(manifest))
    assert integrity.verify_step(item.parent, read=False).problems == []
    assert [p for p in integrity.verify_step(item.parent).problems if "checksum mismatch" in p]
    # ... and an object written again with other bytes by its store checksum alone
    data = bytearray((item / name).read_bytes())
    data[0] ^= 0xFF
    (item / name).write_bytes(bytes(data))
    found = integrity.verify_step(item.parent, read=False).problems
    assert found and "the store's" in found[0], found


class FaultyProxy:
    """An HTTP proxy in front of an emulator that answers ``503 Service Unavailable`` to every
    request while ``failing`` is set, and otherwise passes each request on and its answer
    back: a store that answers errors for a while."""

    def __init__(self, upstream: str):
        import http.client
        import http.server
        import threading
        import urllib.parse

        target = urllib.parse.urlsplit(upstream)
        proxy = self
        self.failing = threading.Event()
        self.refused = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if not size:
                            self.rfile.readline()
                            return data
                        data += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _any(self):
                body = self._body()
                if proxy.failing.is_set():
                    proxy.refused += 1
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "connection")}
                headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                upstream.request(self.command, self.path, body, headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                head = self.command == "HEAD"  # its Content-Length is the object's: kept
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection") and (
                            head or key.lower() != "content-length"):
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_a_store_that_answers_errors_for_a_while_is_retried_and_the_run_goes_on(
        object_store_servers, bucket, workdir, tmp_path):
    scheme = remote.scheme_of(bucket)
    proxy = FaultyProxy(object_store_servers[scheme].url)
    variable = "AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST"
    url = f"{bucket}/runs/errors"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainrun", "train", "--run-dir", url, *LONG],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=cli_env(TRAINRUN_CACHE_DIR=str(tmp_path / "m"), **{variable: proxy.url}))
        _first_commit(url, proc)
        proxy.failing.set()
        time.sleep(10)
        proxy.failing.clear()
        out, err = finish(proc, 300)
    finally:
        proxy.close()
    assert proc.returncode == 0, out + err
    assert proxy.refused > 0  # the run did meet the errors
    np.testing.assert_array_equal(remote_losses(url).view(np.uint32),
                                  local_losses(*LONG).view(np.uint32))
