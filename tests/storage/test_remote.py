"""The object-storage layer against real servers (fake-gcs-server, moto): whole objects,
create-if-absent with one winner, versions and listings, and one line for a store that refuses
or stops answering."""

from __future__ import annotations

import contextlib
import io
import re
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from trainrun.storage import location, remote


@pytest.fixture
def deadlines() -> Iterator[contextlib.ExitStack]:
    """Deadlines a test sets (``remote.deadline``), each as before once the test ends."""
    with contextlib.ExitStack() as stack:
        yield stack


def test_whole_objects_read_back_listed_and_deleted(bucket):
    root = location.location(f"{bucket}/runs/x")
    (root / "config.yaml").write_text("steps: 3\n")
    (root / "sub" / "a.bin").write_bytes(b"0123456789")
    assert (root / "config.yaml").read_text() == "steps: 3\n"
    assert (root / "sub" / "a.bin").read_range(2, 5) == b"234"
    assert root.list_names() == ["config.yaml", "sub"]
    assert (root / "sub").is_dir() and not (root / "nothing").is_dir()
    assert (root / "config.yaml").is_file() and not (root / "sub").is_file()
    with (root / "sub" / "a.bin").open_read() as f:
        assert f.read() == b"0123456789"
    (root / "sub").delete_tree()
    (root / "missing").delete()  # nothing there: nothing to do
    assert root.list_names() == ["config.yaml"]


def test_create_if_absent_has_one_winner_and_each_write_a_new_version(bucket):
    path = location.location(f"{bucket}/lock")
    won: list[int] = []

    def contend(i: int) -> None:
        if path.create(f"{i}".encode()):
            won.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and path.read_text() == str(won[0])
    first = path.info()
    path.write_text(f"{won[0]} again")
    second = path.info()
    assert first is not None and second is not None and first.version != second.version
    assert second.updated is not None and (path.parent / "none").info() is None


def test_a_missing_bucket_is_one_line(object_store_servers):
    for scheme in ("gs", "s3"):
        with pytest.raises(remote.StorageRefused, match=r"bucket .* does not exist") as err:
            location.location(f"{scheme}://no-such-bucket-here/x").write_text("1")
        assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_store_that_stops_answering_is_retried_then_one_line(object_store_servers, scheme,
                                                               monkeypatch, deadlines):
    server = object_store_servers[scheme]
    path = location.location(f"{server.new_bucket()}/x")
    monkeypatch.setattr(remote, "REQUEST_TIMEOUT_S", 1.0)
    deadlines.enter_context(remote.deadline(60))
    # Paused for 3 s: the write waits, is tried again and succeeds.
    server.pause()
    timer = threading.Timer(3, server.resume)
    timer.start()
    try:
        path.write_text("after the pause")
    finally:
        timer.join()
        server.resume()
    assert path.read_text() == "after the pause"
    # Paused past the deadline: one line naming the location and the deadline.
    deadlines.enter_context(remote.deadline(4))
    server.pause()
    start = time.monotonic()
    try:
        with pytest.raises(remote.StorageUnavailable, match=r"did not answer writing .* for "
                           r"\d+ s \(storage\.deadline_s=4\)") as err:
            path.write_text("never")
    finally:
        server.resume()
    assert time.monotonic() - start < 60 and "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_deadline_shorter_than_a_request_timeout_is_kept(object_store_servers, scheme,
                                                           deadlines):
    server = object_store_servers[scheme]
    path = location.location(f"{server.new_bucket()}/x")
    path.write_text("before")
    deadlines.enter_context(remote.deadline(3))
    server.pause()
    start = time.monotonic()
    try:
        with pytest.raises(remote.StorageUnavailable, match=r"did not answer reading .* "
                           r"\(storage\.deadline_s=3\)"):
            path.read_text()
    finally:
        server.resume()
    # the deadline and the least wait for an answer, not a whole request timeout (20 s)
    assert time.monotonic() - start < 3 + remote.LEAST_ATTEMPT_S + 2
    assert path.read_text() == "before"


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_every_request_to_a_store_that_stopped_answering_ends_at_the_deadline(
        object_store_servers, scheme, monkeypatch, tmp_path, deadlines):
    server = object_store_servers[scheme]
    bucket = server.new_bucket()
    local = tmp_path / "blob"
    local.write_bytes(bytes(range(256)) * 400)
    location.location(f"{bucket}/x").upload(local)
    monkeypatch.setattr(remote, "REQUEST_TIMEOUT_S", 1.0)
    monkeypatch.setattr(remote.ObjectLocation, "list_tree",
                        lambda self: {"x": local.stat().st_size})
    deadlines.enter_context(remote.deadline(0.5))
    calls = {  # s3fs's upload once waited without end for a store that stopped answering
        "upload": lambda: location.location(f"{bucket}/y").upload(local),
        "write": lambda: location.location(f"{bucket}/z").write_bytes(b"abc"),
        "create": lambda: location.location(f"{bucket}/w").create(b"abc"),
        "copy": lambda: location.location(bucket).copy_tree(location.location(
            f"{bucket}/copy")),
        "ranged read": lambda: location.location(f"{bucket}/x").read_range(0, 10),
    }
    ended: dict[str, BaseException | None] = {}

    def attempt(name: str) -> None:
        try:
            calls[name]()
            ended[name] = None
        except BaseException as err:
            ended[name] = err

    server.pause()
    try:
        for name in calls:
            worker = threading.Thread(target=attempt, args=(name,), daemon=True)
            worker.start()
            worker.join(30)
            assert name in ended, f"{name} still waited for the store after 30 s"
            assert isinstance(ended[name], remote.StorageUnavailable), (name, ended[name])
    finally:
        server.resume()


