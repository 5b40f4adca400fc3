"""The ``compiled`` CPU backend: ``depth_attention.c`` built with the system C compiler, via ctypes.

The C file needs no torch headers, so building it takes about a second with ``gcc -O3``. It is
built with ``-fopenmp`` when the compiler has it: the shared object then needs ``libgomp.so.1``,
which the loader resolves to the copy torch has already loaded, so the kernel runs on torch's own
OpenMP workers (awake after the previous torch op) instead of fresh threads competing with them;
otherwise (or with ``ATTNRES_NO_OPENMP=1``) it uses POSIX threads. ``ATTNRES_CFLAGS`` adds
compiler flags (e.g. ``-mno-avx512f`` for the 32-byte vector loops on an AVX-512 machine). The
shared object is cached per (source, flags, compiler, CPU) in ``<cache root>/kernels``, the cache
root being ``$ATTNRES_CACHE`` (default ``~/.cache/attention_residuals``: the one cache root, the
token cache of :mod:`attention_residuals.training.data` lives there too). The build happens
lazily on first use and never raises: when no compiler is found, the build fails, or
``ATTNRES_NO_COMPILE=1`` is set, :func:`unavailable_reason` says why and the dispatcher falls
back to the eager ``fused`` path.

Loading a shared object runs its code, so the folder it comes from must be this user's alone:
``kernels`` is created with mode 0700, and before anything is loaded from it
(:func:`cache_dir_problem`) it must be a real folder (not a symlink) owned by this user with no
access for group or others, and the cached file a regular file owned by this user. A folder that
fails (or cannot be created) is not used: the kernel is built into a fresh private temporary
folder for this process instead (``tempfile.mkdtemp``: 0700, an unpredictable name), with a
warning saying why.

Supported: float32, bfloat16 (accumulated in float32) and float64 (accumulated in float64, so the
path can be gradchecked) on contiguous CPU tensors. The N sources are passed as a list of
``[M, d]`` tensors and reach the kernel as a table of N pointers, so they are read where they
live (no stacked copy).

Precision (the contract of :mod:`attention_residuals.functional`): one call reads sources of one
dtype -- the activation dtype, to which the dispatcher has cast any source of another dtype (under
autocast typically the float32 embedding: one ``[M, d]`` copy per call, saved for backward in
training; none once the model keeps its sources in one dtype). The query, the logits, the
running max / normaliser, ``lse`` and the accumulators are float32 (float64 for float64), the
output and ``dv_i`` are rounded once to the sources' dtype (bfloat16: round to nearest even),
``dq`` stays in the accumulation dtype. No float16 kernel: float16 runs on the ``fused`` path.

Inside ``torch.compile`` the kernels run as the custom operators at the end of this file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "unsupported_reason",
    "unavailable_reason",
    "depth_attention_op",
    "depth_attention_backward_op",
    "forward",
    "backward",
    "states",
    "merge",
    "read_forward",
    "read_backward",
    "cache_dir_problem",
    "cache_root",
    "library_path",
    "threading_model",
    "vector_bytes",
]

SUPPORTED_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64"}
_SOURCE = Path(__file__).with_name("depth_attention.c")
_BASE_FLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]
_ABI_VERSION = 10
# Below this many source elements one thread is faster than starting more.
_ELEMS_PER_THREAD = 1 << 16

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib" -> ctypes.CDLL, "error" -> str, "path" -> Path


CACHE_ENV = "ATTNRES_CACHE"


def cache_root() -> Path:
    """``$ATTNRES_CACHE`` or ``~/.cache/attention_residuals``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "attention_residuals"


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def cache_dir_problem(path: Path, *, file: bool = False) -> str | None:
    """Why ``path`` (a folder, or with ``file`` a shared object in one) must not be loaded from,
    or None: not a real folder / regular file, another owner, a folder open to group or others."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be checked ({e.strerror})"
    kind_ok = stat.S_ISREG(st.st_mode) if file else stat.S_ISDIR(st.st_mode)
    if not kind_ok:
        return f"is not a {'regular file' if file else 'folder'} (a symlink?)"
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if not file and uid is not None and st.st_mode & 0o077:
        return f"has mode {oct(st.st_mode & 0o777)}, expected 0o700 (this user's alone)"
    return None


def _cache_dir() -> Path:
    """``<cache root>/kernels`` (created 0700) if it passes :func:`cache_dir_problem`, else a fresh
    private temporary folder (see the module docstring); once per process."""
    if "dir" in _state:
        return _state["dir"]  # type: ignore[return-value]
    folder = cache_root() / "kernels"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(folder):
            folder.mkdir(mode=0o700)
        problem = cache_dir_problem(folder)
    except OSError as e:
        problem = f"cannot be created ({e.strerror})"
    if problem is not None:
        private = Path(tempfile.mkdtemp(prefix="attention_residuals-kernels-"))
        warnings.warn(
            f"kernel cache {folder} {problem}: building the C kernel in {private} instead", stacklevel=3
        )
        folder = private
    _state["dir"] = folder
    return folder


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        fields = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
        return "\n".join(fields)
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _compile(cc: str, out: Path, native: bool, openmp: bool) -> str | None:
    """Build the shared object at ``out``; returns an error message or None."""
    flags = (
        list(_BASE_FLAGS)
        + (["-march=native"] if native else [])
        + (["-fopenmp"] if openmp else [])
        + _extra_flags()
    )
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [cc, *flags, "-o", str(tmp), str(_SOURCE), "-lm", "-lpthread"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(cmd)}: {exc}"
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        return f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}"
    # the digest first, then the library, each atomically: concurrent builders never see a partial
    # file, and a library without its digest (a build cut short) is built again
    digest, digest_tmp = _digest_path(out), tmp.with_name(tmp.name + ".sha256")
    digest_tmp.write_text(_sha256(tmp))
    os.replace(digest_tmp, digest)
    os.replace(tmp, out)
    return None


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest_problem(path: Path) -> str | None:
    """None when ``path`` hashes to the digest recorded at its build, else what is wrong: a
    truncated shared object can crash the process that loads it (SIGBUS), so it is never loaded."""
    try:
        recorded = _digest_path(path).read_text().strip()
    except OSError:
        return "has no recorded sha256 (a build cut short?)"
    if _sha256(path) != recorded:
        return "does not match the sha256 recorded at its build (truncated or corrupt)"
    return None


def _extra_flags() -> list[str]:
    return os.environ.get("ATTNRES_CFLAGS", "").split()


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    for suf in SUPPORTED_DTYPES.values():
        fwd = getattr(lib, f"attnres_fwd_{suf}")
        fwd.argtypes = [p, p, p, p, i64, i64, i64, i64, i32, f64, i32, i32]
        fwd.restype = i32
        bwd = getattr(lib, f"attnres_bwd_{suf}")
        bwd.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i32, f64, i32, i32]
        bwd.restype = i32
        st = getattr(lib, f"attnres_states_{suf}")
        st.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, f64, i32, i32]
        st.restype = i32
        mg = getattr(lib, f"attnres_merge_{suf}")
        mg.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, f64, i32, i32]
        mg.restype = i32
        rf = getattr(lib, f"attnres_read_fwd_{suf}")
        rf.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i32, f64, i32, f64, i32]
        rf.restype = i32
        rb = getattr(lib, f"attnres_read_bwd_{suf}")
        rb.argtypes = [p, p, p, p, p, p, p, p, i64, i64, i64, i64, i32, f64, i32, f64, i32]
        rb.restype = i32
    lib.attnres_abi_version.restype = i32
    lib.attnres_uses_openmp.restype = i32
    lib.attnres_vector_bytes.restype = i32
    lib.attnres_set_stream_threshold.argtypes = [i64]
    lib.attnres_set_stream_threshold.restype = i64


def _library_name(cc: str, native: bool, openmp: bool) -> str:
    """The cached shared object's name: a hash of the source, the flags, the compiler and the CPU."""
    key = hashlib.sha256()
    for part in (
        _SOURCE.read_bytes(),
        repr((_BASE_FLAGS, _extra_flags(), native, openmp, cc, _ABI_VERSION)).encode(),
        _cpu_id().encode(),
    ):
        key.update(part)
    return f"depth_attention_{key.hexdigest()[:16]}.so"


