"""Orbax checkpoints on object storage: what Orbax needs to be told for ``gs://`` and
``s3://`` directories.

    commit       a step is committed by ``<step>/commit_success.txt``, written last (Orbax's
                 COMMIT_FILE atomicity): object stores have no atomic rename, so a step
                 without that file is a partial save, never read, removed at the next start
    gs://        TensorStore's ``gcs`` driver, pointed at ``STORAGE_EMULATOR_HOST`` when that is
                 set (TensorStore reads only its own ``TENSORSTORE_GCS_HTTP_URL``)
    s3://        TensorStore's ``s3`` driver with the region and ``AWS_ENDPOINT_URL`` from the
                 environment, which TensorStore does not read itself. Orbax 0.12 builds a
                 TensorStore spec only for gs:// and the local file system (an s3:// path
                 would go to a local folder named ``s3:``), so its two functions that decide
                 the spec are wrapped to give the s3 one, once, when an s3:// directory is
                 first opened; nothing changes for other paths
"""

from __future__ import annotations

import os
import threading
from typing import Any

from trainrun.errors import UserError
from trainrun.storage import remote
from trainrun.storage.location import Location

S3_ATTEMPTS = 16  # botocore's tries of one request Orbax makes itself (about 4 minutes)
_patched = threading.Lock()
_done: set[str] = set()


def manager_options() -> dict[str, Any]:
    """``CheckpointManagerOptions`` fields for a directory on object storage."""
    import orbax.checkpoint as ocp

    return {"atomicity_options": ocp.options.AtomicityOptions(
        mode=ocp.options.AtomicityMode.COMMIT_FILE)}


def prepare(directory: Location) -> None:
    """Make Orbax and TensorStore reach ``directory``'s store (idempotent)."""
    scheme = remote.scheme_of(directory)
    with _patched:
        if scheme in _done:
            return
        if scheme == "gs":
            emulator = os.environ.get("STORAGE_EMULATOR_HOST")
            if emulator and "TENSORSTORE_GCS_HTTP_URL" not in os.environ:
                url = emulator if "://" in emulator else f"http://{emulator}"
                os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
        elif scheme == "s3":
            _route_s3_through_tensorstore()
            # Orbax's own folder requests go through etils' s3fs client, whose botocore tries a
            # request 3 times within a second: a store answering 503 for longer failed the save.
            # botocore's standard mode backs off up to 20 s a try (the user's settings win).
            os.environ.setdefault("AWS_RETRY_MODE", "standard")
            os.environ.setdefault("AWS_MAX_ATTEMPTS", str(S3_ATTEMPTS))
        _done.add(scheme)


def s3_spec(path: str) -> dict[str, Any]:
    """TensorStore's kvstore spec of an ``s3://bucket/key`` path (given as Orbax normalizes it,
    ``s3:/bucket/key``, or whole)."""
    rest = path.split(":/", 1)[1].lstrip("/")
    bucket, _, key = rest.partition("/")
    region = (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
              or "us-east-1")
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key,
                            "aws_region": region}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    if os.environ.get("AWS_ACCESS_KEY_ID"):  # keys given: no search of profile files (which
        spec["aws_credentials"] = {"type": "environment"}  # logs each file it lacks)
    elif os.environ.get("AWS_PROFILE"):
        spec["aws_credentials"] = {"type": "profile", "profile": os.environ["AWS_PROFILE"]}
    return spec


def _route_s3_through_tensorstore() -> None:
    try:
        from orbax.checkpoint._src.path import gcs_utils
        from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

        use_native, normalize = ts_utils._use_gcs_driver, ts_utils._normalize_path
        native_spec = gcs_utils.get_kvstore_for_gcs
    except (ImportError, AttributeError) as err:
        import orbax.checkpoint as ocp

        raise UserError(f"s3:// checkpoints need an orbax-checkpoint whose TensorStore specs "
                        f"trainrun can extend (0.12.x); this one ({ocp.__version__}) has "
                        f"moved them ({err}); install orbax-checkpoint 0.12") from None

    def is_native(directory: str) -> bool:
        return directory.startswith(("s3://", "s3:/")) or use_native(directory)

    def normalized(path: str) -> str:
        text = normalize(path)
        return "s3://" + text[4:].lstrip("/") if text.startswith("s3:/") else text

    def spec(path: str) -> dict[str, Any]:
        return s3_spec(path) if path.startswith("s3:/") else native_spec(path)

    ts_utils._use_gcs_driver = is_native
    ts_utils._normalize_path = normalized
    gcs_utils.get_kvstore_for_gcs = spec