def test_a_streamed_read_is_ranged_requests_that_seek(bucket, monkeypatch):
    path = location.location(f"{bucket}/data/big.bin")
    data = bytes(range(256)) * 40
    path.write_bytes(data)
    monkeypatch.setattr(remote, "READ_BLOCK", 1000)
    asked: list[tuple[int, int]] = []
    read_range = remote.ObjectLocation.read_range

    def spy(where, start: int, end: int) -> bytes:
        asked.append((start, end))
        return read_range(where, start, end)

    monkeypatch.setattr(remote.ObjectLocation, "read_range", spy)
    with path.open_read() as f:
        assert f.read(10) == data[:10] and f.tell() == 10
        f.seek(5000)
        assert f.read(3000) == data[5000:8000]
        f.seek(-10, io.SEEK_END)
        assert f.read() == data[-10:] and f.read() == b""
    assert asked[0] == (0, 1000) and all(end <= len(data) for _, end in asked)
    assert sum(end - start for start, end in asked) < len(data)  # not the whole object
    with pytest.raises(FileNotFoundError):
        (path.parent / "missing.bin").open_read()


def _glob(pattern: str) -> list[str]:
    return [str(found) for found in location.location(pattern).matches()]


def test_a_glob_matches_objects_below_prefixes_never_the_prefixes(bucket):
    for name in ("a.txt", "b.md", "sub/c.txt", "sub/deeper/d.txt"):
        location.location(f"{bucket}/corpus/{name}").write_text(name)
    assert _glob(f"{bucket}/corpus/*.txt") == [f"{bucket}/corpus/a.txt"]
    assert _glob(f"{bucket}/corpus/**/*.txt") == [
        f"{bucket}/corpus/{n}" for n in ("a.txt", "sub/c.txt", "sub/deeper/d.txt")]
    assert _glob(f"{bucket}/corpus/**") == [
        f"{bucket}/corpus/{n}" for n in ("a.txt", "b.md", "sub/c.txt", "sub/deeper/d.txt")]
    location.location(f"{bucket}/corpus/e.txt").write_text("new")  # seen at once
    assert f"{bucket}/corpus/e.txt" in _glob(f"{bucket}/corpus/*.txt")
    assert _glob(f"{bucket}/nothing/*") == []
    scheme = remote.scheme_of(bucket)
    assert _glob(f"{scheme}://no-such-bucket-here/*") == []
    assert location.location(bucket).bucket_exists() and not location.location(
        f"{scheme}://no-such-bucket-here/x").bucket_exists()
    with pytest.raises(remote.StorageRefused, match="bucket 'no-such-bucket-here' does not"):
        location.location(f"{scheme}://no-such-bucket-here/x").missing_line("object")
    assert location.location(f"{bucket}/x").missing_line("object") == f"no object {bucket}/x"


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_store_that_stops_answering_mid_stream_is_waited_for(object_store_servers, scheme,
                                                               monkeypatch, deadlines):
    server = object_store_servers[scheme]
    path = location.location(f"{server.new_bucket()}/x.bin")
    data = bytes(range(256)) * 16
    path.write_bytes(data)
    monkeypatch.setattr(remote, "READ_BLOCK", 1024)
    monkeypatch.setattr(remote, "REQUEST_TIMEOUT_S", 1.0)
    deadlines.enter_context(remote.deadline(60))
    with path.open_read() as f:
        first = f.read(1024)
        server.pause()
        timer = threading.Timer(3, server.resume)
        timer.start()
        try:
            rest = f.read()
        finally:
            timer.join()
            server.resume()
    assert first + rest == data


