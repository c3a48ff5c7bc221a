"""The C kernels of kernels/csrc: compiled on first use with the machine's C compiler, loaded with
ctypes, cached on disk.

A library is built once per source, compiler and CPU (`-O3 -march=native -fopenmp`) into
$AFD_KERNEL_CACHE (default ~/.cache/afd-engine/kernels; a directory under the system's temporary
one where that is not writable) and reused by every later process. It links
OpenMP's libgomp.so.1: torch has loaded its own copy of that library by then, so the kernels run on
the same thread pool as torch's operators. Where no compiler is found, the build fails or
AFD_NATIVE_KERNELS=0 is set, `library` returns None (after one warning, unless switched off) and
the backends fall back to their torch code.

Each kernel is also a torch operator, torch.ops.afd.<its symbol without "afd_">, so that tracing,
torch.compile and graphs see one op where a backend calls it (`cpu_op`). The operators are
registered when the backend's module is imported, whether or not the library can be built: their
schema and fake implementation need no library; their CPU implementation loads it on first call
(and fails, called where it cannot be built). A backend calls its operator only where `built` says
the library is there and the inputs are ones the kernel takes (shapes, dtypes and strides, never
values); everything else runs its torch code, as before the operators existed. The operators are
functional: each allocates its output (the ctypes calls did so too, per call), so nothing is
mutated. They are defined with Library.define/impl rather than torch.library.custom_op, whose
Python autograd layer costs some 5 us more per call outside inference mode. They serve inference:
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
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch  # before any library is loaded, so that torch's libgomp is the one: see above

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
COMPILE_TIMEOUT_S = 120

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
    1.2 s at start (most never compile): its whole effect is this mark, read when dynamo traces
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
    function itself in eager mode: the same kernel, without the dispatcher's 2-3 us a call (norms
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


def _build_and_load(name: str) -> ctypes.CDLL | None:
    if os.environ.get("AFD_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler or not shutil.which(compiler):
        log.warning("no C compiler (cc, gcc or $CC): the %s kernel runs as torch code instead", name)
        return None
    source = SOURCES / f"{name}.c"
    try:
        path = _built(source, compiler)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("the %s kernel could not be built or loaded (%s): it runs as torch code instead", name, exc)
        return None


def _built(source: Path, compiler: str) -> Path:
    """The library of `source` in the cache directory, compiled there first if it is not yet."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), version.encode(), _cpu_id()):
        key.update(part)
    name = f"{source.stem}-{key.hexdigest()[:16]}.so"
    for out_dir in (cache_dir(), Path(tempfile.gettempdir()) / f"afd-engine-kernels-{os.getuid()}"):
        if (out_dir / name).exists():
            return out_dir / name
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            if os.access(out_dir, os.W_OK):
                break
        except OSError:
            continue  # an unwritable cache directory: build in the temporary one
    path = out_dir / name
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    try:
        res = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
        )
        if res.returncode != 0:
            raise OSError(f"{compiler} exited with {res.returncode}: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: processes building at once each install a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s", path)
    return path


def _cpu_id() -> bytes:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = b""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            flags = next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        pass
    return platform.machine().encode() + flags