def _open(path: Path) -> ctypes.CDLL:
    """dlopen ``path`` and declare its functions; ``OSError``/``AttributeError`` if it is not the kernel."""
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    if lib.attnres_abi_version() != _ABI_VERSION:
        raise OSError("ABI version mismatch")
    return lib


def _load_variant(cc: str, native: bool, openmp: bool) -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)`` for one build variant, from the cache or built now, else ``(None, why)``.
    A cached file that fails the ownership check is left alone and not loaded; one that does not
    match its recorded sha256 (truncated, corrupt) or does not load (another ABI) is deleted and
    built once more."""
    path = _cache_dir() / _library_name(cc, native, openmp)
    err = None
    for build in (False, True) if os.path.lexists(path) else (True,):
        if build:
            path.unlink(missing_ok=True)
            err = _compile(cc, path, native, openmp)
            if err is not None:
                return None, err
        problem = cache_dir_problem(path, file=True)
        if problem:
            return None, f"not loading {path}: it {problem}"
        damaged = _digest_problem(path)
        if damaged:
            err = f"not loading {path}: it {damaged}"
            continue
        try:
            lib = _open(path)
        except (OSError, AttributeError) as exc:
            err = f"loading {path}: {exc}"
            continue
        _state["lib"], _state["path"] = lib, path
        _state["threads"] = "openmp" if lib.attnres_uses_openmp() else "pthreads"
        return lib, None
    path.unlink(missing_ok=True)
    return None, err


def _load() -> ctypes.CDLL | None:
    with _lock:
        if "lib" in _state or "error" in _state:
            return _state.get("lib")  # type: ignore[return-value]
        if os.environ.get("ATTNRES_NO_COMPILE", "") not in ("", "0"):
            _state["error"] = "disabled by ATTNRES_NO_COMPILE"
            return None
        cc = _compiler()
        if cc is None:
            _state["error"] = "no C compiler found (set CC, or install gcc)"
            return None
        if not _SOURCE.exists():
            _state["error"] = f"kernel source missing: {_SOURCE}"
            return None
        errors = []
        no_omp = os.environ.get("ATTNRES_NO_OPENMP", "") not in ("", "0")
        for native, openmp in ((True, True), (True, False), (False, True), (False, False)):
            if openmp and no_omp:
                continue
            lib, err = _load_variant(cc, native, openmp)
            if lib is not None:
                return lib
            errors.append(err)
        _state["error"] = "; ".join(e for e in errors if e)
        return None


def unsupported_reason(device: torch.device | None = None, dtype: torch.dtype | None = None) -> str | None:
    """The part of :func:`unavailable_reason` that needs no build: device and dtype (traceable by
    torch.compile, which checks only this and leaves the build to the operator, see below)."""
    if device is not None and torch.device(device).type != "cpu":
        return f"the compiled backend runs on CPU tensors, got device {device}"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return f"the compiled backend supports {sorted(str(t) for t in SUPPORTED_DTYPES)}, got {dtype}"
    return None


def unavailable_reason(device: torch.device | None = None, dtype: torch.dtype | None = None) -> str | None:
    """None when the compiled backend can run on ``device``/``dtype``, else why not (builds the
    kernel on first call; the outcome is cached)."""
    reason = unsupported_reason(device, dtype)
    if reason is not None:
        return reason
    if _load() is None:
        return f"the C kernel could not be built: {_state.get('error')}"
    return None


def set_stream_threshold(nbytes: int) -> int:
    """Outputs of at least ``nbytes`` are written with non-temporal stores (default 8 MiB); returns the old value."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"backend='compiled' is unavailable: {_state.get('error')}")
    return int(lib.attnres_set_stream_threshold(int(nbytes)))


