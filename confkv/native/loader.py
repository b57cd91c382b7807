"""Compile ``kernels.c`` with the system C compiler on first use, cache the shared library, load it with ctypes.

The library is cached under ``$CONFKV_NATIVE_CACHE`` (default ``~/.cache/confkv/native``) as
``kernels-<hash>.so``, the hash covering the source (kernels.c and its parts in ``c/``; from
``$CONFKV_NATIVE_SOURCE`` when set, e.g. a mutated copy in mutation testing), the flags,
the compiler's ``--version`` and the CPU (``-march=native``), so a changed source, compiler or
machine builds a new one. The
build writes a temporary file and renames it into place (atomic on POSIX), so two processes
building at once do not clash. The compiler is ``$CC`` when set, else ``cc`` or ``gcc`` on
PATH; the source needs no torch headers and builds in about a second.

``CONFKV_NATIVE=0`` in the environment switches the native kernels off (every caller then runs
its torch code); it is read when the kernels are first used. When no compiler is found or the
build fails, :func:`library` warns once, naming the cause and the fix, and returns None;
callers fall back to torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

#: ``$CONFKV_NATIVE_SOURCE``: another directory holding kernels.c and c/ (a mutated copy: benchmarks/mutate_native.py)
_SOURCE_DIR = Path(os.environ["CONFKV_NATIVE_SOURCE"]) if os.environ.get("CONFKV_NATIVE_SOURCE") else Path(__file__).parent
SOURCE = _SOURCE_DIR / "kernels.c"
#: the parts kernels.c includes (one translation unit); the build's hash covers them too
PARTS = _SOURCE_DIR / "c"
# no -ffast-math: NaN / inf semantics stay those of torch (-fno-trapping-math and -fno-math-errno
# change no result: they let the compiler vectorise floor / int conversions without FP-exception or
# errno side effects); no contraction of a * b + c into an FMA
# except where kernels.c calls fmaf itself (rounding as torch's elementwise ops); -fopenmp-simd only
# honours kernels.c's `omp simd` loops (no OpenMP runtime); -pthread for the INT8 GEMV's worker pool
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c99", "-ffp-contract=off", "-fopenmp-simd",
         "-fno-trapping-math", "-fno-math-errno", "-pthread"]

_UNSET = object()
_state: dict[str, object] = {}  # "lib": the loaded library, or None when disabled / failed (memoised per process)
#: changes whenever what :func:`library` returns may change (:func:`reset`, entering and leaving :func:`disabled`):
#: a caller that decided a path once (a store's read route, confkv.store.read) decides again when it moved
generation = 0


class NativeBuildError(RuntimeError):
    """No C compiler, or the build of kernels.c failed; the message names the cause and the fix."""


def enabled() -> bool:
    """False when ``CONFKV_NATIVE=0`` is set."""
    return os.environ.get("CONFKV_NATIVE", "1") != "0"


def cache_dir() -> Path:
    return Path(os.environ.get("CONFKV_NATIVE_CACHE") or Path.home() / ".cache" / "confkv" / "native")


def compiler() -> str:
    """The compiler's path: ``$CC`` if set (it must exist), else ``cc`` or ``gcc`` on PATH."""
    chosen = os.environ.get("CC")
    candidates = [chosen] if chosen else ["cc", "gcc"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    raise NativeBuildError(
        f"no C compiler found ({'$CC=' + repr(chosen) if chosen else 'cc or gcc on PATH'}); install one "
        f"(e.g. `apt-get install gcc`) or point $CC at it, or set CONFKV_NATIVE=0 to silence this")


def _cpu() -> str:
    """What -march=native depends on: the machine and (Linux) the CPU's feature flags, so that a cache
    directory shared between machines never hands one a library built for another's instructions."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


#: ``$CONFKV_NATIVE_SANITIZE=address``: build with AddressSanitizer (reads and writes past a malloc'd block or a
#: stack array abort the process). ``=thread``: ThreadSanitizer (two threads touching the same memory, one
#: writing, with nothing ordering them), with the worker pool's chunks split statically over the threads
#: (``CONFKV_POOL_STATIC``, c/pool.c) so that every call of several chunks runs on two threads whatever the
#: timing. ``=undefined``: UndefinedBehaviorSanitizer (an index past a fixed-size array, such as the AVX-512
#: loops' register arrays, a shift past the type's width, a signed overflow, a misaligned load; and a float cast to an
#: integer it does not fit, NaN included, which GCC's -fsanitize=undefined leaves out), aborting at the
#: first report. The process must load the sanitizer's runtime (:data:`SANITIZER_RUNTIMES`) first:
#: ``make sanitize-native`` sets LD_PRELOAD.
SANITIZERS = {"address": ["-fsanitize=address", "-fno-omit-frame-pointer"],
              "thread": ["-fsanitize=thread", "-DCONFKV_POOL_STATIC"],
              "undefined": ["-fsanitize=undefined,float-cast-overflow", "-fno-sanitize-recover=undefined,float-cast-overflow",
                            "-fno-omit-frame-pointer"]}
#: the runtime library each sanitizer loads (``cc -print-file-name=<name>.so`` finds it)
SANITIZER_RUNTIMES = {"address": "libasan", "thread": "libtsan", "undefined": "libubsan"}


def default_flags() -> list[str]:
    """:data:`FLAGS`, plus a sanitizer's when ``$CONFKV_NATIVE_SANITIZE`` names one (an unknown name raises)."""
    chosen = os.environ.get("CONFKV_NATIVE_SANITIZE", "")
    if not chosen:
        return list(FLAGS)
    if chosen not in SANITIZERS:
        raise NativeBuildError(f"$CONFKV_NATIVE_SANITIZE={chosen!r} is not a sanitizer this build knows; use one of "
                               f"{sorted(SANITIZERS)} or unset it")
    runtime = SANITIZER_RUNTIMES[chosen]
    if runtime not in os.environ.get("LD_PRELOAD", ""):  # else the library fails to load, with a less clear message
        raise NativeBuildError(f"$CONFKV_NATIVE_SANITIZE={chosen} needs its runtime loaded before Python: run with "
                               f"LD_PRELOAD=$(cc -print-file-name={runtime}.so) (as `make sanitize-native` does), or "
                               "unset CONFKV_NATIVE_SANITIZE")
    return FLAGS + SANITIZERS[chosen]


def build(directory: Path | None = None, flags: list[str] | None = None) -> Path:
    """Compile kernels.c into ``directory`` (default :func:`cache_dir`) with ``flags`` (default
    :func:`default_flags`) unless cached; returns the .so path."""
    flags = default_flags() if flags is None else flags
    cc = compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"the C compiler {cc} does not run ({exc}); fix $CC or set CONFKV_NATIVE=0") from exc
    source = SOURCE.read_bytes() + b"".join(part.read_bytes() for part in sorted(PARTS.glob("*.[ch]")))
    digest = hashlib.sha256(source + " ".join(flags).encode() + version.encode() + _cpu().encode()).hexdigest()[:16]
    directory = Path(directory) if directory is not None else cache_dir()
    target = directory / f"kernels-{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(handle)
    try:
        done = subprocess.run([cc, *flags, "-o", temporary, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise NativeBuildError(f"{cc} failed to build {SOURCE.name}:\n{done.stderr.strip()[-2000:]}\n"
                                   "fix the compiler setup or set CONFKV_NATIVE=0 to run the torch code")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` with its functions' signatures declared."""
    lib = ctypes.CDLL(str(path))
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    lib.confkv_mass_read.restype = i32
    lib.confkv_mass_read.argtypes = [ptr, i32, i64, i64, i64, i64, i64, i64, i64, i64, i32, ptr, ptr, ptr, f32,
                                     ptr, ptr, i32]
    lib.confkv_page_read.restype = i32
    lib.confkv_prefill_read.restype = i32
    lib.confkv_prefill_vectorised.restype = i32
    lib.confkv_prefill_vectorised.argtypes = []
    lib.confkv_prefill_read.argtypes = [ptr, i64, i64, i64, i64, i64, i64, i64, i64, i32, ptr, ptr, ptr, ptr, f32,
                                        ptr, ptr, i32, i32]
    lib.confkv_page_read.argtypes = [ptr, i64, i64, i64, i64, i64, i32, ptr, ptr, f32, ptr, ptr, ptr, i32]
    lib.confkv_page_reader.restype = i32
    lib.confkv_page_reader.argtypes = [ptr, i64, i64]
    lib.confkv_rms_norm.restype = None
    lib.confkv_rms_norm.argtypes = [ptr, i32, i64, ptr, i32, ptr, i32, i64, i64, f32, i32]
    lib.confkv_torch_order_sum.restype = f32
    lib.confkv_torch_order_sum.argtypes = [ptr, i64, i32]
    lib.confkv_page_mass_sum.restype = f32
    lib.confkv_page_mass_sum.argtypes = [ptr, i64, i32]
    lib.confkv_keep_pages.restype = i32
    lib.confkv_keep_pages.argtypes = [i64, i64, i64, i64, ptr, i32, ptr, ptr, ptr, ptr, ptr]
    lib.confkv_rotary.restype = None
    lib.confkv_rotary.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64, i32, ptr, i64, i64, i64, i64]
    lib.confkv_int8_gemv.restype = i32
    lib.confkv_int8_gemv.argtypes = [ptr, i32, i64, i64, i64, ptr, i64, ptr, i32, ptr, i32, ptr, i32, i32]
    lib.confkv_int8_linear.restype = i32
    lib.confkv_int8_linear.argtypes = [ptr, ptr, i32, i64, i64, ptr, i32]
    lib.confkv_lean_qkv.restype = i32
    lib.confkv_lean_qkv.argtypes = [ptr, i32, i64, i64, i64, ptr, f32, i32, ptr, ptr, ptr, ptr, ptr, i64, i64, i64,
                                    ptr, ptr, ptr, i32]
    lib.confkv_lean_mlp.restype = i32
    lib.confkv_lean_mlp.argtypes = [ptr, ptr, i32, i64, i64, i64, ptr, ptr, f32, i32, ptr, ptr, ptr, ptr, i32]
    lib.confkv_confidence_terms.restype = i32
    lib.confkv_confidence_terms.argtypes = [ptr, i32, i64, i64, i64, ptr]
    lib.confkv_int8_rows.restype = i32
    lib.confkv_int8_rows.argtypes = [ptr, i32, i64, i64, ptr, i64, i32, ptr, ptr]
    lib.confkv_int8_rows_decode.restype = None
    lib.confkv_int8_rows_decode.argtypes = [ptr, ptr, i32, i64, i64, ptr, i64, i32, ptr]
    lib.confkv_kivi_encode.restype = i32
    lib.confkv_kivi_encode.argtypes = [ptr, ptr, ptr, i64, i64, i64, i32, i32, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.confkv_kivi_decode.restype = i32
    lib.confkv_kivi_decode.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32, i64, i64, ptr, ptr]
    lib.confkv_gemv_configure.restype = i32
    lib.confkv_gemv_configure.argtypes = [i64, i64]
    spin = os.environ.get("CONFKV_GEMV_SPIN_US")
    if spin:  # the GEMV workers' spin before they sleep (kernels.c's pool; default 50 us)
        try:
            lib.confkv_gemv_configure(int(float(spin) * 1000), -1)
        except ValueError:
            raise NativeBuildError(f"CONFKV_GEMV_SPIN_US={spin!r} is not a number of microseconds; "
                                   "unset it or give e.g. 50") from None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None when disabled or unavailable (warned once).

    ``CONFKV_NATIVE`` is read at the first call; :func:`reset` makes the next call read it again.
    """
    lib = _state.get("lib", _UNSET)
    if lib is not _UNSET:
        return lib  # type: ignore[return-value]
    if not enabled():
        lib = None
    else:
        try:
            lib = load(build())
        except (NativeBuildError, OSError) as exc:
            lib = None
            warnings.warn(f"confkv: native CPU kernels unavailable, using the torch code (slower): {exc}",
                          RuntimeWarning, stacklevel=2)
    _state["lib"] = lib
    return lib


def available() -> bool:
    """Whether the native kernels can be used now (enabled, built and loaded)."""
    return library() is not None


def reset() -> None:
    """Forget the loaded library and the CONFKV_NATIVE setting (tests: another $CC, cache directory or setting)."""
    global generation
    _state.clear()
    generation += 1


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block every caller runs its torch code (A/B timings, tests); the library stays loaded."""
    global generation
    saved = _state.get("lib", _UNSET)
    _state["lib"] = None
    generation += 1
    try:
        yield
    finally:
        if saved is _UNSET:
            _state.pop("lib", None)
        else:
            _state["lib"] = saved
        generation += 1
