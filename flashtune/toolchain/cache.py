"""The only owner of flashtune's private on-disk artifacts (compiled kernels, emulator builds).

Layout: ``<base>/v<FORMAT>/<namespace>/<key[:2]>/<key><suffix>``. An artifact is written to
a temporary file in the same directory and renamed into place (atomic on POSIX), next to a
``.sha256`` sidecar. Builds follow the pattern try cache -> take the per-artifact file
lock -> check again -> build -> publish, so concurrent processes build each artifact once.
A published file is never rewritten in place: a rebuild publishes a fresh inode, so a
process that has the old one loaded keeps it.

Security model (the README's "Security model" states it for users):

- The cache is private to its user. Directories flashtune creates are mode 0700. The base
  directory and everything below it must be owned by the effective user and writable by
  no one else; the directories above the base must be owned by root or the user and not be
  writable by every user without the sticky bit (as ssh checks ``~/.ssh``). Anything else
  is refused with a ``CacheError`` naming the path, the owner and mode found and the fix:
  flashtune loads native code from here, so whoever can write the cache could run code
  as its user.
- Each artifact is bound to its name: the sidecar holds the sha256 of the namespace, the
  artifact's name (compile key and suffix) and its bytes. An artifact copied over another
  key, truncated, or next to a stale or plain-sha256 sidecar fails the check and is
  rebuilt. The sidecar detects accidents and mix-ups; the permission checks keep out other
  users. Loaders add their own check of the key embedded in the artifact (cubin metadata,
  the emulator library's key symbol).
- Broken layouts are errors with a fix, never tracebacks: the cache path or an artifact
  that is not what it should be (a file for a directory, a directory for a file), a cache
  that cannot be written when an artifact must be built, a full disk.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import filelock

from flashtune import settings
from flashtune.errors import CacheError
from flashtune.toolchain.ownership import describe_owner, unsafe_ancestor

#: Bump when the layout or the meaning of stored artifacts changes (2: bound sidecars).
CACHE_FORMAT = 2
_SAFE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_SIDECAR = ".sha256"
_LOCK = ".lock"
#: Seconds to wait for another process's build of the same artifact.
LOCK_TIMEOUT_S = 3600.0
#: errno values that mean "this file system will not take the write" (not a build bug).
_NO_WRITE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
log = logging.getLogger("flashtune.cache")

_trusted: set[str] = set()
_trusted_lock = threading.Lock()


def bound_digest(namespace: str, name: str, data: bytes) -> str:
    """The sidecar digest of artifact ``name`` in ``namespace``: sha256 over both names and
    the bytes, so the same bytes under another name (another compile key) do not verify."""
    h = hashlib.sha256(b"flashtune-artifact\0")
    h.update(f"{namespace}/{name}".encode() + b"\0")
    h.update(data)
    return h.hexdigest()


def _you() -> str:
    return f"you (uid {os.geteuid()})"


def unsafe_reason(st: os.stat_result) -> str | None:
    """Why an entry of the private cache with this stat must not be trusted, or None."""
    if st.st_uid != os.geteuid():
        return f"is {describe_owner(st)}, not by {_you()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users ({describe_owner(st)})"
    return None


def _kind(st: os.stat_result) -> str:
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISREG(st.st_mode):
        return "a file"
    return "a special file"


def write_error(exc: OSError, path: Path, what: str, flag: str | None = None
                ) -> CacheError:
    """A CacheError for a failed write of ``what`` at ``path``, with the fix for its cause.
    ``flag`` names the option that chose the directory (e.g. ``--out``, for a directory
    that is not the cache); None: the cache's, FLASHTUNE_CACHE_DIR."""
    code = exc.errno
    other = "point FLASHTUNE_CACHE_DIR at" if flag is None else f"give {flag}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        fix = (f"the disk (or your quota) is full: free space, or {other} a directory on "
               "another disk")
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = (f"{'the cache' if flag is None else 'it'} is not writable: make it writable by "
               f"you, or {other} a directory you own")
        if flag is None:
            fix += (" (kernels shipped read-only with an application belong in "
                    "FLASHTUNE_PRECOMPILED_DIR)")
    elif code == errno.EISDIR:
        fix = f"{exc.filename or path} is a directory where a file belongs: remove it"
    else:
        fix = f"check the directory, or {other} another one"
    return CacheError(f"cannot write {what} at {path}: {exc.strerror or exc}; {fix}")


def _make_private_dir(path: Path) -> None:
    """Create ``path`` with mode 0700 unless it exists (CacheError naming the fix if not)."""
    if path.is_dir():
        return
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise CacheError(
            f"cannot create the kernel cache directory {path}: {exc.strerror or exc}; "
            "point FLASHTUNE_CACHE_DIR at a directory you can write") from None


