"""Object storage: ``gs://bucket/...`` and ``s3://bucket/...`` locations, read and written through
fsspec (gcsfs, s3fs: the clients Orbax reaches object storage with, through ``etils.epath``).

A location on object storage is an ``etils.epath.Path``; a local one stays a ``pathlib.Path``
(its guarantees are the file system's: renames, ``flock``, ``O_NOFOLLOW``). Everything here
works on whole objects:

    write_bytes   one PUT: a reader sees the old object or the new one, never half of one
    create        one PUT only if no object has the name (GCS ``ifGenerationMatch=0``, S3
                  ``If-None-Match: *``): exactly one of several writers succeeds
    stat          size, the version the store gives each write (GCS generation, S3 ETag) and
                  the store's own time of it (no clock of this machine involved)
    list_names, glob, delete, delete_tree, read_bytes, read_range
    list_tree     every object below a prefix with its size (a checkpoint step's files)
    open_read     a file read a block at a time, each block one ranged request
    upload        a local file as one object, streamed

Credentials and endpoints come from where each ecosystem's own tools look: for GCS,
``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's login or the metadata server, and
``STORAGE_EMULATOR_HOST`` for an emulator; for S3, ``AWS_*`` variables, profiles and
``AWS_ENDPOINT_URL``. Nothing of them is written anywhere. A ``GOOGLE_APPLICATION_CREDENTIALS``
that names no loadable key is one line before any request (gcsfs would go on without
credentials); a credentials file botocore cannot parse is one line naming its variable.

``is_remote``, which every path passes before it is read or written, refuses what is no
location: a URL of another scheme, a bucket URL without a bucket or with ``.``, ``..`` or empty
segments (``BadLocation``, one line).

A request that fails for a reason that may pass (the store not answering, a timeout, a 5xx, a
429) is tried again with exponential backoff until ``deadline_s`` (``storage.deadline_s``) has
passed; then ``StorageUnavailable``: one line naming the location and how long it was tried. A
refusal that will not pass (no credentials, no such bucket, permission) is one line at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import functools
import io
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from trainrun import extras
from trainrun.errors import UserError, WriteFailed

SCHEMES = ("gs", "s3")
REQUEST_TIMEOUT_S = 20.0  # a request not answered by then is abandoned and tried again
LEAST_ATTEMPT_S = 2.0  # the shortest wait for an answer, also when the deadline is nearer
SLOWEST_BYTES_PER_S = 2**20  # a transfer slower than this is taken for a store not answering
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0
READ_BLOCK = 4 * 2**20  # bytes per ranged request of a streamed read

T = TypeVar("T")


class StorageUnavailable(WriteFailed):
    """Object storage did not answer within the deadline; one line, exit 1."""


class StorageRefused(UserError):
    """Object storage refused a request for a reason that will not pass by trying again (no
    credentials, no such bucket, no permission); one line, exit 2."""


class BadLocation(UserError):
    """A location trainrun cannot take: a URL of another scheme, a bucket URL without a
    bucket, or one whose path has ``.``, ``..`` or empty segments; one line, exit 2."""


_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # RFC 3986's scheme, then an authority


def is_remote(path: Any) -> bool:
    """Whether ``path`` (a string, ``pathlib`` or ``epath`` path) names an object store.

    Every location passes here before it is read or written, so this is where a URL trainrun
    cannot take is refused (``BadLocation``): one of another scheme (``az://``, which would
    otherwise be a local folder ``az:``), a ``gs://``/``s3://`` one that names no bucket, or
    one with a ``.``, ``..`` or empty segment (the store takes each as part of a key, so
    ``gs://b/runs/../x`` would be written under the key ``runs/../x`` while the checkpoint
    library resolves it elsewhere)."""
    text = str(path)
    found = _URL.match(text)
    if found is None:
        return False
    scheme = found.group(1)
    if scheme not in SCHEMES:
        raise BadLocation(f"{text!r}: trainrun does not read or write {scheme}:// locations; "
                          "give gs://BUCKET/PATH, s3://BUCKET/PATH or a local path")
    segments = text[found.end():].rstrip("/").split("/")
    if not segments[0]:
        raise BadLocation(f"{text!r} names no bucket; give {scheme}://BUCKET/PATH")
    bad = next((s for s in segments[1:] if s in ("", ".", "..")), None)
    if bad is not None:
        what = "an empty segment (//)" if bad == "" else f"a {bad!r} segment"
        raise BadLocation(f"{text!r} has {what}, which object storage keeps as part of the "
                          f"name; give the path within bucket {segments[0]!r} without '.', "
                          "'..' or '//'")
    return True


def scheme_of(path: Any) -> str:
    return str(path).split("://", 1)[0]


def bucket_of(path: Any) -> str:
    return str(path).split("://", 1)[1].split("/", 1)[0]


Location = Any  # pathlib.Path locally, etils.epath.Path on object storage


def location(path: str | os.PathLike[str] | Any) -> Location:
    """``path`` as the path type its store takes: an ``epath.Path`` for ``gs://`` and ``s3://``
    (whose client is set up first), a ``pathlib.Path`` otherwise."""
    if not is_remote(path):  # a URL trainrun cannot take is refused there
        return Path(path)
    text = str(path).rstrip("/")
    filesystem(text)  # the extra's hint, and the client configured, before any use
    from etils import epath

    return epath.Path(text)


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One object: its size, the version the store gave its last write, and when."""

    size: int
    version: str
    updated: datetime.datetime | None


