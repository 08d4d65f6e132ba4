"""The compile caches on disk: where they may live, and the per-piece cache of the backend.

Two caches share ``CompileConfig.cache_dir``:

- per piece (``CompileCache``, this module): ``torch.compile(model, backend="compileattn")`` still
  runs Dynamo in every process, and loads each distinct piece instead of compiling it. The key
  covers the CompileConfig hash (its compile-affecting fields only: kernel choice and CUDA-graph
  settings are run-time), the Dynamo graph's code, the contents of every source file the graph was
  traced from (found through the nodes' stack traces), the torch and Python versions, the machine (CPU
  features, GPUs, Triton version: ``machine_key``) and the environment variables that steer
  Inductor or compileattn; a file per distinct piece and size, named by
  its signature (``piece_signature.py``).
- the whole compiled function (``warm_start.py``): ``@compileattn.compile`` loads Dynamo's code and
  every piece from one file and runs no Dynamo at all.

Loading either runs code (both are pickles), so the directory must be writable by its owner only:
``secure_dir`` refuses anything else.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import platform
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx

from .. import _torch_compat
from ..config import CompileConfig

logger = logging.getLogger("compileattn")

ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE", "COMPILEATTN_", "TRITON_INTERPRET")
_FILE_RE = re.compile(r'File "([^"]+)", line \d+')


#: What ``secure_dir`` names a compile cache directory, and why its checks matter, in its errors.
CACHE_DIR = ("compile cache_dir", "loading a compile cache runs code")


def secure_dir(path: str | os.PathLike, named: tuple[str, str] = CACHE_DIR) -> Path:
    """``path`` (``~`` expanded) as a directory only this user can write, created (mode 0700) if
    missing, returned resolved: every later read and write goes through a path without symlinks,
    so none can be retargeted between this check and the read.

    Raises PermissionError for a directory owned by another user or writable by group or others,
    or reached through a symlink another user owns: a cache entry is a pickle, so whoever can write
    one runs code in every process that loads it. ``named``: (what the directory is, why code
    could run from it), for the errors.
    """
    what, why = named
    path = Path(os.path.expanduser(os.fspath(path)))
    if path.exists() and not path.is_dir():  # mkdir(exist_ok=True) would raise a bare FileExistsError
        raise NotADirectoryError(f"{what} {str(path)!r} is not a directory")
    if path.is_symlink() and not path.exists():  # and so would it for a symlink to nothing
        raise NotADirectoryError(f"{what} {str(path)!r} is a symlink to {os.readlink(path)!r}, which "
                                 f"does not exist")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    getuid = getattr(os, "getuid", None)
    if getuid is not None:
        _check_links(path, getuid(), named)
    given, path = path, path.resolve()
    st = path.stat()
    if getuid is not None:
        _check_ancestors(given, getuid(), named)
    if getuid is not None and st.st_uid != getuid():
        raise PermissionError(
            f"{what} {str(path)!r} is owned by uid {st.st_uid}, not by this user (uid {getuid()}): "
            f"{why}, so compileattn only uses one you own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{what} {str(path)!r} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
            f"{why}, so anyone who can write there could run code in your process; "
            f"chmod 700 {str(path)!r} or choose another directory")
    return path


def _check_links(path: Path, uid: int, named: tuple[str, str] = CACHE_DIR) -> None:
    """No component of the path as given is a symlink another user owns: its owner can point it at
    their own directory whenever they like (in a sticky ``/tmp`` too, where the link is theirs)."""
    current = Path(os.path.abspath(path))
    for link in (current, *current.parents):
        st = os.lstat(link)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (uid, 0):
            raise PermissionError(
                f"{named[0]} {str(path)!r} goes through {str(link)!r}, a symlink owned by uid {st.st_uid}: "
                f"its owner can point it at a directory of theirs, and {named[1]}; choose a "
                f"directory reached through links you or root own")


def _check_ancestors(path: Path, uid: int, named: tuple[str, str] = CACHE_DIR) -> None:
    """Whoever can write a directory above the cache can rename it and put their own in its place
    (or retarget a symlink on the way): every directory above it, on the path as given and as
    resolved, must be owned by this user or root and not writable by others unless sticky (``/tmp``).
    Group-writable parents are allowed (a user-private group's home)."""
    seen = set()
    for parent in (*Path(os.path.abspath(path)).parents, *path.resolve().parents):
        if parent in seen:
            continue
        seen.add(parent)
        st = parent.stat()
        if st.st_uid not in (uid, 0):
            raise PermissionError(
                f"{named[0]} {str(path)!r} lies under {str(parent)!r}, owned by uid {st.st_uid}: its owner "
                f"could replace it, and {named[1]}; choose a directory under "
                f"directories you or root own")
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise PermissionError(
                f"{named[0]} {str(path)!r} lies under {str(parent)!r}, writable by anyone (mode "
                f"{stat.S_IMODE(st.st_mode):o}, not sticky): anyone could replace it, and {named[1]}; choose "
                f"another directory")


def write_atomic(path: Path, data: bytes) -> None:
    """A concurrent reader sees the old file or the new one, never half a file. The temporary file
    is created exclusively (``mkstemp``: O_EXCL, mode 0600) beside ``path``: a name made from the
    pid and thread alone is not unique, since writers in other PID namespaces or on other hosts
    sharing the cache directory can have the same ones, and would truncate and rename away each
    other's half-written file. Raises OSError; the temporary file is removed then."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_or_log(path: Path, data: bytes, what: str) -> bool:
    """``write_atomic``, where a cache that cannot be written (a directory in the file's place, a
    full disk, a read-only directory) costs the saved compile, not the caller's call: logged."""
    try:
        write_atomic(path, data)
        return True
    except OSError as exc:
        logger.warning("compileattn: could not save %s to %s (%s: %s); it is compiled again next time", what, path,
                       type(exc).__name__, exc)
        return False


def environment_key() -> list[str]:
    """What steers a compile besides its graph, config and sources: the environment variables of
    Inductor and compileattn, the global numerics flags (``_torch_compat.compile_settings``:
    default dtype, matmul precision, deterministic mode) and autocast (a piece traced under it
    computes in its dtype), and the machine the code is built for (``machine_key``), as text
    lines. Not the Inductor config's changes in code: torch's own compile leaves entries there (a
    first compile changes them), and compileattn's are in the config."""
    lines = [f"{name}={os.environ[name]}" for name in sorted(os.environ) if name.startswith(ENV_PREFIXES)]
    lines.append(f"flags={_torch_compat.compile_settings()['flags']!r}")
    lines.append(f"autocast={_torch_compat.autocast_state()!r}")
    lines.extend(machine_key())
    return lines


def machine_key() -> list[str]:
    """The hardware and kernel compiler the saved code is built for: a cache directory shared by
    other machines (a network home, a copied image) must miss there, not load. Inductor builds its
    C++ kernels with ``-march=native`` (the CPU's own instruction set: another CPU may lack an
    instruction, SIGILL) and its Triton kernels for this GPU's architecture, with this Triton. The
    GPUs are named only once this process has initialised CUDA (a GPU model's first call always
    has): asking would initialise it, which a CPU-only program must not pay for or be changed by.
    A process that had initialised CUDA for other reasons keys a CPU model differently: a miss."""
    lines = [f"cpu={_cpu_identity()}", f"triton={_triton_version()}"]
    if torch.cuda.is_initialized():
        # the kinds of GPU, not their order or count: a cache filled with one GPU visible serves
        # the same program on all eight of that kind
        kinds = set()
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            kinds.add(f"{props.name} sm{props.major}{props.minor}")
        lines.append(f"cuda={sorted(kinds)}")
    return lines


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> str:
    """The machine type and a digest of the CPU's feature flags (``/proc/cpuinfo``; where that
    cannot be read, what ``platform`` and torch's CPU capability say)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith(("flags", "Features"))), [])
    except OSError:
        flags = []
    features = " ".join(sorted(flags)) or f"{platform.processor()} {torch.backends.cpu.get_cpu_capability()}"
    return f"{platform.machine()} {hashlib.sha256(features.encode()).hexdigest()[:16]}"


#: The distributions Triton ships as: upstream's and PyTorch's own builds.
_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")


@functools.lru_cache(maxsize=1)
def _triton_version() -> str:
    """Read from the installed distribution's metadata: importing Triton costs a second."""
    for name in _TRITON_DISTRIBUTIONS:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


_package_digest: str | None = None


def compileattn_source_digest() -> str:
    """Digest of compileattn's own sources: its passes and piece compiler shape the compiled
    pieces and the saved code without being traced by Dynamo."""
    global _package_digest
    if _package_digest is None:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        files = sorted(Path(d, f) for d, _, names in os.walk(root, followlinks=True)  # compileattn/passes is a link
                       for f in names if f.endswith(".py"))
        for path in files:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _package_digest = h.hexdigest()
    return _package_digest


def traced_source_files(gm: torch.fx.GraphModule) -> list[str]:
    files = set()
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace") or ""
        files.update(_FILE_RE.findall(trace))
    return sorted(f for f in files if os.path.isfile(f))


def interpreter_key() -> str:
    """The Python a saved compile was made by and for, in every key of a saved file (the pieces'
    here, the warm start's): both hold pickles of code objects and Inductor's Python wrappers, and
    bytecode and pickles are not kept alike across Python implementations, versions or builds."""
    return f"python={sys.implementation.name} {tuple(sys.version_info)} {sys.version}"


def cache_key(config: CompileConfig, gm: torch.fx.GraphModule) -> str:
    """The per-piece cache's directory name (module docstring), ``interpreter_key`` among it."""
    h = hashlib.sha256()
    h.update(config.hash().encode())
    h.update(torch.__version__.encode())
    h.update(interpreter_key().encode())
    h.update(compileattn_source_digest().encode())
    h.update(gm.code.encode())
    for line in environment_key():
        h.update(line.encode())
    for path in traced_source_files(gm):
        h.update(path.encode())
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:24]


