"""Object storage: ``gs://bucket/...`` and ``s3://bucket/...`` locations, read and written through
fsspec (gcsfs, s3fs: the clients Orbax reaches object storage with, through ``etils.epath``).

A location on object storage is an ``ObjectLocation`` (``location.location`` makes it where a
path enters); a local one is ``location.LocalLocation``, whose guarantees are the file
system's (renames, ``flock``, ``O_NOFOLLOW``). An ``ObjectLocation``'s methods work on whole
objects:

    write_bytes   one PUT: a reader sees the old object or the new one, never half of one
    create        one PUT only if no object has the name (GCS ``ifGenerationMatch=0``, S3
                  ``If-None-Match: *``): exactly one of several writers succeeds
    info          size, the version the store gives each write (GCS generation, S3 ETag) and
                  the store's own time of it (no clock of this machine involved)
    list_names, matches, delete, delete_tree, read_bytes, read_range
    list_tree     every object below a prefix with its size (a checkpoint step's files)
    open_read     a file read a block at a time, each block one ranged request
    upload        a local file as one object, streamed

Credentials and endpoints come from where each ecosystem's own tools look: for GCS,
``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's login or the metadata server, and
``STORAGE_EMULATOR_HOST`` for an emulator; for S3, ``AWS_*`` variables, profiles and
``AWS_ENDPOINT_URL``. Nothing of them is written anywhere. A ``GOOGLE_APPLICATION_CREDENTIALS``
that names no loadable key is one line before any request (gcsfs would go on without
credentials); a credentials file botocore cannot parse is one line naming its variable.

``is_remote``, which every path passes once, where it becomes a location (and every join),
refuses what is no location: a URL of another scheme, a bucket URL without a bucket or with
``.``, ``..`` or empty segments (``BadLocation``, one line).

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
from pathlib import Path, PurePosixPath
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


def is_remote(path: object) -> bool:
    """Whether ``path`` (a string, ``pathlib`` or ``epath`` path) names an object store.

    Every location passes here when it is made (``location.location``, a join), so this is
    where a URL trainrun cannot take is refused (``BadLocation``): one of another scheme
    (``az://``, which would otherwise be a local folder ``az:``), a ``gs://``/``s3://`` one
    that names no bucket, or one with a ``.``, ``..`` or empty segment (the store takes each
    as part of a key, so
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


def scheme_of(path: object) -> str:
    return str(path).split("://", 1)[0]


def bucket_of(path: object) -> str:
    return str(path).split("://", 1)[1].split("/", 1)[0]


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


def filesystem(path: object) -> Any:
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


def refused_line(path: object, err: BaseException, doing: str) -> str:
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


def _no_bucket(path: object, doing: str) -> str:
    fix = "check its name" if doing in ("reading", "listing") else "create it"
    return (f"bucket {bucket_of(path)!r} does not exist ({doing} {path}): {fix}, or give "
            "another location")


def with_retries(path: object, doing: str, request: Callable[[float], T]) -> T:
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


# ---- a location on object storage ------------------------------------------------------------


class ObjectLocation:
    """A ``gs://bucket/key`` or ``s3://bucket/key`` location: its URL, checked once when it is
    made (``is_remote``: another scheme, no bucket or a ``.``, ``..`` or empty segment is
    refused), and its store's client. Its methods are ``storage.location.Location``'s, each a
    request on whole objects, retried to ``storage.deadline_s``; a join is checked as the
    location was."""

    __slots__ = ("url",)

    def __init__(self, url: str):
        if not is_remote(url):
            raise BadLocation(f"{url!r}: give gs://BUCKET/PATH or s3://BUCKET/PATH")
        self.url = url.rstrip("/")

    # ---- the name: joined, split and compared as text ----

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectLocation({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectLocation) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other: ObjectLocation) -> bool:
        return self.url < other.url

    def __truediv__(self, key: str | os.PathLike[str], /) -> ObjectLocation:
        return ObjectLocation(f"{self.url}/{os.fspath(key).strip('/')}")

    def joinpath(self, *names: str) -> ObjectLocation:
        joined = self
        for name in names:
            joined = joined / name
        return joined

    @property
    def scheme(self) -> str:
        return scheme_of(self.url)

    @property
    def bucket(self) -> str:
        return bucket_of(self.url)

    @property
    def key(self) -> str:
        """``bucket/key`` as fsspec names the object."""
        return self.url.split("://", 1)[1]

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1] if "/" in self.key else ""

    @property
    def parent(self) -> ObjectLocation:
        return ObjectLocation(self.url.rsplit("/", 1)[0]) if "/" in self.key else self

    @property
    def suffix(self) -> str:
        dot = self.name.rfind(".")
        return self.name[dot:] if 0 < dot < len(self.name) - 1 else ""

    def with_name(self, name: str) -> ObjectLocation:
        return self.parent / name

    def relative_to(self, other: ObjectLocation) -> str:
        """The part of the key below ``other`` (``a/b``); ``ValueError`` if it is not below."""
        if not self.url.startswith(other.url.rstrip("/") + "/"):
            raise ValueError(f"{self} is not below {other}")
        return self.url[len(other.url.rstrip("/")) + 1:]

    def is_relative_to(self, other: ObjectLocation) -> bool:
        return self == other or self.url.startswith(other.url.rstrip("/") + "/")

    def absolute(self) -> ObjectLocation:
        return self

    def expanduser(self) -> ObjectLocation:
        return self

    def resolve(self) -> ObjectLocation:
        return self  # no links on object storage

    def is_symlink(self) -> bool:
        return False

    def real(self) -> PurePosixPath:
        return PurePosixPath(f"//{self.scheme}/{self.key}")  # "//": a root no local path has

    @property
    def renames(self) -> bool:
        return False  # copied object by object; a folder is complete by its commit object

    @property
    def local_path(self) -> None:
        return None  # read through this location's requests, never opened by name

    @property
    def fs(self) -> Any:
        """The store's fsspec client."""
        return filesystem(self.url)

    def epath(self) -> Any:
        """The location as ``etils.epath.Path``: how Orbax is handed it."""
        from etils import epath

        return epath.Path(self.url)

    # ---- whole objects ----

    def read_bytes(self) -> bytes:
        fs = self.fs
        return with_retries(self, "reading", lambda wait: fs.cat_file(self.key, timeout=wait))

    def read_text(self, encoding: str | None = None) -> str:
        """The object as text, UTF-8 unless told (``UnicodeDecodeError`` as ``bytes.decode``
        raises it), its line ends as they are."""
        return self.read_bytes().decode(encoding or "utf-8")

    def read_range(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object."""
        fs = self.fs
        return with_retries(self, "reading", lambda wait: fs.cat_file(
            self.key, start=start, end=end, timeout=_timeout(wait, end - start)))

    def write_bytes(self, data: bytes) -> int:
        """The object holds ``data``: one request, all or nothing."""
        fs = self.fs
        try:
            with_retries(self, "writing", lambda wait: fs.pipe_file(
                self.key, data, timeout=_timeout(wait, len(data))))
        except FileNotFoundError:  # a write finds no object missing, only the bucket
            raise StorageRefused(self._no_bucket("writing")) from None
        return len(data)

    def write_text(self, data: str) -> int:
        return self.write_bytes(data.encode("utf-8"))

    def _no_bucket(self, doing: str) -> str:
        return _no_bucket(self, doing)

    def create(self, data: bytes) -> bool:
        """Write ``data`` only if no object has that name; returns whether this call made it."""
        fs = self.fs
        try:
            with_retries(self, "creating", lambda wait: fs.pipe_file(
                self.key, data, mode="create", timeout=_timeout(wait, len(data))))
        except FileExistsError:
            return False
        except FileNotFoundError:
            raise StorageRefused(self._no_bucket("creating")) from None
        except StorageRefused as err:
            if _status(err.__cause__ or err) == 412:  # a precondition that failed: it exists
                return False
            raise
        return True

    def info(self) -> ObjectInfo | None:
        """The object's size, version and time, or None when there is none."""
        fs = self.fs
        try:
            info = with_retries(self, "reading", lambda wait: fs.info(
                self.key, refresh=True, timeout=wait))
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

    def size(self) -> int | None:
        info = self.info()
        return None if info is None else info.size

    def identity(self) -> tuple[str, int, str]:
        """What changes when the object is written again: its name, size and version (locally
        a file's size and modification time)."""
        info = self.info()
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.url)
        return (self.url, info.size, info.version)

    def list_names(self) -> list[str]:
        """The names directly below (objects and the "folders" their keys imply), sorted;
        empty when there is nothing there."""
        fs = self.fs
        try:
            entries = with_retries(self, "listing", lambda wait: fs.ls(
                self.key, detail=False, refresh=True, timeout=wait))
        except FileNotFoundError:
            return []
        prefix = self.key.rstrip("/") + "/"
        names = {e.rstrip("/")[len(prefix):] for e in entries
                 if e.rstrip("/").startswith(prefix)}
        return sorted(n for n in names if n and "/" not in n)

    def _find(self) -> dict[str, Any]:
        fs = self.fs
        return with_retries(self, "listing", lambda wait: fs.find(
            self.key, detail=True, refresh=True, timeout=wait))

    def list_tree(self) -> dict[str, int]:
        """Every object whose key lies below: its name relative to this location (``a/b``) and
        its size, sorted. ``StorageRefused`` when the bucket does not exist (an empty prefix is
        {})."""
        prefix = self.key.rstrip("/") + "/"
        try:
            found = self._find()
        except FileNotFoundError:
            raise StorageRefused(self._no_bucket("reading")) from None
        return dict(sorted((name[len(prefix):], int(info.get("size") or 0))
                           for name, info in found.items()
                           if name.startswith(prefix) and info.get("type") != "directory"))

    def content_checksums(self) -> dict[str, str]:
        """Every object below with the checksum the store computed of its bytes when it was
        written (GCS ``md5Hash``, else ``crc32c``; S3 ``ETag``, an MD5 of the bytes or of the
        parts), one listing, no byte read: an object written again with other bytes has
        another. (Locally there are none: {}.)"""
        prefix = self.key.rstrip("/") + "/"
        sums = {}
        for name, info in self._find().items():
            value = info.get("md5Hash") or info.get("crc32c") or info.get("ETag")
            if name.startswith(prefix) and info.get("type") != "directory" and value:
                sums[name[len(prefix):]] = f"{self.scheme}:{str(value).strip(chr(34))}"
        return sums

    def bucket_exists(self) -> bool:
        """Whether the bucket exists (asked by listing it: the permission a reader of its
        objects has, where asking for the bucket itself needs one more)."""
        fs = self.fs
        try:
            with_retries(self, "listing", lambda wait: fs.ls(
                self.bucket, detail=False, refresh=True, timeout=wait))
        except FileNotFoundError:
            return False
        return True

    def require_bucket(self, doing: str = "reading") -> None:
        """``StorageRefused`` when the bucket does not exist: said, where a missing object
        would otherwise be taken for a missing run."""
        if not self.bucket_exists():
            raise StorageRefused(self._no_bucket(doing))

    def missing_line(self, what: str) -> str:
        """The line for nothing here: ``no {what} {location}``, for the caller's error; a
        bucket that does not exist is ``StorageRefused`` at once, on its own line."""
        self.require_bucket()
        return f"no {what} {self}"

    def upload(self, local: Path) -> None:
        """The local file ``local`` as this object, streamed from disk: the object appears
        whole once the upload is complete (a multipart or resumable upload), never in part."""
        fs = self.fs
        try:
            size = Path(local).stat().st_size
            with_retries(self, "writing", lambda wait: fs.put_file(
                str(local), self.key, timeout=_timeout(wait, size)))
        except FileNotFoundError:
            if not Path(local).is_file():
                raise
            raise StorageRefused(self._no_bucket("writing")) from None

    def copy_tree(self, target: ObjectLocation) -> None:
        """Every object below this location copied below ``target`` (server-side copies)."""
        fs = self.fs

        def copy(source: str, dest: str, size: int) -> Callable[[float], Any]:
            return lambda wait: fs.copy(source, dest, timeout=_timeout(wait, size))

        for name, size in self.list_tree().items():
            with_retries(self, "copying", copy(f"{self.key}/{name}", f"{target.key}/{name}",
                                               size))

    def move_tree(self, target: ObjectLocation) -> None:
        """A folder to a new place: object storage cannot rename, so each object is copied,
        then the originals deleted."""
        self.copy_tree(target)
        self.delete_tree()

    def make_dirs(self) -> None:
        """Nothing to make: a prefix exists once an object lies below it."""

    def exists(self) -> bool:
        fs = self.fs
        return bool(with_retries(self, "reading", lambda wait: fs.exists(
            self.key, timeout=wait)))

    def is_file(self) -> bool:
        return self.info() is not None

    def is_dir(self) -> bool:
        """Whether any object's key lies below."""
        return bool(self.list_names())

    def delete(self) -> None:
        fs = self.fs
        with contextlib.suppress(FileNotFoundError):
            with_retries(self, "deleting", lambda wait: fs.rm_file(self.key, timeout=wait))

    def delete_tree(self) -> None:
        """Every object whose key lies below."""
        fs = self.fs
        with contextlib.suppress(FileNotFoundError):
            with_retries(self, "deleting", lambda wait: fs.rm(
                self.key, recursive=True, timeout=wait))
        self.forget_listings()

    def forget_listings(self) -> None:
        """Drop the listings every client of this store keeps in this process (fsspec caches
        them per filesystem object; Orbax reaches the store through ``epath``'s own): a folder
        removed here is not found again in an old listing. ``epath`` keeps its client for
        good, also when fsspec's own cache of clients was emptied (``clear_instance_cache``):
        Orbax would then see a removed step still there and skip saving it again."""
        from etils.epath import backend

        for client in [*type(self.fs)._cache.values(), backend.fsspec_backend.fs(self.url)]:
            client.invalidate_cache()

    def open_read(self) -> IO[bytes]:
        """The object as a file read a block at a time, each block one ranged request retried
        as ``read_range`` is (a store that stops answering mid-stream is waited for, up to the
        deadline): for streamed records, and a seekable file for Parquet.
        ``FileNotFoundError`` when there is no such object."""
        info = self.info()
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.url)
        return io.BufferedReader(_RangedObject(self, info.size), buffer_size=READ_BLOCK)

    def model_file(self, error: type[UserError] = UserError) -> ObjectLocation:
        """The file as it is: object storage has no links to refuse."""
        return self

    def glob(self, pattern: str) -> list[ObjectLocation]:
        """The objects ``pattern`` below this location matches (``*``, ``?``, ``[...]``;
        ``**`` across ``/``), sorted; the "folders" their keys imply are left out."""
        return (self / pattern).matches()

    def matches(self) -> list[ObjectLocation]:
        """The objects this location, read as a pattern (``*``, ``?``, ``[...]``; ``**``
        across ``/``), matches, sorted; the "folders" their keys imply are left out."""
        fs = self.fs
        fs.invalidate_cache()  # listings fsspec kept from earlier calls may predate new objects
        try:
            found = with_retries(self, "listing", lambda wait: fs.glob(
                self.key, detail=True, timeout=wait))
        except FileNotFoundError:  # gcsfs, for a bucket that is not there
            found = {}
        return sorted(ObjectLocation(f"{self.scheme}://{name}") for name, info in found.items()
                      if info.get("type") != "directory")


class _RangedObject(io.RawIOBase):
    """An object of ``size`` bytes as a raw, seekable file whose reads are ranged requests."""

    def __init__(self, path: ObjectLocation, size: int):
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
        data = self.path.read_range(self.position, end)
        view[:len(data)] = data
        self.position += len(data)
        return len(data)
