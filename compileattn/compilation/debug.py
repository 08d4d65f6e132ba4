"""What ``CompileConfig.debug_dump_dir`` writes: depyf's decompiled Dynamo output, and FX graphs.

Three entry points, one per place a dump can come from:

- ``dump_context(config)``: depyf's ``prepare_debug`` around a Dynamo compile (the decorator uses
  it). It must *enclose* the compile: depyf sees the transformed bytecode through a Dynamo
  bytecode hook, and Dynamo runs those hooks only after the backend has returned.
- ``expect_transformed_code(dump_dir)``: for ``torch.compile(m, backend="compileattn")``, where no
  one can wrap the compile; the backend calls it and a persistent hook decompiles the bytecode
  Dynamo produces right after.
- ``dump_graph(dump_dir, name, gm)``: a GraphModule's code as ``<dump_dir>/<name>.py``; the
  piecewise backend calls it for the whole graph, the split graph and each piece.

depyf is imported lazily: importing it took 2.5 s on this repo's 2-core CPU box (after torch),
and most runs never dump.

``expect_transformed_code`` should be called at the *end* of the backend, after any nested Dynamo
compile it might trigger: the pending dump goes to the next bytecode hook call in this thread.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import sys
import threading
import warnings
from typing import Any, Iterator

from .. import _torch_compat

log = logging.getLogger("compileattn")

INSTALL_HINT = "pip install 'compileattn[debug]' (or: pip install 'depyf>=0.18')"

# depyf's prepare_debug keeps its state in a module-global dict, so two nested prepare_debug
# contexts (even in two threads) overwrite each other; one at a time, guarded here.
_session_lock = threading.Lock()
_active_dir: str | None = None
_owner: threading.Thread | None = None

_pending = threading.local()
_hook_handle: Any = None
_hook_lock = threading.Lock()
_dump_counter = itertools.count()


def import_depyf():
    """depyf, or an ImportError that says how to install it."""
    try:
        import depyf
    except ImportError as e:
        raise ImportError(
            f"CompileConfig.debug_dump_dir needs the 'depyf' package, which is not installed: {INSTALL_HINT}"
        ) from e
    return depyf


def _dump_dir_of(config_or_dir: Any) -> str | None:
    dump_dir = getattr(config_or_dir, "debug_dump_dir", config_or_dir)
    if dump_dir is None:
        return None
    if not isinstance(dump_dir, (str, os.PathLike)):
        raise TypeError(f"debug_dump_dir must be a path (str or os.PathLike) or None, got {type(dump_dir).__name__}")
    return os.path.abspath(os.fspath(dump_dir))


def _secured(dump_dir: str | os.PathLike) -> str:
    """``dump_dir`` created, or checked, as a directory only this user can write (``secure_dir``),
    resolved. Inside ``dump_context`` depyf copies each Inductor kernel's source there and has
    Inductor import it from that copy, so whoever can write there runs code in this process; and a
    file another user planted (a symlink to one of yours) would be overwritten by the dump."""
    from .cache import secure_dir

    return str(secure_dir(dump_dir, ("debug_dump_dir", "depyf's dump has Inductor import its compiled kernels "
                                                         "from there")))


@contextlib.contextmanager
def dump_context(config_or_dir: Any) -> Iterator[str | None]:
    """Wrap a Dynamo compile: with a dump directory set, depyf writes the decompiled transformed
    code (``__transformed_code_*_for_<fn>.py``), the full guarded code (``full_code_for_<fn>_*.py``)
    and Dynamo's / AOT's graphs there. Yields the directory, or None when dumping is off (then it
    does nothing at all).

    depyf patches ``torch.fx.graph_module._exec_with_source``, Inductor's module loader and
    ``lazy_format_graph_code`` and registers a bytecode hook; all of it is undone on exit, also
    when the compile raises. Inside an already open context this one does nothing (the outer
    one is already collecting; depyf cannot nest).
    """
    dump_dir = _dump_dir_of(config_or_dir)
    if dump_dir is None:
        yield None
        return
    depyf = import_depyf()
    if _owner is threading.current_thread():
        # Nested: the outer context already collects everything this compile produces.
        yield _active_dir
        return
    if not _session_lock.acquire(blocking=False):
        log.warning("another thread holds the depyf dump; not dumping to %s", dump_dir)
        yield None
        return
    try:
        dump_dir = _secured(dump_dir)
        with warnings.catch_warnings():
            # depyf warns on every entry that code should run "multiple times to cover all
            # branches"; a fullgraph compile has no branches to cover.
            warnings.filterwarnings("ignore", message=r".*trying to debug `torch.compile`")
            session = depyf.prepare_debug(dump_dir)
            session.__enter__()
        _set_active(dump_dir)
        try:
            yield dump_dir
        except BaseException:
            _set_active(None)
            _finish(session, dump_dir, *sys.exc_info())
            raise
        _set_active(None)
        _finish(session, dump_dir, None, None, None)
    finally:
        _session_lock.release()


def _finish(session, dump_dir: str, *exc_info) -> None:
    """Exit depyf's session; a failure there is logged, never raised: the dump must not fail a
    compile. depyf restores Dynamo (hook removed, patches undone) before the step that can fail:
    its ``full_code_for_*`` summary, which decompiles every ``__compiled_fn_*`` and raises
    AttributeError when a backend returned a callable object rather than a function."""
    try:
        session.__exit__(*exc_info)
    except Exception as e:  # noqa: BLE001
        log.warning("depyf could not finish the dump in %s (%s: %s); the transformed code "
                    "and graphs are there, the full_code_for_* summary may be missing", dump_dir,
                    type(e).__name__, e)
        try:
            from depyf.explain.global_variables import data

            data["is_inside_prepare_debug"] = False  # what depyf's exit would have reset last
        except Exception:  # noqa: BLE001 (depyf internals; only its depyf.debug() reads this)
            pass
    else:
        if exc_info[0] is None:
            log.info("depyf dump written to %s", dump_dir)



def _set_active(dump_dir: str | None) -> None:
    global _active_dir, _owner
    _active_dir = dump_dir
    _owner = threading.current_thread() if dump_dir is not None else None


def _safe_name(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(name)).strip(".")
    if not safe:
        raise ValueError(f"name {name!r} gives an empty file name")
    return safe


def dump_graph(dump_dir: str | os.PathLike | None, name: str, gm: Any) -> str | None:
    """Write ``gm``'s code to ``<dump_dir>/<name>.py`` and return the path; None dir: do nothing.

    Uses ``print_readable`` (shapes and dtypes as comments, submodules nested, which is what the
    split graph needs) and falls back to ``gm.code`` for graph modules it cannot print. An existing
    file is overwritten: a recompile of the same graph replaces its dump.
    """
    if dump_dir is None:
        return None
    if not isinstance(dump_dir, (str, os.PathLike)):
        raise TypeError(f"dump_dir must be a path (str or os.PathLike) or None, got {type(dump_dir).__name__}")
    if not hasattr(gm, "code"):
        raise TypeError(f"gm must be a torch.fx.GraphModule, got {type(gm).__name__}")
    try:
        src = gm.print_readable(print_output=False, include_stride=True, include_device=True)
    except Exception:  # noqa: BLE001 (print_readable's options have varied across torch versions)
        src = gm.code
    path = os.path.join(_secured(dump_dir), _safe_name(name) + ".py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# {name}\n{src}")
    log.debug("graph %s dumped to %s", name, path)
    return path


def expect_transformed_code(config_or_dir: Any) -> None:
    """Call from inside a Dynamo backend: the transformed bytecode of the frame now being compiled
    is decompiled into ``<dump_dir>/transformed_code_<fn>_<n>.py`` once Dynamo produces it.

    Needed for ``torch.compile(backend="compileattn")``, where nothing encloses the compile. Does
    nothing without a dump directory or inside ``dump_context`` (depyf already writes it there).
    If the compile fails after this call, the next frame Dynamo compiles in this thread is dumped
    instead; only debug output is affected.
    """
    dump_dir = _dump_dir_of(config_or_dir)
    if dump_dir is None or _owner is threading.current_thread():
        return
    import_depyf()
    dump_dir = _secured(dump_dir)
    _ensure_hook()
    _pending.dump_dir = dump_dir


def _ensure_hook() -> None:
    # Registered once and never removed: a hook cannot remove itself (Dynamo iterates the hook
    # dict while calling it), and an idle hook costs one attribute read per Dynamo compile.
    global _hook_handle
    with _hook_lock:
        if _hook_handle is None:

            _hook_handle = _torch_compat.register_bytecode_hook(_transformed_code_hook)


def _transformed_code_hook(code, new_code):
    dump_dir = getattr(_pending, "dump_dir", None)
    if dump_dir is None:
        return None
    _pending.dump_dir = None
    try:
        src = import_depyf().decompile(new_code)
    except Exception as e:  # noqa: BLE001 (decompiling is best effort; never fail a compile for it)
        log.warning("depyf could not decompile the transformed code of %s: %s", code.co_name, e)
        return None
    try:
        dump_dir = _secured(dump_dir)  # checked when the dump was asked for; it may have changed since
    except OSError as e:
        log.warning("not dumping the transformed code of %s: %s", code.co_name, e)
        return None
    path = os.path.join(dump_dir, f"transformed_code_{_safe_name(code.co_name)}_{next(_dump_counter)}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# Dynamo-transformed code of {code.co_name} ({code.co_filename}:{code.co_firstlineno})\n{src}")
    log.debug("transformed code of %s dumped to %s", code.co_name, path)
    return None
