"""Compile every Triton kernel of the package for NVIDIA GPUs on a machine without one.

`TRITON_INTERPRET=1` (how CI runs the kernels) checks what they compute, but never compiles them:
a kernel that the interpreter runs can still fail in Triton's compiler or in ptxas (types, layouts,
register limits). This script runs the backend's own wrappers (`forward`, `backward`, `states`,
`merge`) on CPU tensors with Triton told that the current device is a GPU of the given compute
capability, and with every launch turned into a compile-only warmup. The kernels go through the
whole pipeline down to a cubin, with the ptxas bundled in the triton wheel. No kernel runs, so
nothing is checked numerically here. Per kernel it prints the resources ptxas gave it: registers
per thread, stack (register spills) and shared memory, read from the cubin by the bundled
cuobjdump. A register-bound kernel shows up here before any GPU time is spent on it.

    python scripts/triton_aot.py                      # sm_90 (H100/H200) and sm_80 (A100)
    python scripts/triton_aot.py --arch 90 --num-warps 4 --json triton_sm90_w4.json

Exit status 1 when a kernel fails to compile. This leans on Triton internals (the active driver,
`JITFunction.run`), checked with triton 3.0.0, 3.1.0, 3.3.1, 3.6.0, 3.7.1, 3.8.0 and 3.9.0. The
tables of results/triton/ are its output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
    sys.exit("triton_aot.py: unset TRITON_INTERPRET (the interpreter does not compile)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from attention_residuals.kernels import triton_kernels as tk  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _CompileOnlyDriver:
    """What `JITFunction.run` asks of the active driver before it compiles: a target and a device."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def cases(dtype: torch.dtype, quick: bool = False, eps: float = 1e-6):
    """(label, call) pairs reaching every kernel and every constexpr branch the wrappers use: the
    whole product of the flags, or with ``quick`` a subset in which each value of each flag occurs."""
    shapes = ((9, 256, 1024, 1), (17, 256, 768, 4), (3, 64, 8192, 1))  # one pass, heads, channel chunks
    flags = [
        (kn, pt, dq, dv)
        for kn in (True, False)
        for pt in (False, True)
        for dq, dv in ((1, 1), (1, 0), (0, 1))
    ]
    if quick:
        flags = [(True, False, 1, 1), (False, True, 1, 0), (False, False, 0, 1)]
    for n, m, d, heads in shapes:
        v, g, lse = torch.randn(n, m, d).to(dtype), torch.randn(m, d).to(dtype), torch.zeros(m, heads)
        shape = f"N={n} d={d} H={heads}"
        for key_norm, per_token, need_dq, need_dv in flags:
            q = torch.randn(m, d) if per_token else torch.randn(d)
            what = f"{shape} {'per-token' if per_token else 'static'} q, key_norm={key_norm}"
            if need_dq and need_dv:  # once per (query kind, key_norm)
                yield f"forward {what}", lambda q=q, v=v, k=key_norm, h=heads: tk.forward(q, v, eps, h, k)
            yield (
                f"backward {what} dq={bool(need_dq)} dv={bool(need_dv)}",
                lambda q=q, v=v, lse=lse, g=g, k=key_norm, h=heads, a=bool(need_dq), b=bool(need_dv): (
                    tk.backward(q, v, lse, g, eps, h, k, a, b)
                ),
            )
        qs = torch.randn(4, d)
        yield f"states {shape} Q=4", lambda qs=qs, v=v, h=heads: tk.states(qs, v, eps, h, True)
        st_max, st_sum, st_out = torch.zeros(m, heads), torch.ones(m, heads), torch.zeros(m, d)
        for key_norm in (True, False):
            yield (
                f"merge {shape} R=2, key_norm={key_norm}",
                lambda v=v, h=heads, a=st_max, b=st_sum, c=st_out, k=key_norm: tk.merge(
                    c[0].float(), v[:2], a, b, c, eps, h, k
                ),
            )


def resources(cubin: bytes) -> dict[str, int]:
    """REG/STACK/SHARED/LOCAL of the cubin's one kernel, from `cuobjdump --dump-resource-usage`."""
    if not CUOBJDUMP.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return dict(zip(("regs", "stack", "shared", "local"), map(int, found.groups()))) if found else {}


def compile_all(arch: int, dtype_names: list[str], quick: bool = False) -> tuple[list[dict], list[str]]:
    """Compile every case for sm_<arch>; returns (one row per distinct kernel binary, failures)."""
    rows: dict[str, dict] = {}
    failures: list[str] = []
    label = ""
    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        row = rows.setdefault(
            kernel.hash, {"kernel": self.__name__, "arch": f"sm_{arch}", "first_case": label}
        )
        row.update(num_warps=kernel.metadata.num_warps, num_stages=kernel.metadata.num_stages)
        row.update(resources(kernel.asm["cubin"]))
        return kernel

    driver.set_active(_CompileOnlyDriver(arch))
    for fn in vars(tk).values():  # each kernel caches per device: drop the last arch's binaries
        if isinstance(fn, JITFunction):
            for name in ("device_caches", "cache"):  # triton 3.3-3.9, and 3.1
                if hasattr(fn, name):
                    getattr(fn, name).clear()
    JITFunction.run = compile_only
    try:
        for name in dtype_names:
            for label, call in cases(DTYPES[name], quick):
                label = f"{name} {label}"
                try:
                    call()
                except Exception as exc:  # a compile error: report it with the case, go on
                    failures.append(f"sm_{arch} {label}: {type(exc).__name__}: {str(exc).strip()[:800]}")
    finally:
        JITFunction.run = original_run
    return list(rows.values()), failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (90 = H100/H200)"
    )
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=sorted(DTYPES))
    ap.add_argument("--quick", action="store_true", help="a covering subset of the cases (the test)")
    ap.add_argument("--num-warps", type=int, help="override the kernels' warps per program (default: theirs)")
    ap.add_argument("--json", type=Path, help="also write the rows and failures here")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    if args.num_warps:
        tk._NUM_WARPS = args.num_warps
    rows, failures = [], []
    for arch in args.arch:
        got, failed = compile_all(arch, args.dtype, args.quick)
        rows += got
        failures += failed
    cols = ("arch", "kernel", "num_warps", "regs", "stack", "shared", "first_case")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "?")) for c in cols) + " |")
    spilling = [r for r in rows if r.get("stack", 0) > 0]
    print(
        f"\ntriton {triton.__version__}, {tk._NUM_WARPS} warps: {len(rows)} kernel binaries compiled, "
        f"{len(failures)} failures; at most {max((r.get('regs', 0) for r in rows), default=0)} registers, "
        f"{len(spilling)} with a stack frame (spills)"
    )
    for line in failures:
        print("FAILED", line, file=sys.stderr)
    if args.json:
        args.json.write_text(
            json.dumps({"triton": triton.__version__, "rows": rows, "failures": failures}, indent=1)
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
