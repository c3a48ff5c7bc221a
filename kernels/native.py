"""The C kernels of kernels/csrc: built on first use by torch.utils.cpp_extension (ninja and the
C++ compiler driver it uses, told to compile C), loaded into the process, called through ctypes.

Each source is its own library, built with `-O3 -march=native -fopenmp` into a build directory of
its own under $AFD_KERNEL_CACHE (default ~/.cache/afd-engine/kernels; a directory under the
system's temporary one where that is not writable), named by a hash of the source, the flags, the
compiler and the CPU: a later process finds the library there and loads it without importing
cpp_extension (which imports setuptools, a noticeable part of a process's start), and an edited
source or another CPU gets a directory, and a build, of its own. Processes building the same
library at once take turns on cpp_extension's lock file; one left by a killed build is cleared once
it is older than COMPILE_TIMEOUT_S. The library links OpenMP's libgomp.so.1: torch has loaded its
own copy of that library by then, so the kernels run on the same thread pool as torch's operators.
Where no compiler is found ($CXX, else c++: cpp_extension's choice), ninja is not on PATH
(cpp_extension builds with it; `pip install ninja`), the build fails or AFD_NATIVE_KERNELS=0 is
set, `library` returns None (after one warning, unless switched off) and the backends fall back to
their torch code.

Each kernel is also a torch operator, torch.ops.afd.<its symbol without "afd_">, so that tracing,
torch.compile and graphs see one op where a backend calls it (`cpu_op`). The operators are
registered when the backend's module is imported, whether or not the library can be built: their
schema and fake implementation need no library; their CPU implementation loads it on first call
(and fails, called where it cannot be built). A backend calls its operator only where `built` says
the library is there and the inputs are ones the kernel takes (shapes, dtypes and strides, never
values); everything else runs its torch code, as before the operators existed. The operators are
functional: each allocates its output (the ctypes calls did so too, per call), so nothing is
mutated. They are defined with Library.define/impl rather than torch.library.custom_op, whose
Python autograd layer adds microseconds to every call outside inference mode. They serve inference:
no autograd formula, and autograd falls through them, so their outputs never require grad (as the
ctypes calls' did).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch  # before any library is loaded, so that torch's libgomp is the one: see above

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "csrc"
# cpp_extension compiles with the C++ driver and C++ flags; "-x c" and the later -std make it C
FLAGS = ("-x", "c", "-std=gnu11", "-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp", "-lm")
COMPILE_TIMEOUT_S = 120  # a build's lock file older than this was left by a killed build

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_ops = torch.library.Library("afd", "FRAGMENT")  # holds the registrations: they live as long as it


def cache_dir() -> Path:
    if os.environ.get("AFD_KERNEL_CACHE"):
        return Path(os.environ["AFD_KERNEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "afd-engine" / "kernels"


def library(name: str) -> ctypes.CDLL | None:
    """kernels/csrc/<name>.c as a loaded library, built if needed; None where it cannot be."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build_and_load(name)
        return _loaded[name]


def function(name: str, symbol: str, pointers: int, sizes: int, doubles: int = 0, threads: bool = True):
    """The kernel `symbol` of kernels/csrc/<name>.c, typed as `pointers` pointer arguments, then
    `sizes` int64 ones, `doubles` double ones and (with `threads`) a final int, the thread count;
    it returns an int status. None where the library cannot be built."""
    lib = library(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)  # the same object each time: typed once, then found typed
    if fn.argtypes is None:
        fn.restype = ctypes.c_int
        args = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * sizes + [ctypes.c_double] * doubles
        fn.argtypes = args + ([ctypes.c_int] if threads else [])
    return fn


def assume_constant_result(fn: Callable) -> Callable:
    """torch.compiler.assume_constant_result without its import of dynamo, which costs every process
    over a second at start (most never compile): its whole effect is this mark, read when dynamo traces
    (a test holds it to torch's own)."""
    fn._dynamo_marked_constant = True
    return fn