@pytest.mark.parametrize("url, says", [
    ("az://c/x", r"^'az://c/x': trainrun does not read or write az:// locations; give "
                 r"gs://BUCKET/PATH, s3://BUCKET/PATH or a local path$"),
    ("https://host/runs/x", "does not read or write https:// locations"),
    ("s3://", r"^'s3://' names no bucket; give s3://BUCKET/PATH$"),
    ("gs:///runs/x", "names no bucket; give gs://BUCKET/PATH"),
    ("gs://grel/../x", r"^'gs://grel/\.\./x' has a '\.\.' segment, .*give the path within "
                       r"bucket 'grel' without '\.', '\.\.' or '//'$"),
    ("s3://rel/runs/../../x", r"has a '\.\.' segment, .*bucket 'rel'"),
    ("gs://b/./x", r"has a '\.' segment"),
    ("gs://b//x", r"has an empty segment \(//\)"),
])
def test_a_location_trainrun_cannot_take_is_one_line_where_it_enters(url, says, tmp_path,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    for enters in (remote.is_remote, location.location):  # every reader asks one or the other
        with pytest.raises(remote.BadLocation, match=says):
            enters(url)
    assert list(tmp_path.iterdir()) == []  # no local folder named az: or gs:


def test_bucket_urls_and_local_paths_are_taken_as_they_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert all(remote.is_remote(u) for u in ("gs://b", "s3://b/", "gs://b/runs/x/", "s3://b/a.b"))
    assert not any(remote.is_remote(p) for p in ("runs/x", "runs/a://b", "./x", "/tmp/x..y"))


def _fresh_clients() -> None:
    """No client fsspec keeps from an earlier test: each reads the environment anew. Only a
    client module already imported is asked: gcsfs picks its class when first imported, which
    trainrun does (imported here first, a later run on the emulator waited without end)."""
    for module, client in (("gcsfs", "GCSFileSystem"), ("s3fs", "S3FileSystem")):
        if module in sys.modules:
            getattr(sys.modules[module], client).clear_instance_cache()


@pytest.mark.parametrize("content, why", [
    (None, "which does not exist"),
    ("{not json", r"which is not a credentials file google-auth reads \(.*not a valid json "
                  r"file\.\)"),
    ('{"type": "service_account"}', r"which is not a credentials file google-auth reads \("
                                    r"Failed to load service account credentials .*\)"),
])
def test_a_gcs_key_file_that_cannot_be_loaded_is_one_line_at_once(
        content, why, object_store_servers, tmp_path, monkeypatch, capsys, deadlines):
    key = tmp_path / "key.json"
    if content is not None:
        key.write_text(content)
    # Credentials are looked for as on GCS itself (an emulator takes none), with no network:
    # what gcsfs falls back to would fail as a store not answering, until the deadline.
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    deadlines.enter_context(remote.deadline(3))
    _fresh_clients()
    try:
        with pytest.raises(remote.StorageRefused, match=(
                f"^GOOGLE_APPLICATION_CREDENTIALS names {re.escape(str(key))}, {why}: give it the "
                "path of a "
                "service account key")) as err:
            location.location("gs://bucket/runs").list_names()
        assert "\n" not in str(err.value)
        from trainrun.cli import main

        assert main(["runs", "--root", "gs://bucket/runs"]) == 2
        assert capsys.readouterr().err == f"error: {err.value}\n"
    finally:
        _fresh_clients()


@pytest.mark.parametrize("content, says", [
    ("[default\naws_access_key_id\n", r"^AWS_SHARED_CREDENTIALS_FILE names {file}, which "
     r"botocore cannot parse as a credentials or config file \(listing {url}\): fix the file, "
     r"or unset AWS_SHARED_CREDENTIALS_FILE$"),
    (None, r"^no credentials for {url} \(listing; AWS_SHARED_CREDENTIALS_FILE names {file}, "
     r"which does not exist\): give them through AWS_ACCESS_KEY_ID"),
])
def test_an_aws_credentials_file_that_cannot_be_read_is_named_in_one_line(
        content, says, object_store_servers, tmp_path, monkeypatch):
    file = tmp_path / "credentials"
    if content is not None:
        file.write_text(content)
    url = f"{object_store_servers['s3'].new_bucket()}/runs"
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")  # the file is where botocore looks for them
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(file))
    monkeypatch.delenv("AWS_CONFIG_FILE", raising=False)
    _fresh_clients()
    try:
        with pytest.raises(remote.StorageRefused,
                           match=says.format(file=re.escape(str(file)), url=re.escape(url))):
            location.location(url).list_names()
    finally:
        _fresh_clients()
