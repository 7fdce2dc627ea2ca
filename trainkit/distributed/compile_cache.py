"""JAX's persistent compilation cache, on by default: a second run of the same script loads its
compiled steps from disk instead of compiling them again.

One setting, the environment variable ``TRAINKIT_COMPILATION_CACHE``: unset (or ``on``, ``1``,
``true``, ``yes``), the cache lives in ``$XDG_CACHE_HOME/trainkit/jax``
(``~/.cache/trainkit/jax``); ``off`` (or ``0``, ``false``) turns it off; any other value is the
directory to use. ``configure(...)`` does the same from code. A cache directory the user
already gave JAX (``jax_compilation_cache_dir``) is left as it is. A directory that cannot be
used (read-only, or a file) turns the cache off with one warning, and an entry a full disk left
truncated is deleted before JAX reads it (JAX never replaces an existing entry, so every later
run would warn and compile again).

Off in a job of several processes on CPUs (:func:`unshared_reason`): JAX keys a CPU program by
each process's own devices and only process 0 writes, so every other process compiles anyway, and
on jax 0.12.1 a cross-process program process 0 loads from the cache waits forever for the one the
others compiled (both hang in their first step). A cache directory the user gave JAX is turned off
there too, with a warning.

>>> directory_for("off") is None
True
>>> directory_for("on") == directory_for(None) == default_directory()
True
>>> directory_for("/tmp/my-cache")
'/tmp/my-cache'
"""

from __future__ import annotations

import os
import time
import warnings

import jax

from trainkit.distributed import filesystem
from trainkit.internals.runtime import check_cache_entry

ENVIRONMENT = "TRAINKIT_COMPILATION_CACHE"
OFF = ("off", "0", "false", "no", "none")
#: the default directory, not a directory of that name in the working directory
ON = ("on", "1", "true", "yes", "default")
_configured: str | None = None
_refused: set[str] = set()  # unusable directories already warned about
#: A file in the cache directory whose time says when its entries were last read back whole.
VERIFIED = "trainkit-verified"


def default_directory() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "trainkit", "jax")


def directory_for(setting: str | None) -> str | None:
    """The cache directory a setting names (``None``: off); an unset setting, or ``"on"``, is the default."""
    word = "on" if setting is None else setting.strip().lower()
    if setting is None or word in ON:
        return default_directory()
    if word in OFF or not word:
        return None
    return os.path.expanduser(setting)


def configure(setting: str | None = None) -> str | None:
    """Points JAX's persistent compilation cache at the directory ``setting`` names (default:
    ``$TRAINKIT_COMPILATION_CACHE``, else the user cache directory) and returns it, or turns
    trainkit's cache off (``"off"``) and returns ``None``. Leaves a directory the user set on
    JAX untouched, except in a job the cache cannot serve (:func:`unshared_reason`: turned off,
    with a warning). Called by every ``Trainer`` (after the processes connected, before the
    first compile); cheap after the first call."""
    global _configured
    if setting is None:
        setting = os.environ.get(ENVIRONMENT)
    current: str | None = jax.config.values["jax_compilation_cache_dir"]
    reason = unshared_reason()
    if current and current != _configured:  # the user's own choice, kept unless it cannot serve this job
        if reason is None:
            return current
        warnings.warn(
            f"JAX's compilation cache ({current!r}) is turned off for this job of {reason}. It saves no time "
            "here: the other processes compile every step anyway.",
            stacklevel=3,
        )
        jax.config.update("jax_compilation_cache_dir", None)
        _configured = None
        return None
    directory = None if reason is not None else directory_for(setting)
    if directory == _configured:
        return directory
    if directory is None:
        if _configured is not None:
            jax.config.update("jax_compilation_cache_dir", None)
        _configured = None
        return None
    problem = filesystem.write_problem(directory)
    if problem is not None:
        if directory not in _refused:
            _refused.add(directory)
            warnings.warn(
                f"The compilation cache directory {directory!r} cannot be used ({problem}); training goes on "
                f"without the cache (every run compiles). Point {ENVIRONMENT} at a writable directory, or set it "
                "to 'off' to silence this.",
                stacklevel=3,
            )
        return None
    drop_broken_entries(directory)
    jax.config.update("jax_compilation_cache_dir", directory)
    _configured = directory
    return directory


def drop_broken_entries(directory: str) -> list[str]:
    """Deletes the cache entries written since the last check that do not read back whole
    (empty, or truncated: a full disk leaves them), so that JAX compiles and writes them
    again; returns their names. Each entry is read once, by the first process after it was
    written.

    >>> import tempfile
    >>> drop_broken_entries(tempfile.mkdtemp())
    []
    """
    marker = os.path.join(directory, VERIFIED)
    since = os.path.getmtime(marker) if os.path.exists(marker) else 0.0
    started, broken = time.time(), []
    for entry in os.scandir(directory):
        if not entry.name.endswith("-cache") or not entry.is_file() or entry.stat().st_mtime < since:
            continue
        try:
            with open(entry.path, "rb") as f:
                data = f.read()
            if not data:
                raise ValueError("empty")
            check_cache_entry(data)  # JAX's own decompression, whichever it uses here
        except Exception:  # noqa: BLE001 - zlib.error, zstd errors, ValueError, OSError
            broken.append(entry.name)
            for path in (entry.path, entry.path[: -len("-cache")] + "-atime"):
                try:
                    os.remove(path)
                except OSError:
                    pass  # gone already, or another process's to delete
    try:
        with open(marker, "a"):
            pass
        os.utime(marker, (started, started))
    except OSError:
        pass  # checked again next time
    return broken


def unshared_reason() -> str | None:
    """Why trainkit keeps the cache off for this job (``None``: it may be on). Several processes
    on CPUs: only process 0 could read what it wrote (JAX keys a CPU program by the process's
    own devices), so the others compile anyway, and on jax 0.12.1 the program process 0 loads
    and the ones the others compile deadlock in their first collective.

    >>> unshared_reason() is None  # one process
    True
    """
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        return (
            f"{jax.process_count()} processes on CPUs: only process 0 could read its own entries, and on jax 0.12.1 "
            "a step it loads from the cache hangs with the ones the other processes compiled"
        )
    return None


def active_directory() -> str | None:
    """The compilation cache directory in use (trainkit's or the user's own), ``None`` when off."""
    directory: str | None = jax.config.values["jax_compilation_cache_dir"]
    return directory