@assume_constant_result
def built(kernel: Callable[[], object]) -> bool:
    """Whether `kernel()`, a backend's lookup of its C kernel, finds one. Tracing calls it once and
    keeps the answer as a constant: the lookup may build the library, nothing a graph can hold."""
    return bool(kernel())


def cpu_op(fake: Callable) -> Callable[[Callable], Callable]:
    """Decorator: the function, which takes CPU tensors and returns a new tensor (its type
    annotations give the schema), registered as the operator torch.ops.afd.<its name>, with `fake`
    run in its place under tracing (the output's shape, dtype and device from the inputs', nothing
    computed). Returns a callable that is the operator while torch compiles or traces, and the
    function itself in eager mode: the same kernel, without the dispatcher's microseconds a call (norms
    and rope run several times per layer and step)."""

    def register(impl: Callable) -> Callable:
        name = impl.__name__
        _ops.define(name + torch.library.infer_schema(impl, mutates_args=()))
        _ops.impl(name, impl, "CPU")
        _ops.impl(name, torch.library.fallthrough_kernel, "Autograd")  # see above
        torch.library.register_fake(f"afd::{name}", fake, lib=_ops)
        op = getattr(torch.ops.afd, name).default

        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else impl(*args)

        call.op = op
        return call

    return register


def compiler() -> str | None:
    """The compiler driver torch.utils.cpp_extension builds with ($CXX, else c++), or None where
    there is none."""
    return shutil.which(os.environ.get("CXX") or "c++")


def _build_and_load(name: str) -> ctypes.CDLL | None:
    if os.environ.get("AFD_NATIVE_KERNELS", "1") == "0":
        return None
    cxx = compiler()
    if cxx is None:
        log.warning("no C compiler (c++ or $CXX): the %s kernel runs as torch code instead", name)
        return None
    try:
        return ctypes.CDLL(str(_built(SOURCES / f"{name}.c", cxx)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("the %s kernel could not be built or loaded (%s): it runs as torch code instead", name, exc)
        return None


def _built(source: Path, cxx: str) -> Path:
    """The library of `source` in its build directory, built there by cpp_extension if it is not yet."""
    build = _build_dir(source, cxx)
    library = build / f"afd_{source.stem}.so"
    if library.exists() and not (build / "lock").exists():  # built, and no build under way
        return library
    _clear_stale_lock(build / "lock")
    from torch.utils import cpp_extension  # imports setuptools: only when a library is to be built

    _put_ninja_on_path()
    path = cpp_extension.load(
        name=library.stem,
        sources=[str(source)],
        extra_cflags=list(FLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build),
        is_python_module=False,  # a plain library: loaded into the process, its path returned
    )
    log.info("built %s", path)
    return Path(path) if isinstance(path, str) else library


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the `ninja` package installs it beside this Python,
    whose folder is not on PATH when the interpreter is called by its full path (as `make` does)."""
    here = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and shutil.which("ninja", path=here) is not None:
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


def _build_dir(source: Path, cxx: str) -> Path:
    """The build directory of `source` under the cache directory (or the temporary one), named by
    what the library depends on; made if missing."""
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS + LDFLAGS).encode(), os.path.realpath(cxx).encode(), _cpu_id()):
        key.update(part)
    name = f"{source.stem}-{key.hexdigest()[:16]}"
    for root in (cache_dir(), Path(tempfile.gettempdir()) / f"afd-engine-kernels-{os.getuid()}"):
        try:
            (root / name).mkdir(parents=True, exist_ok=True)
        except OSError:
            continue  # an unwritable cache directory: build in the temporary one
        if os.access(root / name, os.W_OK):
            return root / name
    raise OSError(f"no writable build directory for {source.name} (tried {cache_dir()} and the temporary one)")


def _clear_stale_lock(lock: Path) -> None:
    """Removes cpp_extension's lock file of a build that ended without removing it (a killed
    process): every later build would wait for it forever."""
    try:
        if time.time() - lock.stat().st_mtime > COMPILE_TIMEOUT_S:
            lock.unlink()
    except FileNotFoundError:
        pass


def _cpu_id() -> bytes:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = b""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            flags = next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        pass
    return platform.machine().encode() + flags
