"""The ``triton`` backend: fused depth-attention forward and backward as Triton kernels.

Imported lazily by the dispatcher (``import triton`` happens here only), so the package works
without triton or a GPU. Runs on CUDA tensors in float32, bfloat16 and float16 (accumulation in
float32); with ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors, which is how CI tests them.

Layout: program ``(pid, h)`` handles ``BLOCK_M`` tokens of head ``h``; a head's ``dh`` channels are
covered by ``BLOCK_D`` lanes (any ``dh``: masked loads).

* Forward, ``dh <= BLOCK_D``: one pass over the sources with online softmax (running max ``m``,
  normaliser ``l``, accumulator rescaled by ``exp(m_old - m_new)``); sources read once.
* Forward, larger ``dh``: pass 1 streams the channel chunks of each source for the logits
  (online ``m``, ``l``), pass 2 the weighted sum chunk by chunk; the logits ``[N, M, H]`` go
  through a float32 scratch buffer.
* Precision (the contract of :mod:`attention_residuals.functional`): the sources arrive in one
  dtype, the activation dtype (the dispatcher casts the others); every load is widened to float32,
  logits, ``m``, ``l``, ``lse``, the accumulators and the scratch buffers are float32, and only the
  stores of ``out`` and ``dv`` round to the sources' dtype (round to nearest on a GPU; the CPU
  interpreter truncates float32 to bfloat16, one ulp at most).
* Backward: pass 1 recomputes ``r_i``, ``z_i``, ``alpha_i = exp(z_i - lse)``, ``s_i = g . v_i`` and
  ``delta = sum_i alpha_i s_i`` (kept in a scratch buffer ``[4, N, M, H]``); pass 2 writes
  ``dv_i = alpha_i g + a_i q + b_i v_i`` and accumulates ``dq += a_i v_i`` (per token, or per
  program for a static query, summed afterwards in a fixed order -- deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["forward", "backward", "states", "merge"]

_MAX_BLOCK_D = 4096  # lanes per program for one head's channels; above, chunked kernels
_TILE_ELEMS = 4096  # BLOCK_M * BLOCK_D
# Warps per program: 8 spreads a 4096-element tile over 256 threads (16 elements per thread and
# tensor), as the common heuristic for fused row kernels has it (8 warps from 2048 elements, in
# Unsloth's and Liger-Kernel's launch settings). Compiled for sm_90 by scripts/triton_aot.py (no
# GPU needed; results/triton/): with 4 warps most backward variants took 150-255 registers per
# thread and 5 of the 99 binaries spilled to the stack (up to 104 bytes: float32 backward at
# dh = 192); with 8, at most 169 registers and no spills. Not yet timed on a GPU:
# scripts/gpu_check.sh times 4 against 8.
_NUM_WARPS = 8


@triton.jit
def _fwd_onepass(
    V,
    Q,
    OUT,
    LSE,
    M,
    D,
    DH,
    H,
    stride_n,
    q_stride,
    N,
    eps,
    KEY_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    k = tl.program_id(2).to(tl.int64)  # query index: phase 1 runs Q static queries at once
    Q += k * D
    OUT += k * M * D
    LSE += k * M * H
    stride_n = stride_n.to(tl.int64)  # i * stride_n can pass 2**31
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < M
    mask = rmask[:, None] & (cols < DH)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + h * DH + cols[None, :]
    q_offs = rows.to(tl.int64)[:, None] * q_stride + h * DH + cols[None, :]
    q = tl.load(Q + q_offs, mask=mask, other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    ptrs = V + offs
    for _ in range(N):
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        z = tl.sum(x * q, 1)
        if KEY_NORM:
            z = z * tl.rsqrt(tl.sum(x * x, 1) / DH + eps)
        m_new = tl.maximum(m_i, z)
        scale = tl.exp(m_i - m_new)
        p = tl.exp(z - m_new)
        l_i = l_i * scale + p
        acc = acc * scale[:, None] + p[:, None] * x
        m_i = m_new
        ptrs += stride_n
    tl.store(OUT + offs, (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=mask)
    tl.store(LSE + rows * H + h, m_i + tl.log(l_i), mask=rmask)


@triton.jit
def _fwd_chunked(
    V,
    Q,
    OUT,
    LSE,
    Z,
    M,
    D,
    DH,
    H,
    stride_n,
    q_stride,
    N,
    eps,
    KEY_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    k = tl.program_id(2).to(tl.int64)  # query index (phase 1)
    Q += k * D
    OUT += k * M * D
    LSE += k * M * H
    Z += k * N * M * H
    stride_n = stride_n.to(tl.int64)  # i * stride_n can pass 2**31
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < M
    base = rows.to(tl.int64)[:, None] * D + h * DH
    q_base = rows.to(tl.int64)[:, None] * q_stride + h * DH
    z_offs = rows * H + h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for i in range(N):
        qv = tl.zeros([BLOCK_M], tl.float32)
        ss = tl.zeros([BLOCK_M], tl.float32)
        for c0 in range(0, DH, BLOCK_D):
            c = c0 + cols
            mask = rmask[:, None] & (c < DH)[None, :]
            x = tl.load(V + i * stride_n + base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.load(Q + q_base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            qv += tl.sum(x * q, 1)
            ss += tl.sum(x * x, 1)
        z = qv
        if KEY_NORM:
            z = qv * tl.rsqrt(ss / DH + eps)
        tl.store(Z + i * M * H + z_offs, z, mask=rmask)
        m_new = tl.maximum(m_i, z)
        l_i = l_i * tl.exp(m_i - m_new) + tl.exp(z - m_new)
        m_i = m_new
    lse = m_i + tl.log(l_i)
    tl.store(LSE + z_offs, lse, mask=rmask)
    for c0 in range(0, DH, BLOCK_D):
        c = c0 + cols
        mask = rmask[:, None] & (c < DH)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for i in range(N):
            alpha = tl.exp(tl.load(Z + i * M * H + z_offs, mask=rmask, other=0.0) - lse)
            x = tl.load(V + i * stride_n + base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += alpha[:, None] * x
        tl.store(OUT + base + c[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _bwd(
    V,
    Q,
    LSE,
    G,
    DV,
    DQ,
    S,
    M,
    D,
    DH,
    H,
    stride_n,
    q_stride,
    dq_stride,
    N,
    eps,
    KEY_NORM: tl.constexpr,
    STATIC_Q: tl.constexpr,
    NEED_DV: tl.constexpr,
    NEED_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    stride_n = stride_n.to(tl.int64)  # i * stride_n can pass 2**31
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < M
    base = rows.to(tl.int64)[:, None] * D + h * DH
    q_base = rows.to(tl.int64)[:, None] * q_stride + h * DH
    s_offs = rows * H + h
    plane = N * M * H  # scratch S: [4, N, M, H] = r, z, alpha, s
    lse = tl.load(LSE + s_offs, mask=rmask, other=0.0)
    delta = tl.zeros([BLOCK_M], tl.float32)
    # pass 1: per-source scalars
    for i in range(N):
        qv = tl.zeros([BLOCK_M], tl.float32)
        ss = tl.zeros([BLOCK_M], tl.float32)
        gv = tl.zeros([BLOCK_M], tl.float32)
        for c0 in range(0, DH, BLOCK_D):
            c = c0 + cols
            mask = rmask[:, None] & (c < DH)[None, :]
            x = tl.load(V + i * stride_n + base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.load(Q + q_base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            qv += tl.sum(x * q, 1)
            ss += tl.sum(x * x, 1)
            gv += tl.sum(x * g, 1)
        r = tl.full([BLOCK_M], 1.0, tl.float32)
        if KEY_NORM:
            r = tl.rsqrt(ss / DH + eps)
        z = qv * r
        alpha = tl.exp(z - lse)
        delta += alpha * gv
        k = i * M * H + s_offs
        tl.store(S + k, r, mask=rmask)
        tl.store(S + plane + k, z, mask=rmask)
        tl.store(S + 2 * plane + k, alpha, mask=rmask)
        tl.store(S + 3 * plane + k, gv, mask=rmask)
    # pass 2: gradients, channel chunk by chunk
    for c0 in range(0, DH, BLOCK_D):
        c = c0 + cols
        cmask = c < DH
        mask = rmask[:, None] & cmask[None, :]
        q = tl.load(Q + q_base + c[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + base + c[None, :], mask=mask, other=0.0).to(tl.float32)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for i in range(N):
            k = i * M * H + s_offs
            r = tl.load(S + k, mask=rmask, other=0.0)
            z = tl.load(S + plane + k, mask=rmask, other=0.0)
            alpha = tl.load(S + 2 * plane + k, mask=rmask, other=0.0)
            gv = tl.load(S + 3 * plane + k, mask=rmask, other=0.0)
            dz = alpha * (gv - delta)
            a = dz * r
            x = tl.load(V + i * stride_n + base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if NEED_DV:
                dv = alpha[:, None] * g + a[:, None] * q
                if KEY_NORM:
                    dv += (-dz * z * r * r / DH)[:, None] * x
                tl.store(DV + i * stride_n + base + c[None, :], dv.to(DV.dtype.element_ty), mask=mask)
            if NEED_DQ:
                dq += a[:, None] * x
        if NEED_DQ:
            if STATIC_Q:
                tl.store(DQ + pid * dq_stride + h * DH + c, tl.sum(dq, 0), mask=cmask)
            else:
                tl.store(DQ + rows.to(tl.int64)[:, None] * dq_stride + h * DH + c[None, :], dq, mask=mask)


@triton.jit
def _merge(
    V,
    Q,
    SMAX,
    SSUM,
    SOUT,
    OUT,
    Z,
    M,
    D,
    DH,
    H,
    stride_n,
    R,
    eps,
    KEY_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Phase 2: the state (SMAX, SSUM [M, H], SOUT [M, D]) merged with R more sources."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    stride_n = stride_n.to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < M
    base = rows.to(tl.int64)[:, None] * D + h * DH
    s_offs = rows * H + h
    m_i = tl.load(SMAX + s_offs, mask=rmask, other=0.0)
    m0 = m_i
    for r in range(R):
        qv = tl.zeros([BLOCK_M], tl.float32)
        ss = tl.zeros([BLOCK_M], tl.float32)
        for c0 in range(0, DH, BLOCK_D):
            c = c0 + cols
            mask = rmask[:, None] & (c < DH)[None, :]
            x = tl.load(V + r * stride_n + base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.load(Q + h * DH + c, mask=c < DH, other=0.0).to(tl.float32)
            qv += tl.sum(x * q[None, :], 1)
            ss += tl.sum(x * x, 1)
        z = qv
        if KEY_NORM:
            z = qv * tl.rsqrt(ss / DH + eps)
        tl.store(Z + r * M * H + s_offs, z, mask=rmask)
        m_i = tl.maximum(m_i, z)
    w0 = tl.load(SSUM + s_offs, mask=rmask, other=1.0) * tl.exp(m0 - m_i)
    l_i = w0
    for r in range(R):
        l_i += tl.exp(tl.load(Z + r * M * H + s_offs, mask=rmask, other=0.0) - m_i)
    for c0 in range(0, DH, BLOCK_D):
        c = c0 + cols
        mask = rmask[:, None] & (c < DH)[None, :]
        acc = w0[:, None] * tl.load(SOUT + base + c[None, :], mask=mask, other=0.0)
        for r in range(R):
            p = tl.exp(tl.load(Z + r * M * H + s_offs, mask=rmask, other=0.0) - m_i)
            x = tl.load(V + r * stride_n + base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += p[:, None] * x
        tl.store(OUT + base + c[None, :], (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=mask)


def _blocks(dh: int, m: int, block_d: int | None) -> tuple[int, int]:
    bd = block_d or min(triton.next_power_of_2(max(dh, 1)), _MAX_BLOCK_D)
    bm = max(1, min(_TILE_ELEMS // bd, triton.next_power_of_2(max(m, 1)), 64))
    return bm, bd


def forward(q, v, eps, heads, key_norm, *, block_d: int | None = None):
    """``q`` [d] or [M, d] float32, ``v`` [N, M, d] contiguous -> (out [M, d] v.dtype, lse [M, H] float32).

    ``block_d`` (tests) forces the channel lanes per program, so small shapes exercise the chunked kernel.
    """
    n, m, d = v.shape
    out = torch.empty((m, d), dtype=v.dtype, device=v.device)
    lse = torch.empty((m, heads), dtype=torch.float32, device=v.device)
    if m == 0:
        return out, lse
    _launch_forward(q, v, out, lse, eps, heads, key_norm, 1, 0 if q.ndim == 1 else d, block_d)
    return out, lse


def _launch_forward(q, v, out, lse, eps, heads, key_norm, nq, q_stride, block_d):
    """``nq`` queries (grid dim 2, query k at ``q + k d``); ``q_stride``: d for one query per token, else 0."""
    n, m, d = v.shape
    dh = d // heads
    bm, bd = _blocks(dh, m, block_d)
    grid = (triton.cdiv(m, bm), heads, nq)
    if bd >= dh:
        _fwd_onepass[grid](
            v,
            q,
            out,
            lse,
            m,
            d,
            dh,
            heads,
            m * d,
            q_stride,
            n,
            eps,
            KEY_NORM=key_norm,
            BLOCK_M=bm,
            BLOCK_D=bd,
            num_warps=_NUM_WARPS,
        )
    else:
        z = torch.empty((nq, n, m, heads), dtype=torch.float32, device=v.device)
        _fwd_chunked[grid](
            v,
            q,
            out,
            lse,
            z,
            m,
            d,
            dh,
            heads,
            m * d,
            q_stride,
            n,
            eps,
            KEY_NORM=key_norm,
            BLOCK_M=bm,
            BLOCK_D=bd,
            num_warps=_NUM_WARPS,
        )


def states(qs, v, eps, heads, key_norm, *, block_d: int | None = None):
    """Phase 1: ``qs`` [Q, d] float32 over ``v`` [N, M, d] -> (lse [Q, M, H], out [Q, M, d]) in float32.

    The Q programs of a token tile are adjacent in the grid, so the sources come from DRAM once."""
    n, m, d = v.shape
    nq = qs.shape[0]
    lse = torch.empty((nq, m, heads), dtype=torch.float32, device=v.device)
    out = torch.empty((nq, m, d), dtype=torch.float32, device=v.device)
    if m and nq:
        _launch_forward(qs, v, out, lse, eps, heads, key_norm, nq, 0, block_d)
    return lse, out


def merge(q, v, st_max, st_sum, st_out, eps, heads, key_norm, *, block_d: int | None = None):
    """Phase 2: the state (st_max, st_sum [M, H], st_out [M, d], float32) merged with ``v`` [R, M, d]."""
    r, m, d = v.shape
    dh = d // heads
    out = torch.empty((m, d), dtype=v.dtype, device=v.device)
    if m == 0:
        return out
    bm, bd = _blocks(dh, m, block_d)
    z = torch.empty((max(r, 1), m, heads), dtype=torch.float32, device=v.device)
    _merge[(triton.cdiv(m, bm), heads)](
        v,
        q,
        st_max,
        st_sum,
        st_out,
        out,
        z,
        m,
        d,
        dh,
        heads,
        m * d,
        r,
        eps,
        KEY_NORM=key_norm,
        BLOCK_M=bm,
        BLOCK_D=bd,
        num_warps=_NUM_WARPS,
    )
    return out


def backward(q, v, lse, g, eps, heads, key_norm, need_dq=True, need_dv=True, *, block_d: int | None = None):
    n, m, d = v.shape
    dh = d // heads
    static = q.ndim == 1
    bm, bd = _blocks(dh, m, block_d)
    n_prog = triton.cdiv(m, bm) if m else 0
    dv = torch.empty_like(v) if need_dv else None
    if static:
        dq_buf = torch.zeros((max(n_prog, 1), d), dtype=torch.float32, device=v.device)
    else:
        dq_buf = torch.zeros((m, d), dtype=torch.float32, device=v.device)
    if m > 0 and (need_dq or need_dv):
        scratch = torch.empty((4, n, m, heads), dtype=torch.float32, device=v.device)
        _bwd[(n_prog, heads)](
            v,
            q,
            lse,
            g,
            dv if need_dv else v,
            dq_buf,
            scratch,
            m,
            d,
            dh,
            heads,
            m * d,
            0 if static else d,
            d,
            n,
            eps,
            KEY_NORM=key_norm,
            STATIC_Q=static,
            NEED_DV=need_dv,
            NEED_DQ=need_dq,
            BLOCK_M=bm,
            BLOCK_D=bd,
            num_warps=_NUM_WARPS,
        )
    dq = None
    if need_dq:
        dq = (dq_buf.sum(0) if static else dq_buf).to(q.dtype)
    return dq, dv
