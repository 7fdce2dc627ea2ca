"""JAX's persistent compilation cache, on by default: a second run of the same script loads its
compiled steps from disk instead of compiling them again.

One setting, the environment variable ``TRAINKIT_COMPILATION_CACHE``: unset, the cache lives in
``$XDG_CACHE_HOME/trainkit/jax`` (``~/.cache/trainkit/jax``); ``off`` (or ``0``, ``false``)
turns it off; any other value is the directory to use. ``configure(...)`` does the same from
code. A cache directory the user already gave JAX (``jax_compilation_cache_dir``) is left as
it is.

>>> directory_for("off") is None
True
>>> directory_for("/tmp/my-cache")
'/tmp/my-cache'
"""

from __future__ import annotations

import os

import jax

ENVIRONMENT = "TRAINKIT_COMPILATION_CACHE"
OFF = ("off", "0", "false", "no", "none")
_configured: str | None = None


def default_directory() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "trainkit", "jax")


def directory_for(setting: str | None) -> str | None:
    """The cache directory a setting names (``None``: off); an unset setting is the default."""
    if setting is None:
        return default_directory()
    if setting.strip().lower() in OFF or not setting.strip():
        return None
    return os.path.expanduser(setting)


def configure(setting: str | None = None) -> str | None:
    """Points JAX's persistent compilation cache at the directory ``setting`` names (default:
    ``$TRAINKIT_COMPILATION_CACHE``, else the user cache directory) and returns it, or turns
    trainkit's cache off (``"off"``) and returns ``None``. Leaves a directory the user set on
    JAX untouched. Called by every ``Trainer``; cheap after the first call."""
    global _configured
    if setting is None:
        setting = os.environ.get(ENVIRONMENT)
    current = jax.config.jax_compilation_cache_dir
    if current and current != _configured:  # the user's own choice
        return current
    directory = directory_for(setting)
    if directory == _configured:
        return directory
    if directory is None:
        if _configured is not None:
            jax.config.update("jax_compilation_cache_dir", None)
        _configured = None
        return None
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    _configured = directory
    return directory


def active_directory() -> str | None:
    """The compilation cache directory in use (trainkit's or the user's own), ``None`` when off."""
    return jax.config.jax_compilation_cache_dir or None
