"""Checkpoint files: atomic writes (temporary file, fsync, rename, fsync the folder), a manifest, keep the last k.

Framework-neutral: the adapters serialise a checkpoint to bytes (``torch.save`` with tensors only, or an
``.npz`` of arrays for Keras) and hand the bytes to :class:`CheckpointDir`, which owns the files.

A folder holds one writer's checkpoints (rank 0's, or one pipeline stage's) and ``manifest.json``,
the only source of truth: a checkpoint exists once the manifest names it, and the manifest names a
file only after that file is complete on disk. A crash at any instant leaves the previous manifest
and every file it names intact; leftovers of an interrupted save are removed by the next save.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from dualframe.errors import DualframeError

#: Name of the manifest file inside a checkpoint folder.
MANIFEST = "manifest.json"
#: Format tag written into every manifest.
FORMAT = "dualframe-checkpoints/1"
#: Bytes per ``os.write`` call.
CHUNK_BYTES = 1 << 20
_TMP_MARK = ".tmp-"


class CheckpointError(DualframeError, ValueError):
    """A checkpoint folder, file or argument is unusable (corrupt file, bad manifest, bad ``keep`` ...)."""


@dataclass
class TrainingState:
    """What a ``load_checkpoint`` restored besides the tensors: where training stood.

    Example:
        >>> state = TrainingState(step=5, epoch=1, data_position={"next_step": 6})
        >>> state.data_position["next_step"]
        6
    """

    step: int
    epoch: int
    data_position: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)


def check_json_values(**values: Any) -> None:
    """Refuse, before anything is written or sent, values a checkpoint cannot hold as JSON.

    Raises:
        CheckpointError: naming the first argument that is not made of JSON values.
    """
    for name, value in values.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise CheckpointError(f"{name} must hold only JSON values (ints, strings, lists, dicts) "
                                  f"({name}: {value!r:.200})") from None


def fsync_directory(directory: str) -> None:
    """Flush a folder's entries (a rename inside it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> str:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part.

    The bytes go to a temporary file in the same folder, which is fsynced, renamed over ``path`` and
    the folder fsynced, so a crash (even a power cut) at any point leaves the previous file.

    Example:
        >>> import tempfile, os
        >>> target = os.path.join(tempfile.mkdtemp(), "state.bin")
        >>> atomic_write_bytes(target, b"abc") == target
        True

    Returns:
        ``path``.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        for start in range(0, len(view), CHUNK_BYTES):
            chunk = view[start:start + CHUNK_BYTES]
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_directory(directory)
    return path


@dataclass(frozen=True)
class CheckpointEntry:
    """One checkpoint named by the manifest: its step, file name, size and sha256, and free metadata."""

    step: int
    file: str
    sha256: str
    bytes: int
    meta: Dict[str, Any] = field(default_factory=dict)


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be an int >= 0 (step: {step!r})")
    return step


