"""Paths trainkit writes and reads are local (or mounted) paths: a URL (``gs://``, ``s3://``,
``hdfs://``, ``file://``) would be taken for a local folder named ``gs:`` and lost with the
machine's disk, so every one is refused where it is given, naming the fix and never printing a
credential the URL carries.

>>> require_local("runs/backup", "BackupAndRestore's backup_dir")
'runs/backup'
>>> require_local("gs://alice:s3cr3t@bucket/run", "save's filepath")
Traceback (most recent call last):
ValueError: save's filepath 'gs://alice:***@bucket/run' is a gs:// URL, ...

However it is spelled: ``pathlib.Path("s3://bucket/run")`` (which collapses ``//`` to ``s3:/``),
``"s3:/bucket/run"``, or with spaces around it. A drive letter (``C:/runs``) is a path.

>>> import pathlib
>>> require_local(pathlib.Path("s3://bucket/run"), "export's filepath")
Traceback (most recent call last):
ValueError: export's filepath 's3:/bucket/run' is a s3:// URL, ...
"""

from __future__ import annotations

import os
import re

from trainkit.core.redact import redacted

#: a local (or mounted) path as trainkit takes one: a string or an ``os.PathLike`` (``pathlib.Path``)
LocalPath = str | os.PathLike[str]

_URL = re.compile(r"^\s*(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]+):/")  # two letters or more: C:/ is a drive


def require_local(path: LocalPath, what: str) -> str:
    """``path`` as a string, or a ``ValueError`` for a URL (see the module docstring)."""
    text = os.fspath(path)
    found = _URL.match(text)
    if found is None:
        return text
    scheme = found["scheme"]
    raise ValueError(
        f"{what} {redacted(text)!r} is a {scheme}:// URL, which trainkit does not read or write: it would be "
        f"taken for a local folder named '{scheme}:' and lost with this machine's disk. Mount the bucket (gcsfuse "
        "for gs://, mountpoint-s3 or s3fs for s3://) and pass the mounted path, e.g. '/mnt/bucket/run1'."
        + (" For file://, pass the path itself." if scheme == "file" else "")
    )
