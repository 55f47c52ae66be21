"""Whether ``mdb overfit --resume`` may import the model a run's stored config names.

A database may come from elsewhere, and importing a file runs its code. A sha256 stored with
the run proves a file's content, not who chose the file: a forged config can name any file
(``this``, a planted ``evil.py``) with that file's real hash. So the model reference a run
stores is signed by this user: an HMAC-SHA256, keyed with a secret of this user's
(:func:`model_key`, created on first use, mode 0600), over the reference (``path:function``
or ``module:function``) and the path and sha256 of every file that importing it runs — the
file, and for a module name each package ``__init__.py`` above it (:func:`model_import_files`).
A database made elsewhere holds no signature this key verifies, so it never imports code.

Nothing here imports the model or its packages: files are found as ``import`` would find them
(:class:`importlib.machinery.PathFinder`) and read as bytes.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
from pathlib import Path

#: The environment variable naming the key file instead of the default location.
KEY_FILE_ENV = "MDB_KEY_FILE"

#: What the HMAC is taken over starts with this (a signature of something else never fits).
_DOMAIN = b"mdb model reference v1\n"


class ModelKeyError(ValueError):
    """This user's key cannot be read or created (one line naming the file and why)."""


def model_key_path() -> Path:
    """The file holding this user's key: ``$MDB_KEY_FILE`` when set, else
    ``$XDG_CONFIG_HOME/mdb/key``, else ``~/.config/mdb/key``."""
    named = os.environ.get(KEY_FILE_ENV)
    if named:
        return Path(named).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"),
                                                                ".config")
    return Path(config) / "mdb" / "key"


def model_key() -> bytes:
    """This user's 32-byte key (:func:`model_key_path`), created with mode 0600 (its folder
    0700) when there is none.

    Raises:
        ModelKeyError: It cannot be created or read, or is not 32 bytes or more (one line,
            naming ``MDB_KEY_FILE`` to put it elsewhere).
    """
    path = model_key_path()
    try:
        try:
            with open(path, "rb") as f:
                key = f.read(4096)
        except FileNotFoundError:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            key = os.urandom(32)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
    except FileExistsError:  # another mdb created it meanwhile
        return model_key()
    except OSError as exc:
        raise ModelKeyError(
            f"cannot keep mdb's key in {path} ({exc.strerror or exc}): a --model run is signed "
            f"with it so that a resume imports only a file named here; set {KEY_FILE_ENV} to "
            "a writable file") from None
    if len(key) < 32:
        raise ModelKeyError(f"mdb's key {path} is damaged (under 32 bytes): remove it, and name "
                            "the model of each run again (--resume RUN --model FILE:function)")
    return key


def model_import_files(spec: str) -> list[Path] | None:
    """The files whose code ``--model spec`` runs when imported, in order, found without
    running any code: a ``.py`` (or a path) alone; a module name's package ``__init__.py``
    files from the top, then the module's own file (the current directory searched first,
    then ``sys.path``, as ``--model`` imports it). ``None`` when one is not found."""
    import importlib.machinery

    module, _, _ = spec.partition(":")
    if module.endswith(".py") or os.sep in module:
        path = Path(module)
        return [path.resolve()] if path.is_file() else None
    where: list[str] = [os.getcwd(), *sys.path]
    files: list[Path] = []
    for part in module.split("."):
        try:
            found = importlib.machinery.PathFinder.find_spec(part, where)
        except (ImportError, ValueError, OSError):
            return None
        if found is None:
            return None
        origin = getattr(found, "origin", None)
        if origin and os.path.isfile(origin):
            files.append(Path(origin).resolve())
        elif found.submodule_search_locations is None:  # a module with no file to check
            return None
        where = list(found.submodule_search_locations or [])
    return files or None


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of a file's bytes.

    Raises:
        OSError: It cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_files_sha256(spec: str) -> list[list[str]]:
    """``[[path, sha256], ...]`` of :func:`model_import_files` (the model's own file last);
    ``[]`` when a file is not found or cannot be read."""
    files = model_import_files(spec)
    try:
        return [[str(p), file_sha256(p)] for p in files] if files else []
    except OSError:
        return []


def model_mac(spec: str, files: object, key: bytes) -> str:
    """The HMAC-SHA256 (hex) of the model reference ``spec`` and its files (as stored: any
    JSON value; one that is not what :func:`model_files_sha256` gives never verifies)."""
    message = json.dumps([spec, files], sort_keys=True, ensure_ascii=True).encode()
    return hmac.new(key, _DOMAIN + message, hashlib.sha256).hexdigest()


def mac_verifies(spec: str, files: object, mac: object, key: bytes) -> bool:
    """Whether ``mac`` is :func:`model_mac` of ``spec`` and ``files`` under ``key`` (compared
    in constant time)."""
    return isinstance(mac, str) and hmac.compare_digest(model_mac(spec, files, key), mac)