_settings = {"deadline_s": 300.0}
_lock = threading.Lock()


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Within the block, a request that keeps failing for reasons that may pass is given up
    after ``seconds`` (``storage.deadline_s``; 300 s outside any block). Every thread's
    requests take it, the run's and Orbax's alike; it is as before after the block."""
    before, _settings["deadline_s"] = _settings["deadline_s"], float(seconds)
    try:
        yield
    finally:
        _settings["deadline_s"] = before


def deadline_s() -> float:
    return _settings["deadline_s"]


_notices: list[Callable[[str], None]] = []
NOTICE_AFTER_S = 10.0  # a request retried this long is said on the console, once


@contextlib.contextmanager
def notices(say: Callable[[str], None]) -> Iterator[None]:
    """Within the block, a request that keeps failing is said through ``say`` (a run's
    console) once it has been retried for ``NOTICE_AFTER_S``; outside, nowhere."""
    before, _notices[:] = list(_notices), [say]
    try:
        yield
    finally:
        _notices[:] = before


def filesystem(path: Any) -> Any:
    """The fsspec filesystem for ``path``'s scheme, made once per process."""
    scheme = scheme_of(path)
    extras.require("cloud", f"{scheme}:// locations")
    with _lock:
        if scheme == "gs":
            # gcsfs picks its class when imported: the plain one, not the one that asks a gRPC
            # service for the bucket's type on every bucket (it then warns and falls back).
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
            from gcsfs.core import GCSFileSystem

            # An emulator takes no credentials: none are looked for (nor a metadata server).
            token = "anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None
            key = os.environ.get(GCS_KEY_VARIABLE)
            if token is None and key:
                _require_gcs_key(key)
            return GCSFileSystem(requests_timeout=REQUEST_TIMEOUT_S, token=token)
        import fsspec

        fs = fsspec.filesystem("s3", config_kwargs={
            "connect_timeout": REQUEST_TIMEOUT_S, "read_timeout": REQUEST_TIMEOUT_S,
            "retries": {"mode": "standard", "total_max_attempts": 1}})
        fs.retries = 1  # one attempt per call, by s3fs and botocore: retried here to the deadline
        return fs


GCS_KEY_VARIABLE = "GOOGLE_APPLICATION_CREDENTIALS"
S3_FILE_VARIABLES = ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")


