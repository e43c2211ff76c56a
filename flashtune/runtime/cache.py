"""The only owner of flashtune's on-disk artifacts (compiled kernels, emulator builds).

Layout: ``<root>/v<FORMAT>/<namespace>/<key[:2]>/<key><suffix>``. An artifact is written to
a temporary file in the same directory and renamed into place (atomic on POSIX), next to a
``.sha256`` sidecar holding its digest; a reader that finds a missing, truncated or
corrupted artifact (digest mismatch) rebuilds it. Builds follow the pattern
try cache -> take the per-artifact file lock -> check again -> build -> publish, so
concurrent processes build each artifact once. A published file is never rewritten in
place: a rebuild publishes a fresh inode, so a process that has the old one loaded keeps it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import filelock

from flashtune import knobs

#: Bump when the layout or the meaning of stored artifacts changes.
CACHE_FORMAT = 1
_SAFE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
log = logging.getLogger("flashtune.cache")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ArtifactCache:
    """A versioned directory of immutable, digest-checked artifacts."""

    def __init__(self, root: Path | None = None) -> None:
        base = root if root is not None else knobs.CACHE_DIR.get()
        #: The directory handed in (or the knob's); ``ArtifactCache(cache.base)`` is the
        #: same cache, e.g. in another process.
        self.base = Path(base)
        self.root = self.base / f"v{CACHE_FORMAT}"

    def path_for(self, namespace: str, key: str, suffix: str = "") -> Path:
        """Where the artifact (namespace, key) lives; names are checked to be filename-safe."""
        for part in (namespace, key + suffix):
            if not _SAFE.match(part):
                raise ValueError(f"cache name {part!r} must match {_SAFE.pattern}")
        return self.root / namespace / key[:2] / f"{key}{suffix}"

    def lookup(self, namespace: str, key: str, suffix: str = "") -> Path | None:
        """The artifact's path if it exists and its digest checks out, else None."""
        path = self.path_for(namespace, key, suffix)
        return path if self._valid(path) else None

    def get_or_build(
        self, namespace: str, key: str, suffix: str, build: Callable[[Path], None]
    ) -> Path:
        """Return the artifact, building it once (across processes) if it is absent or bad.

        ``build(tmp_path)`` must write the artifact to ``tmp_path``; it is published only if
        ``build`` returns normally, so a failed build leaves nothing behind.
        """
        path = self.path_for(namespace, key, suffix)
        if self._valid(path):
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(path) + ".lock"):
            if self._valid(path):  # another process built it while we waited
                return path
            if path.exists():
                log.warning("cache artifact %s failed its digest check; rebuilding", path)
            fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
            os.close(fd)
            tmp = Path(tmp_name)
            try:
                build(tmp)
                self._publish(tmp, path)
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
        if path.is_dir():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp"))
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            try:
                os.rename(tmp, path)
            except OSError:
                if not path.is_dir():  # not a lost race with an identical writer
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return path

    def load_bytes(self, namespace: str, key: str, suffix: str = "") -> bytes | None:
        """The artifact's contents if it exists and its digest checks out, else None.

        The digest is checked on the very bytes returned, so a concurrent rebuild can never
        hand back a mix of two versions.
        """
        path = self.path_for(namespace, key, suffix)
        try:
            expected = Path(str(path) + ".sha256").read_text().strip()
            data = path.read_bytes()
        except OSError:
            return None
        if not expected or hashlib.sha256(data).hexdigest() != expected:
            if path.exists():
                log.warning("cache artifact %s failed its digest check; ignoring it", path)
            return None
        return data

    def discard(self, namespace: str, key: str, suffix: str = "") -> None:
        """Invalidate an artifact whose contents turned out unusable, so the next
        get_or_build rebuilds it. Processes that already read it are unaffected."""
        path = self.path_for(namespace, key, suffix)
        if not path.parent.is_dir():
            return
        with filelock.FileLock(str(path) + ".lock"):
            Path(str(path) + ".sha256").unlink(missing_ok=True)
            path.unlink(missing_ok=True)

    def _publish(self, tmp: Path, path: Path) -> None:
        digest = _sha256(tmp)
        side_fd, side_tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(side_fd, "w") as f:
            f.write(digest)
        # Sidecar first: a reader that sees the new artifact sees a matching digest; a crash
        # between the renames leaves a mismatch, which readers treat as absent.
        os.replace(side_tmp, str(path) + ".sha256")
        os.replace(tmp, path)

    @staticmethod
    def _valid(path: Path) -> bool:
        side = Path(str(path) + ".sha256")
        try:
            expected = side.read_text().strip()
            return bool(expected) and _sha256(path) == expected
        except OSError:
            return False
