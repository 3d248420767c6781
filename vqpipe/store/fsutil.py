"""Atomic file and directory writes: build under a temporary name, fsync, then rename.

Temporary names carry the writer's host and pid (``.NAME.HOST.PID.RANDOM.tmp``), so the next writer
of the same target can remove the leftovers of writers that were killed (SIGKILL, OOM, power loss)
before their rename, and only those: a temporary whose writer still runs, or that another host (a
shared file system) or an older vqpipe wrote, is left alone.
"""

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from . import manifest as mf


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _host_tag():
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "localhost"


def temp_prefix(path):
    """``.NAME.HOST.PID.``: the start of this process's temporary names for ``path``."""
    return f".{Path(path).name}.{_host_tag()}.{os.getpid()}."


def pid_alive(pid):
    """Whether a process ``pid`` exists on this host (a zombie, or one we may not signal, counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def clean_stale_temps(path):
    """Remove temporaries of ``path`` left by writers on this host that no longer run; returns them.

    A temporary is stale only if its name carries this host and a pid with no live process. A reused
    pid makes a stale file look alive (it is kept: safe); nothing else is ever removed.
    """
    path = Path(path)
    head = f".{path.name}.{_host_tag()}."
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not (name.startswith(head) and name.endswith(".tmp")):
            continue
        pid = name[len(head):].split(".", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except FileNotFoundError:  # another writer cleaned it first
            continue
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _publish_mode(tmp, directory):
    """mkstemp/mkdtemp create 0600/0700; give the result the mode a plain open()/mkdir() would
    (0666/0777 less the umask), so a shared cache or another user can read the artifact."""
    os.chmod(tmp, (0o777 if directory else 0o666) & ~_umask())


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary file path next to ``path``; on success it is fsynced and renamed to it.

    Stale temporaries of killed writers of ``path`` are removed first (``clean_stale_temps``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        _publish_mode(tmp, directory=False)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a, b):
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False  # the file system cannot exchange (some network file systems)
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(tmp, path):
    """Put directory ``tmp`` at ``path``, replacing what is there; returns where the old one went
    (to delete), or None.

    Where the file system can, the two are exchanged in one step, so a reader (or a kill) sees the
    old or the new directory whole, never a half-deleted one. Otherwise the old directory is first
    renamed to a temporary name of this writer (removed as stale if we are killed) and the new one
    renamed in: a kill between the two leaves no ``path`` at all, never a partial one.
    """
    tmp, path = Path(tmp), Path(path)
    if not (path.exists() or path.is_symlink()):
        os.replace(tmp, path)
        return None
    if _exchange(tmp, path):
        return tmp
    aside = Path(tempfile.mkdtemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent))
    os.replace(path, aside)  # rename(2) may replace an empty directory
    os.replace(tmp, path)
    return aside


@contextlib.contextmanager
def atomic_dir(path, manifest=False):
    """Yield a temporary directory next to ``path``; on success it replaces ``path`` whole.

    Stale temporary directories of killed writers of ``path`` are removed first. ``manifest``:
    write ``manifest.json`` (vqpipe/store/manifest.py) into it last, for consumers to verify.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent))
    old = None
    try:
        yield tmp
        if manifest:
            mf.write(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        _publish_mode(tmp, directory=True)
        old = replace_dir(tmp, path)
        fsync_dir(path.parent)
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)


def save_safetensors(path, arrays, metadata=None):
    """``mx.save_safetensors``, with a failed write as an OSError naming the file.

    MLX raises a bare RuntimeError ("[write] Unable to write N bytes to file.") with no errno; a
    file system with (almost) no space left then is the likely cause, and is said so.
    """
    import mlx.core as mx

    try:
        mx.save_safetensors(str(path), arrays, metadata=metadata)
    except RuntimeError as e:
        st = os.statvfs(Path(path).parent)
        free = st.f_bavail * st.f_frsize
        code = errno.ENOSPC if free < (1 << 20) else errno.EIO
        raise OSError(code, f"{os.strerror(code)} ({free} bytes free; MLX: {e})", str(path)) from None


def write_bytes(path, data):
    """Write bytes (or str) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def write_json(path, obj):
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