class CompileCache:
    """One directory per key; one file per distinct piece and size, named by its signature: the
    artifact's bytes and, for a dynamic-shape piece, the guards on its symbolic sizes its code
    relies on (sympy expressions), pickled together (two files could pair one process's artifact
    with another's guards). A later compile that loads the piece assumes them again
    (``piecewise.assume_guards``): without them it would run the piece past them."""

    def __init__(self, root: str | os.PathLike, key: str, pinned_values: tuple[int, ...] = ()):
        self.dir = secure_dir(root) / key
        self.key = key
        # A static piece is compiled for the graph's other dynamic sizes at the compiled call's
        # values (``pinned_sizes.py``), which its signature names only as symbols: another process
        # that pinned other values must not load it.
        self._static_tag = f"_{hashlib.sha256(repr(pinned_values).encode()).hexdigest()[:12]}" if pinned_values else ""

    @classmethod
    def opened(cls, root: str | os.PathLike, key: str, pinned_values: tuple[int, ...] = ()) -> "CompileCache | None":
        """The cache, or None where ``root`` is a file: the compile goes on without it (logged), as
        with a file in place of a key's directory (``_usable``) or of the decorator's ``warm_start/``;
        other refusals (``secure_dir``'s PermissionError) raise."""
        try:
            return cls(root, key, pinned_values)
        except NotADirectoryError as exc:
            logger.warning("compile cache unusable (%s); compiling without it", exc)
            return None

    def _path(self, signature: str, size: int | None) -> Path:
        shape = "dynamic" if size is None else f"static{size}{self._static_tag}"
        return self.dir / f"piece_{signature}_{shape}.bin"

    def load(self, signature: str, size: int | None = None) -> tuple[Callable[..., Any], tuple] | None:
        """(the artifact, the guards its code relies on) or None. The key's directory is checked
        like the root (``secure_dir``): its entries are pickles."""
        path = self._path(signature, size)
        if not self.dir.exists():
            return None
        if not self._usable("recompiling"):
            return None
        if not path.exists():
            return None
        try:
            data, guards = pickle.loads(path.read_bytes())
            return _torch_compat.artifact_from_bytes(data), tuple(guards)
        except Exception as exc:  # a corrupt or incompatible entry is a miss, not a crash
            logger.warning("compile cache entry %s unusable (%s); recompiling", path, exc)
            return None

    def save(self, signature: str, artifact: Any, size: int | None = None, guards: tuple = ()) -> None:
        """Save a compiled piece; one torch cannot serialize costs the save, logged, not the compile
        (Inductor's ``freezing`` artifacts raised ``TypeError: 'NoneType' object is not callable``)."""
        try:
            data = _torch_compat.artifact_bytes(artifact)
        except Exception as exc:  # noqa: BLE001 (whatever torch's serializer raises: the piece still runs)
            logger.warning("compile cache: piece %s compiled but not saved (%s: %s)", signature[:16],
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return
        self.save_bytes(signature, data, size, guards)

    def _usable(self, otherwise: str) -> bool:
        """The directory passes ``secure_dir``; a file in its place costs the cache, not the call
        (logged, with ``otherwise``: what happens instead). Other refusals raise."""
        try:
            secure_dir(self.dir)
        except NotADirectoryError as exc:
            logger.warning("compile cache %s unusable (%s); %s", self.dir, exc, otherwise)
            return False
        return True

    def save_bytes(self, signature: str, data: bytes, size: int | None = None, guards: tuple = ()) -> None:
        """Save an artifact already in bytes (a compile worker's answer), with its guards."""
        if not self._usable("piece not saved"):
            return
        save_or_log(self._path(signature, size), pickle.dumps((data, tuple(guards))), "a compiled piece")
