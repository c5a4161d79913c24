"""Where the native engine's builds are kept, and what is checked before anything kept there is loaded.

A library in the cache is code this process will run, so the cache is private to its user: its
folders are made ``0700`` whatever the umask, its files ``0600``/``0700``, and before a library is
loaded from it the cache folder, the build's folder and the files must be owned by this user and
writable by no one else (:func:`distrust` says why not). The build lock is opened without
following a symbolic link (a link planted at ``build.lock`` would otherwise be truncated or
locked in its target's place). A library kept there is loaded only when it matches its manifest
(:func:`check_library`: interface version, size, SHA-256).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "cache_dir",
    "check_library",
    "digest",
    "distrust",
    "file_lock",
    "manifest_of",
    "private_dir",
    "private_file",
]


def cache_dir() -> Path:
    """Where built libraries are kept: ``$ATTNKIT_CACHE``, else ``$XDG_CACHE_HOME/attnkit`` or ``~/.cache/attnkit``."""
    root = os.environ.get("ATTNKIT_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnkit"


def private_dir(path: Path, root: Path) -> None:
    """Make ``path`` (at or under ``root``) and the folders between them that are missing, each
    ``0700`` whatever the umask (``os.makedirs``' mode is filtered by the umask; ``chmod`` is not).
    Folders that exist are left as they are (:func:`distrust` judges them)."""
    path, root = Path(path), Path(root)
    chain = [path, *path.parents]
    todo = chain[: chain.index(root) + 1] if root in chain else [path]
    for folder in reversed(todo):
        if not folder.exists():
            folder.parent.mkdir(parents=True, exist_ok=True)  # above the cache: the user's own folders
            try:
                folder.mkdir(mode=0o700)
            except FileExistsError:  # another process made it meanwhile; distrust() judges it
                continue
            os.chmod(folder, 0o700)


def private_file(path: Path, executable: bool = False) -> None:
    """Read (and run) by this user only."""
    os.chmod(path, 0o700 if executable else 0o600)


def distrust(*paths: Path) -> str | None:
    """Why something kept at ``paths`` cannot be trusted (None: it can): each that exists must be
    owned by this user and writable by no one else (group or others), and not a symbolic link."""
    if not hasattr(os, "getuid"):  # not POSIX: no owners to compare
        return None
    me = os.getuid()
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symbolic link (the cache holds none)"
        if st.st_uid != me:
            return f"{path} is owned by uid {st.st_uid}, not by this user (uid {me})"
        if st.st_mode & 0o022:
            return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def refusal(why: str, root: Path) -> str:
    """The words of a refused cache: what was found, and how to fix it."""
    return (
        f"attnkit's build cache is not private: {why}. Nothing in it is loaded. Remove it "
        f"(rm -r {root}) to let attnkit make it again, or set ATTNKIT_CACHE to a folder of your own"
    )


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """One process builds while the others wait (several ranks of a ring may start at once). The
    lock file is opened without following a symbolic link and never truncated."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename still keeps the file whole
        yield
        return
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as err:
        if os.path.islink(path):
            raise RuntimeError(f"{path} is a symbolic link; attnkit does not open it (remove it)") from None
        raise RuntimeError(f"cannot open the build lock {path}: {err}") from None
    try:
        if os.fstat(fd).st_uid != getattr(os, "getuid", lambda: os.fstat(fd).st_uid)():
            raise RuntimeError(f"{path} is owned by another user; attnkit does not lock on it (remove it)")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def manifest_of(library: Path) -> Path:
    return library.with_suffix(".json")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_library(library: Path, version: int) -> str | None:
    """Why ``library`` cannot be loaded (None: it can): it must exist and match its manifest
    (interface ``version``, size, SHA-256), so a truncated, empty, replaced or older build is found
    before it is mapped into the process."""
    if not library.exists():
        return "not built yet"
    try:
        manifest = json.loads(manifest_of(library).read_text())
        interface, size, sha256 = manifest["interface"], manifest["size"], manifest["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{library} has no readable manifest ({manifest_of(library).name})"
    if interface != version:
        return f"{library} was built for interface {interface}; this attnkit speaks {version}"
    found = library.stat().st_size
    if found != size:
        return f"{library} holds {found} bytes; its build wrote {size} (truncated or replaced)"
    if digest(library) != sha256:
        return f"{library} changed since it was built (its SHA-256 differs from its manifest's)"
    return None