@functools.lru_cache(maxsize=8)
def _require_gcs_key(key: str) -> None:
    """``StorageRefused`` when ``GOOGLE_APPLICATION_CREDENTIALS`` names a file google-auth
    cannot load: gcsfs would fall back to anonymous requests, which a store or a network
    refuses as failures that may pass, so the deadline would run out without naming it."""
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        google.auth.load_credentials_from_file(key)
    except (DefaultCredentialsError, OSError, ValueError) as err:
        if not os.path.exists(key):
            why = "does not exist"
        else:
            detail = err.args[0] if isinstance(err, DefaultCredentialsError) and err.args \
                else err
            why = f"is not a credentials file google-auth reads ({' '.join(str(detail).split())})"
        raise StorageRefused(
            f"{GCS_KEY_VARIABLE} names {key}, which {why}: give it the path of a service "
            "account key (JSON), or unset it to use gcloud's login or the machine's service "
            "account") from None


def _timeout(wait: float, nbytes: int = 0) -> float:
    """The most seconds one request moving ``nbytes`` may take, ``wait`` (``with_retries``'s
    wait for an answer) and the time the bytes need: every call is given one, since a
    client's own socket timeouts do not cover every wait (s3fs's upload to a store that
    stopped answering waited without end)."""
    return wait + nbytes / SLOWEST_BYTES_PER_S


def _key(path: Any) -> str:
    """``bucket/key`` as fsspec names an object."""
    return str(path).split("://", 1)[1]


# ---- errors ----------------------------------------------------------------------------------


def _status(err: BaseException) -> int | None:
    """The HTTP status an error of gcsfs or botocore carries, if any."""
    for attr in ("code", "status", "status_code"):
        value = getattr(err, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata", {})
        if isinstance(meta.get("HTTPStatusCode"), int):
            return int(meta["HTTPStatusCode"])
    return None


def transient(err: BaseException) -> bool:
    """A failure that may pass by trying again: the store not answering, a dropped
    connection, a timeout, a 5xx, a 429 (too many requests)."""
    status = _status(err)
    if status is not None:
        return status >= 500 or status in (408, 429)
    if isinstance(err, FileNotFoundError | FileExistsError | PermissionError):
        return False
    if isinstance(err, OSError) and err.errno in (errno.EBUSY, errno.EAGAIN):
        return True  # s3fs's word for a 503 (Service Unavailable, SlowDown)
    if isinstance(err, TimeoutError | ConnectionError):
        return True
    names = {type(e).__name__ for e in _chain(err)}
    return bool(names & {"ClientConnectorError", "ServerDisconnectedError", "ClientOSError",
                         "ServerTimeoutError", "EndpointConnectionError", "ConnectTimeoutError",
                         "ReadTimeoutError", "ConnectionClosedError", "TimeoutError",
                         "ClientPayloadError", "ResponseParserError", "RetryError"})


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__]


def _credentials_missing(err: BaseException) -> bool:
    names = {type(e).__name__ for e in _chain(err)}
    status = _status(err)
    return bool(names & {"NoCredentialsError", "DefaultCredentialsError", "PartialCredentialsError",
                         "RefreshError"}) or status == 401


def _unparsed_file(err: BaseException) -> str | None:
    """The file of botocore's ``ConfigParseError`` in ``err``'s chain (a credentials or config
    file it cannot parse), if any."""
    for e in _chain(err):
        if type(e).__name__ == "ConfigParseError":
            return str(getattr(e, "kwargs", {}).get("path", "")) or "?"
    return None


def refused_line(path: Any, err: BaseException, doing: str) -> str:
    """The one line for a request the store refused for good."""
    scheme = scheme_of(path)
    unparsed = _unparsed_file(err)
    if unparsed is not None:
        named = [v for v in S3_FILE_VARIABLES if os.path.expanduser(
            os.environ.get(v, "")) == unparsed]
        where, fix = ((f"{named[0]} names {unparsed}", f"unset {named[0]}") if named else
                      (f"the AWS file {unparsed}", "move it aside"))
        return (f"{where}, which botocore cannot parse as a credentials or config file "
                f"({doing} {path}): fix the file, or {fix}")
    if _credentials_missing(err):
        where = ("GOOGLE_APPLICATION_CREDENTIALS (a service account key), `gcloud auth "
                 "application-default login`, or a machine with a service account; "
                 "STORAGE_EMULATOR_HOST for an emulator" if scheme == "gs" else
                 "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a machine role; "
                 "AWS_ENDPOINT_URL for another endpoint")
        missing = [f"{v} names {os.environ[v]}, which does not exist" for v in S3_FILE_VARIABLES
                   if scheme == "s3" and os.environ.get(v)
                   and not os.path.exists(os.path.expanduser(os.environ[v]))]
        return (f"no credentials for {path} ({doing}"
                f"{''.join(f'; {m}' for m in missing)}): give them through {where}")
    status = _status(err)
    if status == 403 or isinstance(err, PermissionError):
        return (f"permission denied {doing} {path}: give these credentials access to bucket "
                f"{bucket_of(path)!r}, or another location")
    text = " ".join(str(err).split())[:200] or type(err).__name__
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower() or (
            status == 404 and "bucket" in text.lower()):
        return _no_bucket(path, doing)
    return f"{doing} {path} failed: {text}"