class ArtifactCache:
    """A versioned, private directory of immutable, digest-checked artifacts."""

    def __init__(self, root: Path | None = None) -> None:
        base = root if root is not None else settings.CACHE_DIR.get()
        #: The directory handed in (or the setting's); ``ArtifactCache(cache.base)`` is the
        #: same cache, e.g. in another process.
        self.base = Path(base).expanduser().absolute()
        self.root = self.base / f"v{CACHE_FORMAT}"

    # ------------------------------------------------------------ names and paths

    def path_for(self, namespace: str, key: str, suffix: str = "") -> Path:
        """Where the artifact (namespace, key) lives; names are checked to be filename-safe."""
        for part in (namespace, key + suffix):
            if not _SAFE.match(part):
                raise ValueError(f"cache name {part!r} must match {_SAFE.pattern}")
        return self.root / namespace / key[:2] / f"{key}{suffix}"

    # ------------------------------------------------------------ directory trust

    def _chain(self, directory: Path) -> list[Path]:
        """The directories from the base down to ``directory`` (inside the cache)."""
        rel = directory.relative_to(self.base)
        chain = [self.base]
        for part in rel.parts:
            chain.append(chain[-1] / part)
        return chain

    def _check_ancestors(self) -> None:
        """The directories above the base must not let another user replace the cache."""
        try:
            real = self.base.resolve()
        except OSError as exc:
            raise CacheError(f"cannot resolve the cache path {self.base}: {exc}") from None
        found = unsafe_ancestor(real, (0, os.geteuid()))
        if found is not None:
            parent, why = found
            raise CacheError(
                f"the kernel cache {self.base} is refused: its parent directory {parent} "
                f"{why}, so another user could replace the cache and make flashtune run "
                "their code. Point FLASHTUNE_CACHE_DIR at a directory under one you own")

    def _check_dir(self, path: Path, *, create: bool) -> bool:
        """True if ``path`` is a trusted directory of the cache; False if it is absent and
        ``create`` is off. Raises CacheError for anything unsafe or in the way."""
        key = str(path)
        if key in _trusted:
            return True
        is_base = path == self.base
        try:
            st = os.stat(path) if is_base else os.lstat(path)
        except FileNotFoundError:
            if not create:
                return False
            # The base's missing parents too (a fresh account or container often has no
            # ~/.cache): each made private, 0700, as the XDG base directory spec asks.
            for missing in [*reversed(path.parents), path] if is_base else [path]:
                _make_private_dir(missing)
            st = os.stat(path) if is_base else os.lstat(path)
        except OSError as exc:
            raise CacheError(f"cannot inspect the kernel cache directory {path}: "
                             f"{exc.strerror or exc}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise CacheError(
                f"the kernel cache path {path} is {_kind(st)}, not a directory; remove it or "
                "point FLASHTUNE_CACHE_DIR at a directory")
        reason = unsafe_reason(st)
        if reason is not None:
            hint = (f"chmod 700 {path}" if st.st_uid == os.geteuid() else
                    "point FLASHTUNE_CACHE_DIR at a directory you own (kernels shipped with an "
                    "application belong in FLASHTUNE_PRECOMPILED_DIR)")
            raise CacheError(f"the kernel cache directory {path} {reason}; flashtune loads "
                             f"native code from it and refuses it. Fix: {hint}")
        if is_base:
            self._check_ancestors()
        with _trusted_lock:
            _trusted.add(key)
        return True

    def _dirs(self, directory: Path, *, create: bool) -> bool:
        """Check (and with ``create`` make) every directory from the base to ``directory``."""
        return all(self._check_dir(d, create=create) for d in self._chain(directory))

    # ------------------------------------------------------------ reading

    def _read(self, namespace: str, path: Path) -> bytes | None:
        """The artifact's bytes if it exists, is trusted and its bound digest checks out."""
        if not self._dirs(path.parent, create=False):
            return None
        data = self._read_file(path)
        if data is None:
            return None
        side = self._read_file(Path(str(path) + _SIDECAR))
        expected = side.decode("ascii", "replace").strip() if side is not None else ""
        if expected != bound_digest(namespace, path.name, data):
            log.warning("cache artifact %s failed its digest check (damaged, or an artifact "
                        "of another key); rebuilding it", path)
            return None
        return data

    @staticmethod
    def _read_file(path: Path) -> bytes | None:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symbolic link: never followed, rebuilt over
                log.warning("cache entry %s is a symbolic link; ignoring it", path)
                return None
            raise CacheError(f"cannot read the cache entry {path}: {exc.strerror or exc}; "
                             "check its permissions or remove it") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CacheError(f"the cache entry {path} is {_kind(st)}, not a file; remove "
                                 "it (flashtune rebuilds what it needs)")
            reason = unsafe_reason(st)
            if reason is not None:
                raise CacheError(f"the cache entry {path} {reason}; flashtune refuses it. "
                                 f"Fix: remove it (or chmod go-w it if it is yours)")
            with os.fdopen(fd, "rb", closefd=False) as handle:
                return handle.read()
        finally:
            os.close(fd)

    def lookup(self, namespace: str, key: str, suffix: str = "") -> Path | None:
        """The artifact's path if it exists and its digest checks out, else None."""
        path = self.path_for(namespace, key, suffix)
        return path if self._read(namespace, path) is not None else None

    def load_bytes(self, namespace: str, key: str, suffix: str = "") -> bytes | None:
        """The artifact's contents if it exists and its digest checks out, else None.

        The digest is checked on the very bytes returned, so a concurrent rebuild can never
        hand back a mix of two versions.
        """
        return self._read(namespace, self.path_for(namespace, key, suffix))

    # ------------------------------------------------------------ writing

    @contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        lock = filelock.FileLock(str(path) + _LOCK, timeout=LOCK_TIMEOUT_S)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise CacheError(f"waited {LOCK_TIMEOUT_S:.0f} s for another process building "
                             f"{path}; if none runs, remove {path}{_LOCK}") from None
        except OSError as exc:
            raise write_error(exc, Path(str(path) + _LOCK), "the lock file") from None
        try:
            yield
        finally:
            lock.release()

    def get_or_build(
        self, namespace: str, key: str, suffix: str, build: Callable[[Path], None]
    ) -> Path:
        """Return the artifact, building it once (across processes) if it is absent or bad.

        ``build(tmp_path)`` must write the artifact to ``tmp_path``; it is published only if
        ``build`` returns normally, so a failed build leaves nothing behind. Raises
        CacheError when the cache is unsafe or cannot take the artifact (read-only, full).
        """
        path = self.path_for(namespace, key, suffix)
        if self._read(namespace, path) is not None:
            return path
        self._dirs(path.parent, create=True)
        with self._locked(path):
            if self._read(namespace, path) is not None:  # built while we waited
                return path
            try:
                fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.",
                                                suffix=".tmp")
                os.close(fd)
            except OSError as exc:
                raise write_error(exc, path, "an artifact") from None
            tmp = Path(tmp_name)
            try:
                try:
                    build(tmp)
                except OSError as exc:
                    if exc.errno in _NO_WRITE:
                        raise write_error(exc, path, "an artifact") from None
                    raise
                self._publish(namespace, tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        return path

    def put_bytes(self, namespace: str, key: str, suffix: str, data: bytes) -> Path:
        """Store ``data`` as an artifact (atomically), returning its path.

        An artifact that already exists and checks out is kept as it is (artifacts are
        immutable: one key names one content).
        """
        def write(tmp: Path) -> None:
            tmp.write_bytes(data)

        return self.get_or_build(namespace, key, suffix, write)

    def put_files(self, namespace: str, key: str, files: Mapping[str, bytes]) -> Path:
        """Store a directory of files (names must be filename-safe) atomically; return it.

        The directory is filled under a temporary name and renamed into place. Like every
        artifact it is immutable: if ``key`` already exists it is returned unchanged.
        """
        path = self.path_for(namespace, key)
        for name in files:
            if not _SAFE.match(name):
                raise ValueError(f"file name {name!r} must match {_SAFE.pattern}")
        self._dirs(path.parent, create=True)
        if path.is_dir():
            return path
        try:
            tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp"))
        except OSError as exc:
            raise write_error(exc, path, "a folder") from None
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            try:
                os.rename(tmp, path)
            except OSError:
                if not path.is_dir():  # not a lost race with an identical writer
                    raise
        except OSError as exc:
            raise write_error(exc, path, "a folder") from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return path

    def discard(self, namespace: str, key: str, suffix: str = "") -> None:
        """Invalidate an artifact whose contents turned out unusable, so the next
        get_or_build rebuilds it. Processes that already read it are unaffected."""
        path = self.path_for(namespace, key, suffix)
        if not self._dirs(path.parent, create=False):
            return
        with self._locked(path):
            try:
                Path(str(path) + _SIDECAR).unlink(missing_ok=True)
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise write_error(exc, path, "(removing) an artifact") from None

    def _publish(self, namespace: str, tmp: Path, path: Path) -> None:
        side_tmp: str | None = None
        try:
            digest = bound_digest(namespace, path.name, tmp.read_bytes())
            side_fd, side_tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(side_fd, "w") as f:
                f.write(digest)
            # Sidecar first: a reader that sees the new artifact sees a matching digest; a
            # crash between the renames leaves a mismatch, which readers treat as absent.
            os.replace(side_tmp, str(path) + _SIDECAR)
            side_tmp = None
            os.replace(tmp, path)
        except OSError as exc:
            raise write_error(exc, path, "an artifact") from None
        finally:
            if side_tmp is not None:
                Path(side_tmp).unlink(missing_ok=True)


def forget_trusted_directories() -> None:
    """Drop the memo of directories already checked in this process (for tests that change
    permissions under a running process)."""
    with _trusted_lock:
        _trusted.clear()