def library_path() -> Path | None:
    _load()
    return _state.get("path")  # type: ignore[return-value]


def threading_model() -> str | None:
    """``"openmp"`` (torch's pool), ``"pthreads"``, or None when the kernel is unavailable."""
    _load()
    return _state.get("threads")  # type: ignore[return-value]


def vector_bytes() -> int | None:
    """Bytes per vector the kernel was built for (64 with AVX-512, else 32), None when unavailable."""
    lib = _load()
    return None if lib is None else int(lib.attnres_vector_bytes())


def _threads(work: int) -> int:
    return max(1, min(torch.get_num_threads(), work // _ELEMS_PER_THREAD))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _Table:
    """A C array of the data pointers of ``tensors`` (kept alive as long as the table)."""

    def __init__(self, tensors: list[torch.Tensor] | None) -> None:
        self.tensors = tensors
        self.array = (
            None if tensors is None else (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
        )

    @property
    def ptr(self) -> int | None:
        return None if self.array is None else ctypes.addressof(self.array)


def _lib_for(v: torch.Tensor) -> tuple[ctypes.CDLL, str]:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"backend='compiled' is unavailable: {_state.get('error')}")
    return lib, SUPPORTED_DTYPES[v.dtype]


def forward(q: torch.Tensor, vs: list[torch.Tensor], eps: float, heads: int, key_norm: bool):
    """``q`` [d] or [M, d] (accumulation dtype), ``vs`` N contiguous [M, d] -> (out [M, d], lse [M, H])."""
    lib, suf = _lib_for(vs[0])
    n, (m, d) = len(vs), vs[0].shape
    out = torch.empty((m, d), dtype=vs[0].dtype)
    lse = torch.empty((m, heads), dtype=q.dtype)
    table = _Table(vs)
    rc = getattr(lib, f"attnres_fwd_{suf}")(
        table.ptr,
        _ptr(q),
        _ptr(out),
        _ptr(lse),
        n,
        m,
        d,
        heads,
        int(q.ndim == 1),
        float(eps),
        int(key_norm),
        _threads(n * m * d),
    )
    if rc != 0:
        raise MemoryError("depth attention (compiled): out of memory in the C kernel")
    return out, lse


def _source_grads(vs: list[torch.Tensor], one_buffer: bool = False) -> list[torch.Tensor]:
    """Empty gradients like the sources ``vs``; with ``one_buffer`` the slices of one ``[N, M, d]``."""
    if one_buffer:
        return list(torch.empty((len(vs), *vs[0].shape), dtype=vs[0].dtype).unbind(0))
    return [torch.empty_like(v) for v in vs]


def backward(q, vs, lse, g, eps, heads, key_norm, need_dq=True, need_dv=True, one_buffer=False):
    """Gradients ``(dq like q, accumulation dtype; [dv_i like v_i])`` given ``g = dL/dout`` [M, d];
    with ``one_buffer`` the dv_i are the slices of one ``[N, M, d]`` tensor."""
    lib, suf = _lib_for(vs[0])
    n, (m, d) = len(vs), vs[0].shape
    dvs = _source_grads(vs, one_buffer) if need_dv else None
    dq = torch.empty_like(q) if need_dq else None
    table, grads = _Table(vs), _Table(dvs)
    rc = getattr(lib, f"attnres_bwd_{suf}")(
        table.ptr,
        _ptr(q),
        _ptr(lse),
        _ptr(g),
        grads.ptr,
        _ptr(dq),
        n,
        m,
        d,
        heads,
        int(q.ndim == 1),
        float(eps),
        int(key_norm),
        _threads(2 * n * m * d),
    )
    if rc != 0:
        raise MemoryError("depth attention (compiled): out of memory in the C kernel")
    return dq, dvs


def states(qs: torch.Tensor, vs: list[torch.Tensor], eps: float, heads: int, key_norm: bool):
    """Phase 1: ``qs`` [Q, d] (accumulation dtype) over the N sources ``vs`` [M, d] in one read of
    them -> (lse [Q, M, H], out [Q, M, d]), both in the accumulation dtype."""
    lib, suf = _lib_for(vs[0])
    n, (m, d) = len(vs), vs[0].shape
    nq = qs.shape[0]
    lse = torch.empty((nq, m, heads), dtype=qs.dtype)
    out = torch.empty((nq, m, d), dtype=qs.dtype)
    table = _Table(vs)
    rc = getattr(lib, f"attnres_states_{suf}")(
        table.ptr,
        _ptr(qs),
        _ptr(lse),
        _ptr(out),
        nq,
        n,
        m,
        d,
        heads,
        float(eps),
        int(key_norm),
        _threads(nq * n * m * d),
    )
    if rc != 0:
        raise MemoryError("depth states (compiled): out of memory in the C kernel")
    return lse, out


def merge(q, vs, st_max, st_sum, st_out, eps, heads, key_norm):
    """Phase 2: the state (st_max, st_sum [M, H], st_out [M, d]) merged with the R sources ``vs``
    [M, d] -> [M, d] in their dtype."""
    lib, suf = _lib_for(vs[0])
    r, (m, d) = len(vs), vs[0].shape
    out = torch.empty((m, d), dtype=vs[0].dtype)
    table = _Table(vs)
    rc = getattr(lib, f"attnres_merge_{suf}")(
        table.ptr,
        _ptr(q),
        _ptr(st_max),
        _ptr(st_sum),
        _ptr(st_out),
        _ptr(out),
        r,
        m,
        d,
        heads,
        float(eps),
        int(key_norm),
        _threads(2 * r * m * d),
    )
    if rc != 0:
        raise MemoryError("depth merge (compiled): out of memory in the C kernel")
    return out


def read_forward(q, w, vs, eps, heads, key_norm, norm_eps):
    """The fused read: ``q`` [d] or [M, d] and ``w`` [d] (the output RMSNorm's gain, or None for
    no norm), both in the accumulation dtype, over N contiguous [M, d] sources ``vs`` ->
    (y [M, d] in their dtype, lse [M, H] in the accumulation dtype)."""
    lib, suf = _lib_for(vs[0])
    n, (m, d) = len(vs), vs[0].shape
    y = torch.empty((m, d), dtype=vs[0].dtype)
    lse = torch.empty((m, heads), dtype=q.dtype)
    table = _Table(vs)
    rc = getattr(lib, f"attnres_read_fwd_{suf}")(
        table.ptr, _ptr(q), _ptr(w), _ptr(y), _ptr(lse), n, m, d, heads, int(q.ndim == 1),
        float(eps), int(key_norm), float(norm_eps), _threads(n * m * d),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("depth attention read (compiled): out of memory in the C kernel")
    return y, lse


def read_backward(
    q,
    w,
    vs,
    lse,
    gy,
    eps,
    heads,
    key_norm,
    norm_eps,
    need_dq=True,
    need_dw=True,
    need_dv=True,
):
    """Gradients of :func:`read_forward` given ``gy = dL/dy`` [M, d]: (dq like q, dw like w, both in
    the accumulation dtype; [dv_i like v_i]), each None when not needed."""
    lib, suf = _lib_for(vs[0])
    n, (m, d) = len(vs), vs[0].shape
    dvs = _source_grads(vs) if need_dv else None
    dq = torch.empty_like(q) if need_dq else None
    dw = torch.empty_like(w) if need_dw and w is not None else None
    table, grads = _Table(vs), _Table(dvs)
    rc = getattr(lib, f"attnres_read_bwd_{suf}")(
        table.ptr, _ptr(q), _ptr(w), _ptr(lse), _ptr(gy), grads.ptr, _ptr(dq), _ptr(dw), n, m, d,
        heads, int(q.ndim == 1), float(eps), int(key_norm), float(norm_eps), _threads(2 * n * m * d),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("depth attention read (compiled): out of memory in the C kernel")
    return dq, dw, dvs


# ----------------------------------------------------------------------------------------------
# torch.compile: the forward and backward kernels as custom operators. Dynamo cannot trace a
# ctypes call; as operators the graph calls them opaquely, their fake implementations give
# inductor the output shapes, and register_autograd gives the gradient. Registering them is cheap
# (nothing is built until an operator runs, and torch._dynamo is not imported). The dispatcher
# uses them inside torch.compile only: in eager mode DepthAttentionFunction calls forward/backward
# directly (a stacked input gets its gradient as one tensor there).
#
# Tracing cannot build the kernel (a subprocess, a lock, files), so the dispatcher checks only the
# device and dtype then (:func:`unsupported_reason`) and the operator settles the build when it
# runs: if the kernel cannot be built it computes the same thing with the eager formulas
# (``strict=False``, what ``backend="auto"`` asks for) or raises RuntimeError (``strict=True``: a
# forced ``backend="compiled"``).


def _eager_fallback(strict: bool):
    """None when the kernel is built, else the eager kernels to use instead (or raise if strict)."""
    if _load() is not None:
        return None
    if strict:
        raise RuntimeError(
            f"backend='compiled' is unavailable: the C kernel could not be built: {_state.get('error')}"
        )
    from .autograd import EAGER

    return EAGER


@torch.library.custom_op("attention_residuals::depth_attention_cpu", mutates_args=(), device_types="cpu")
def depth_attention_op(
    q: torch.Tensor, vs: list[torch.Tensor], eps: float, heads: int, key_norm: bool, strict: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward` as an operator: ``q`` [d] or [M, d] in the accumulation dtype, ``vs`` N
    [M, d] of one supported dtype -> (out [M, d] in their dtype, lse [M, H] in q's dtype)."""
    eager = _eager_fallback(strict)
    fwd = forward if eager is None else eager.forward
    return fwd(q.contiguous(), [v.contiguous() for v in vs], eps, heads, key_norm)


@depth_attention_op.register_fake
def _depth_attention_fake(q, vs, eps, heads, key_norm, strict):
    m, d = vs[0].shape
    return vs[0].new_empty((m, d)), q.new_empty((m, heads))


@torch.library.custom_op(
    "attention_residuals::depth_attention_cpu_backward", mutates_args=(), device_types="cpu"
)
def depth_attention_backward_op(
    q: torch.Tensor,
    vs: list[torch.Tensor],
    lse: torch.Tensor,
    g: torch.Tensor,
    eps: float,
    heads: int,
    key_norm: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`backward` as an operator: (dq like q, [dv_i like v_i]) given ``g = dL/dout`` [M, d]
    (the eager formulas where the forward used them)."""
    eager = _eager_fallback(False)
    bwd = backward if eager is None else eager.backward
    vs = [v.contiguous() for v in vs]
    dq, dvs = bwd(q.contiguous(), vs, lse.contiguous(), g.contiguous(), eps, heads, key_norm)
    if eager is not None:  # the eager dv_i are slices of one tensor: an operator's outputs may not alias
        dvs = [dv.clone() for dv in dvs]
    return dq, dvs


@depth_attention_backward_op.register_fake
def _depth_attention_backward_fake(q, vs, lse, g, eps, heads, key_norm):
    return torch.empty_like(q), [torch.empty_like(v) for v in vs]


def _op_setup_context(ctx, inputs, output) -> None:
    q, vs, eps, heads, key_norm, strict = inputs
    ctx.save_for_backward(q, output[1], *vs)
    ctx.config = (eps, heads, key_norm)


def _op_backward(ctx, grad_out, grad_lse):
    q, lse, *vs = ctx.saved_tensors
    dq, dvs = depth_attention_backward_op(q, vs, lse, grad_out.to(vs[0].dtype), *ctx.config)
    return dq, dvs, None, None, None, None


depth_attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)


@torch.library.custom_op("attention_residuals::read_normed_cpu", mutates_args=(), device_types="cpu")
def read_normed_op(
    q: torch.Tensor,
    w: torch.Tensor,
    vs: list[torch.Tensor],
    eps: float,
    heads: int,
    key_norm: bool,
    norm_eps: float,
    strict: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`read_forward` as an operator (the fused read under torch.compile): ``q`` [d] or
    [M, d] and ``w`` [d] in the accumulation dtype, ``vs`` N [M, d] -> (y [M, d] in their dtype,
    lse [M, H] in q's dtype); the eager formulas where the kernel is not built."""
    eager = _eager_fallback(strict)
    fwd = read_forward if eager is None else _eager_read()[0]
    return fwd(q.contiguous(), w.contiguous(), [v.contiguous() for v in vs], eps, heads, key_norm, norm_eps)


@read_normed_op.register_fake
def _read_normed_fake(q, w, vs, eps, heads, key_norm, norm_eps, strict):
    m, d = vs[0].shape
    return vs[0].new_empty((m, d)), q.new_empty((m, heads))


@torch.library.custom_op("attention_residuals::read_normed_cpu_backward", mutates_args=(), device_types="cpu")
def read_normed_backward_op(
    q: torch.Tensor,
    w: torch.Tensor,
    vs: list[torch.Tensor],
    lse: torch.Tensor,
    gy: torch.Tensor,
    eps: float,
    heads: int,
    key_norm: bool,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`read_backward` as an operator: (dq like q, dw like w, [dv_i like v_i])."""
    eager = _eager_fallback(False)
    bwd = read_backward if eager is None else _eager_read()[1]
    vs = [v.contiguous() for v in vs]
    dq, dw, dvs = bwd(q.contiguous(), w.contiguous(), vs, lse.contiguous(), gy.contiguous(), eps, heads, key_norm, norm_eps, True, True, True)  # fmt: skip
    if eager is not None:  # an operator's outputs may not alias one another
        dvs = [dv.clone() for dv in dvs]
    return dq, dw, dvs


@read_normed_backward_op.register_fake
def _read_normed_backward_fake(q, w, vs, lse, gy, eps, heads, key_norm, norm_eps):
    return torch.empty_like(q), torch.empty_like(w), [torch.empty_like(v) for v in vs]


def _eager_read():
    from .autograd import EAGER, read_kernels

    return read_kernels(EAGER)


def _read_setup_context(ctx, inputs, output) -> None:
    q, w, vs, eps, heads, key_norm, norm_eps, strict = inputs
    ctx.save_for_backward(q, w, output[1], *vs)
    ctx.config = (eps, heads, key_norm, norm_eps)


def _read_backward(ctx, grad_y, grad_lse):
    q, w, lse, *vs = ctx.saved_tensors
    dq, dw, dvs = read_normed_backward_op(q, w, vs, lse, grad_y.to(vs[0].dtype), *ctx.config)
    return dq, dw, dvs, None, None, None, None, None


read_normed_op.register_autograd(_read_backward, setup_context=_read_setup_context)