def with_retries(path: Any, doing: str, request: Callable[[float], T]) -> T:
    """``request(wait)``, tried again with backoff while it fails for reasons that may pass,
    until the deadline; a lasting refusal is ``StorageRefused`` at once. ``wait``: the seconds
    an attempt waits for an answer, ``REQUEST_TIMEOUT_S`` or what the deadline leaves
    (``LEAST_ATTEMPT_S`` at least), so a store that stopped answering is given up at
    ``storage.deadline_s``, not a whole request timeout past it."""
    start = time.monotonic()
    backoff, said = FIRST_BACKOFF_S, False
    while True:
        left = deadline_s() - (time.monotonic() - start)
        try:
            return request(min(REQUEST_TIMEOUT_S, max(left, LEAST_ATTEMPT_S)))
        except (FileNotFoundError, FileExistsError):
            raise
        except Exception as err:
            if not transient(err):
                if isinstance(err, OSError) and err.errno in (errno.ENOENT, errno.EEXIST):
                    raise
                raise StorageRefused(refused_line(path, err, doing)) from err
            waited = time.monotonic() - start
            if waited >= NOTICE_AFTER_S and _notices and not said:
                said = True
                _notices[0](f"object storage has not answered {doing} {path} for {waited:.0f} s "
                            f"({type(err).__name__}); trying again until "
                            f"storage.deadline_s={deadline_s():g}")
            if waited + backoff > deadline_s():
                raise StorageUnavailable(
                    f"object storage did not answer {doing} {path} for {waited:.0f} s "
                    f"(storage.deadline_s={deadline_s():g}): {type(err).__name__}") from err
            time.sleep(backoff * (0.5 + random.random() / 2))
            backoff = min(backoff * 2, MAX_BACKOFF_S)


# ---- whole objects ---------------------------------------------------------------------------


def read_bytes(path: Any) -> bytes:
    fs = filesystem(path)
    return with_retries(path, "reading", lambda wait: fs.cat_file(_key(path), timeout=wait))