class CheckpointDir:
    """A folder of checkpoints with one writer: atomic saves, a manifest, the last ``keep`` kept.

    Example:
        >>> import tempfile
        >>> folder = CheckpointDir(tempfile.mkdtemp(), keep=2)
        >>> for step in (1, 2, 3):
        ...     _ = folder.save(step, b"weights %d" % step)
        >>> [e.step for e in folder.entries()], folder.read(folder.latest())
        ([2, 3], b'weights 3')

    Args:
        directory: the folder (created when missing).
        keep: how many checkpoints to keep, newest first; an int >= 1.
        prefix: file names are ``{prefix}-{step:08d}{suffix}``.
        suffix: file extension, e.g. ``".pt"`` or ``".npz"``.

    Raises:
        CheckpointError: ``keep`` is not an int >= 1, or ``prefix``/``suffix`` would leave the folder.
    """

    def __init__(self, directory: str, keep: int = 3, prefix: str = "checkpoint", suffix: str = ".bin") -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise CheckpointError(f"keep must be an int >= 1 (keep: {keep!r})")
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise CheckpointError(f"directory must be a non-empty path (directory: {directory!r})")
        for name, value in (("prefix", prefix), ("suffix", suffix)):
            if not isinstance(value, str) or os.sep in value or value.startswith(".."):
                raise CheckpointError(f"{name} must be a plain file-name part ({name}: {value!r})")
        self.directory = os.fspath(directory)
        self.keep, self.prefix, self.suffix = keep, prefix, suffix

    def filename(self, step: int) -> str:
        """File name of the checkpoint of ``step``."""
        return f"{self.prefix}-{_check_step(step):08d}{self.suffix}"

    def entries(self) -> List[CheckpointEntry]:
        """The manifest's checkpoints, oldest first; empty when there is no manifest yet.

        Raises:
            CheckpointError: the manifest is not one dualframe wrote.
        """
        path = os.path.join(self.directory, MANIFEST)
        try:
            with open(path, "rb") as handle:
                document = json.loads(handle.read().decode("utf-8"))
        except FileNotFoundError:
            return []
        except (ValueError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{path} is not a valid manifest ({error})") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a dualframe manifest (format must be {FORMAT!r})")
        try:
            return [CheckpointEntry(**item) for item in document["checkpoints"]]
        except (KeyError, TypeError) as error:
            raise CheckpointError(f"{path} has a malformed checkpoint entry ({error})") from None

    def latest(self) -> Optional[CheckpointEntry]:
        """The newest checkpoint, or None."""
        entries = self.entries()
        return entries[-1] if entries else None

    def save(self, step: int, data: bytes, meta: Optional[Dict[str, Any]] = None) -> str:
        """Write ``data`` as the checkpoint of ``step`` atomically, record it, drop all but the newest ``keep``.

        Returns:
            The checkpoint file's path.
        """
        _check_step(step)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CheckpointError(f"data must be bytes (data: {type(data).__name__})")
        meta = dict(meta or {})
        json.dumps(meta)  # refuse metadata the manifest cannot hold, before writing anything
        os.makedirs(self.directory, exist_ok=True)
        name = self.filename(step)
        atomic_write_bytes(os.path.join(self.directory, name), bytes(data))
        entry = CheckpointEntry(step, name, hashlib.sha256(data).hexdigest(), len(data), meta)
        entries = [e for e in self.entries() if e.step != step] + [entry]
        entries = sorted(entries, key=lambda e: e.step)[-self.keep:]
        document = {"format": FORMAT, "checkpoints": [asdict(e) for e in entries]}
        atomic_write_bytes(os.path.join(self.directory, MANIFEST), json.dumps(document, indent=1).encode())
        self._remove_unlisted({e.file for e in entries})
        return os.path.join(self.directory, name)

    def read(self, entry: CheckpointEntry) -> bytes:
        """The bytes of ``entry``, checked against the size and sha256 the manifest recorded.

        Raises:
            CheckpointError: the file is missing, truncated or altered.
        """
        path = os.path.join(self.directory, entry.file)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} named by the manifest is missing") from None
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != entry.bytes or digest != entry.sha256:
            raise CheckpointError(
                f"checkpoint {path} is corrupt (bytes: {len(data)}, manifest: {entry.bytes}; "
                f"sha256: {digest[:12]}..., manifest: {entry.sha256[:12]}...)"
            )
        return data

    def read_latest(self) -> Optional[Tuple[CheckpointEntry, bytes]]:
        """The newest checkpoint that verifies, with its bytes; older ones are tried if it is corrupt."""
        for entry in reversed(self.entries()):
            try:
                return entry, self.read(entry)
            except CheckpointError as error:
                warnings.warn(f"{error}; trying the previous checkpoint", RuntimeWarning, stacklevel=2)
        return None

    def _remove_unlisted(self, keep_files: "set[str]") -> None:
        """Delete our checkpoint files the manifest no longer names and temporary files of crashed saves."""
        for name in os.listdir(self.directory):
            ours = name.startswith(self.prefix + "-") and name.endswith(self.suffix)
            leftover = name.startswith(".") and _TMP_MARK in name
            if (ours and name not in keep_files) or leftover:
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass


def read_newest(path: str, suffix: str) -> Optional[bytes]:
    """The bytes of the file ``path``, or of the newest verified checkpoint of the folder ``path`` (None if none)."""
    if os.path.isfile(path):
        with open(path, "rb") as handle:
            return handle.read()
    found = CheckpointDir(path, suffix=suffix).read_latest()
    return found[1] if found else None


def split_gathered(joined: bytes, lengths: List[int]) -> List[bytes]:
    """Cut the concatenation of every rank's bytes (an allgather) back into one ``bytes`` per rank."""
    parts, start = [], 0
    for length in lengths:
        parts.append(joined[start:start + int(length)])
        start += int(length)
    return parts


def own_rng_state(states: List[Any], rank: int, size: int) -> Optional[Any]:
    """This rank's saved RNG state, or None (with a warning) when the saving job had another size."""
    if len(states) != size:
        warnings.warn(f"the checkpoint holds RNG states of {len(states)} ranks, this job has {size}: "
                      "random streams are not restored", RuntimeWarning, stacklevel=3)
        return None
    return states[rank]