def read_range(path: Any, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of an object."""
    fs = filesystem(path)
    return with_retries(path, "reading", lambda wait: fs.cat_file(
        _key(path), start=start, end=end, timeout=_timeout(wait, end - start)))


def write_bytes(path: Any, data: bytes) -> None:
    """The object holds ``data``: one request, all or nothing."""
    fs = filesystem(path)
    try:
        with_retries(path, "writing", lambda wait: fs.pipe_file(_key(path), data,
                                                                timeout=_timeout(wait, len(data))))
    except FileNotFoundError:  # a write finds no object missing, only the bucket
        raise StorageRefused(_no_bucket(path, "writing")) from None


def _no_bucket(path: Any, doing: str) -> str:
    fix = "check its name" if doing in ("reading", "listing") else "create it"
    return (f"bucket {bucket_of(path)!r} does not exist ({doing} {path}): {fix}, or give "
            "another location")


def create(path: Any, data: bytes) -> bool:
    """Write ``data`` only if no object has that name; returns whether this call made it."""
    fs = filesystem(path)
    try:
        with_retries(path, "creating", lambda wait: fs.pipe_file(
            _key(path), data, mode="create", timeout=_timeout(wait, len(data))))
    except FileExistsError:
        return False
    except FileNotFoundError:
        raise StorageRefused(_no_bucket(path, "creating")) from None
    except StorageRefused as err:
        if _status(err.__cause__ or err) == 412:  # a precondition that failed: it exists
            return False
        raise
    return True


def stat(path: Any) -> ObjectInfo | None:
    """The object's size, version and time, or None when there is none."""
    fs = filesystem(path)
    try:
        info = with_retries(path, "reading", lambda wait: fs.info(
            _key(path), refresh=True, timeout=wait))
    except FileNotFoundError:
        return None
    if info.get("type") == "directory":
        return None
    version = str(info.get("generation") or info.get("ETag") or info.get("etag") or "")
    updated = info.get("updated") or info.get("LastModified") or info.get("mtime")
    if isinstance(updated, str):
        updated = datetime.datetime.fromisoformat(updated.replace("Z", "+00:00"))
    return ObjectInfo(int(info.get("size") or 0), version,
                      updated if isinstance(updated, datetime.datetime) else None)


def list_names(path: Any) -> list[str]:
    """The names directly below ``path`` (objects and the "folders" their keys imply)."""
    fs = filesystem(path)
    try:
        entries = with_retries(path, "listing",
                               lambda wait: fs.ls(
            _key(path), detail=False, refresh=True, timeout=wait))
    except FileNotFoundError:
        return []
    prefix = _key(path).rstrip("/") + "/"
    names = {e.rstrip("/")[len(prefix):] for e in entries if e.rstrip("/").startswith(prefix)}
    return sorted(n for n in names if n and "/" not in n)


def list_tree(path: Any) -> dict[str, int]:
    """Every object whose key lies below ``path``: its name relative to ``path`` (``a/b``) and
    its size. ``StorageRefused`` when the bucket does not exist (an empty prefix is {})."""
    fs = filesystem(path)
    prefix = _key(path).rstrip("/") + "/"
    try:
        found = with_retries(path, "listing", lambda wait: fs.find(
            _key(path), detail=True, refresh=True, timeout=wait))
    except FileNotFoundError:
        raise StorageRefused(_no_bucket(path, "reading")) from None
    return {name[len(prefix):]: int(info.get("size") or 0) for name, info in found.items()
            if name.startswith(prefix) and info.get("type") != "directory"}


def content_checksums(path: Any) -> dict[str, str]:
    """Every object below ``path`` with the checksum the store computed of its bytes when it
    was written (GCS ``md5Hash``, else ``crc32c``; S3 ``ETag``, an MD5 of the bytes or of the
    parts), one listing, no byte read: an object written again with other bytes has another."""
    fs = filesystem(path)
    prefix = _key(path).rstrip("/") + "/"
    found = with_retries(path, "listing", lambda wait: fs.find(
        _key(path), detail=True, refresh=True, timeout=wait))
    sums = {}
    for name, info in found.items():
        value = info.get("md5Hash") or info.get("crc32c") or info.get("ETag")
        if name.startswith(prefix) and info.get("type") != "directory" and value:
            sums[name[len(prefix):]] = f"{scheme_of(path)}:{str(value).strip(chr(34))}"
    return sums


def bucket_exists(path: Any) -> bool:
    """Whether ``path``'s bucket exists (asked by listing it: the permission a reader of its
    objects has, where asking for the bucket itself needs one more)."""
    fs = filesystem(path)
    try:
        with_retries(path, "listing", lambda wait: fs.ls(
            bucket_of(path), detail=False, refresh=True, timeout=wait))
    except FileNotFoundError:
        return False
    return True


def require_bucket(path: Any, doing: str = "reading") -> None:
    """``StorageRefused`` when ``path``'s bucket does not exist: said, where a missing object
    would otherwise be taken for a missing run."""
    if not bucket_exists(path):
        raise StorageRefused(_no_bucket(path, doing))


def upload(local: Path, path: Any) -> None:
    """The local file ``local`` as the object ``path``, streamed from disk: the object appears
    whole once the upload is complete (a multipart or resumable upload), never in part."""
    fs = filesystem(path)
    try:
        size = Path(local).stat().st_size
        with_retries(path, "writing", lambda wait: fs.put_file(str(local), _key(path),
                                                               timeout=_timeout(wait, size)))
    except FileNotFoundError:
        if not Path(local).is_file():
            raise
        raise StorageRefused(_no_bucket(path, "writing")) from None


def copy_tree(path: Any, target: Any) -> None:
    """Every object below ``path`` copied below ``target`` (server-side copies)."""
    fs = filesystem(path)

    def copy(source: str, dest: str, size: int) -> Callable[[float], Any]:
        return lambda wait: fs.copy(source, dest, timeout=_timeout(wait, size))

    for name, size in list_tree(path).items():
        with_retries(path, "copying", copy(f"{_key(path)}/{name}", f"{_key(target)}/{name}",
                                           size))


def exists(path: Any) -> bool:
    fs = filesystem(path)
    return bool(with_retries(path, "reading", lambda wait: fs.exists(
        _key(path), timeout=wait)))


def is_dir(path: Any) -> bool:
    """Whether any object's key lies below ``path``."""
    return bool(list_names(path))


def delete(path: Any) -> None:
    fs = filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        with_retries(path, "deleting", lambda wait: fs.rm_file(_key(path), timeout=wait))


def delete_tree(path: Any) -> None:
    """Every object whose key lies below ``path``."""
    fs = filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        with_retries(path, "deleting", lambda wait: fs.rm(
            _key(path), recursive=True, timeout=wait))
    forget_listings(path)


def forget_listings(path: Any) -> None:
    """Drop the listings every client of ``path``'s store keeps in this process (fsspec caches
    them per filesystem object; Orbax reaches the store through ``epath``'s own): a folder
    removed here is not found again in an old listing. ``epath`` keeps its client for good,
    also when fsspec's own cache of clients was emptied (``clear_instance_cache``): Orbax would
    then see a removed step still there and skip saving it again."""
    from etils.epath import backend

    for client in [*type(filesystem(path))._cache.values(), backend.fsspec_backend.fs(path)]:
        client.invalidate_cache()


def open_read(path: Any) -> IO[bytes]:
    """The object as a file read a block at a time, each block one ranged request retried as
    ``read_range`` is (a store that stops answering mid-stream is waited for, up to the
    deadline): for streamed records, and a seekable file for Parquet. ``FileNotFoundError``
    when there is no such object."""
    info = stat(path)
    if info is None:
        raise FileNotFoundError(errno.ENOENT, "no such object", str(path))
    return io.BufferedReader(_RangedObject(path, info.size), buffer_size=READ_BLOCK)


class _RangedObject(io.RawIOBase):
    """An object of ``size`` bytes as a raw, seekable file whose reads are ranged requests."""

    def __init__(self, path: Any, size: int):
        super().__init__()
        self.path, self.size, self.position = path, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, "seek before the start of the object", str(self.path))
        self.position = base + offset
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self.position + len(view), self.size)
        if end <= self.position:
            return 0
        data = read_range(self.path, self.position, end)
        view[:len(data)] = data
        self.position += len(data)
        return len(data)


def glob(pattern: str) -> list[str]:
    """The objects a pattern matches (``*``, ``?``, ``[...]``; ``**`` across ``/``), as
    ``scheme://bucket/key`` names, sorted; the "folders" their keys imply are left out."""
    fs = filesystem(pattern)
    scheme = scheme_of(pattern)
    fs.invalidate_cache()  # listings fsspec kept from earlier calls may predate new objects
    try:
        found = with_retries(pattern, "listing", lambda wait: fs.glob(
            _key(pattern), detail=True, timeout=wait))
    except FileNotFoundError:  # gcsfs, for a bucket that is not there
        found = {}
    return sorted(f"{scheme}://{name}" for name, info in found.items()
                  if info.get("type") != "directory")


def missing_line(path: Any, what: str) -> str:
    """The line for nothing at ``path``: ``no {what} {path}``, for the caller's error; a
    bucket that does not exist is ``StorageRefused`` at once, on its own line."""
    if not bucket_exists(path):
        raise StorageRefused(_no_bucket(path, "reading"))
    return f"no {what} {path}"
