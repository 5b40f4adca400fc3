/* Fused depth attention on the CPU: one read of the sources from memory, online softmax.
 *
 * Built at first use by attention_residuals/kernels/cpu.py with the system C compiler and loaded
 * through ctypes: no torch headers, so a build takes about a second. Called on contiguous data:
 *
 *   v    [N, M, d]  sources (float32, bfloat16 stored as uint16, or float64)
 *   q    [d] (static, q_static=1) or [M, d] (one query per token); accumulation type
 *   out  [M, d]     output, type of v
 *   lse  [M, H]     logsumexp of the logits over the N sources, accumulation type
 *
 * Per token m and head h (a group of dh = d / H channels):
 *   r_i = 1 / sqrt(mean_c v_ic^2 + eps)   (1 without key_norm)
 *   z_i = r_i (q . v_i),  alpha_i = exp(z_i - lse),  out = sum_i alpha_i v_i
 *
 * Backward, with g = dL/dout, s_i = g . v_i and delta = sum_i alpha_i s_i (= g . out):
 *   dz_i = alpha_i (s_i - delta)
 *   dv_i = alpha_i g + dz_i r_i q - dz_i z_i r_i^2 / dh v_i     (last term only with key_norm)
 *   dq   = sum_i dz_i r_i v_i                                    (summed over tokens if static)
 * Everything is accumulated in float32 (float64 for float64 sources); nothing is subtracted in
 * bfloat16.
 *
 * Memory schedule. Each thread walks its tokens in tiles. The forward makes one pass: inside a
 * tile it reads each source's rows in token order -- one long contiguous run per source, which the
 * memory system streams best -- and merges every row into its token's accumulator by online
 * softmax (running max and normaliser, the accumulator rescaled when the max grows), reducing the
 * next row while the previous one, still in L1, is added in; the accumulators of a tile fit
 * FWD_ACC_BYTES. The backward and the phase-1 states make two passes over a tile of T tokens: the
 * first (the reductions) streams T rows per source and leaves the tile in cache for the second
 * (the gradients, or the weighted sums); T is chosen so that all N sources of a tile fit
 * TILE_BYTES.
 * While a row is reduced, the bytes PREFETCH_BYTES further on in the same source are prefetched,
 * so the memory stream keeps going during the arithmetic; outputs of at least the stream
 * threshold (8 MiB: the output of the forward, the sources' gradient) are written with
 * non-temporal stores, which skips reading the lines they overwrite. Work is split over tokens
 * between nthreads threads: OpenMP when built with -fopenmp (cpu.py does, sharing torch's libgomp
 * and its awake workers), POSIX threads otherwise. The static-query gradient is reduced per
 * thread, then summed in thread order: deterministic.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#ifndef TILE_BYTES
#define TILE_BYTES (256 * 1024)
#endif
/* How far ahead the reductions prefetch, along the row's own source. Measured at the op
 * benchmark's shape (AMD EPYC, 2 threads, builds differing only in -D flags timed side by side
 * against sources.sum()): much faster than no software prefetch, and the forward ~25 % faster than
 * following pass-1 order across the jumps between sources (whose per-row index arithmetic cost
 * more than the prefetches it aimed better); 4-12 KiB measured alike. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif
/* The forward's accumulators per tile: 128 tokens of d = 1024 in float32, within a 1 MiB L2.
 * Measured at the op benchmark's shape (AMD EPYC, 2 threads, builds timed side by side against
 * sources.sum(), paired medians of 80-100 interleaved repeats): the one-pass schedule ran 0.97-1.20x
 * as fast as the two-pass one it replaced (256 KiB tiles: 7-row runs per source, which read the
 * sources at only 0.83-0.85 of sources.sum() even with the weighted sum left out), faster in 8 of
 * 9 runs; 384-768 KiB measured alike, 2 MiB slower. */
#ifndef FWD_ACC_BYTES
#define FWD_ACC_BYTES (512 * 1024)
#endif
#ifndef MAX_TILE
#define MAX_TILE 32
#endif
/* Vectors. The hot loops are written with the compiler's vector extensions (GCC and Clang): a
 * vector is one register of the widest kind -march=native offers (64 bytes with AVX-512, 32
 * otherwise), and a few independent accumulators per reduction hide the FMA latency. Plain
 * arrays with `omp simd` were 2-7x slower here: the compiler kept them in memory. */
#if defined(__AVX512F__)
#define VBYTES 64
#else
#define VBYTES 32
#endif
typedef float vf32 __attribute__((vector_size(VBYTES)));
typedef double vf64 __attribute__((vector_size(VBYTES)));
typedef uint32_t vu32 __attribute__((vector_size(VBYTES)));
typedef uint16_t vu16 __attribute__((vector_size(VBYTES / 2)));
#define VW_f32 ((int64_t)(VBYTES / 4))
#define VW_f64 ((int64_t)(VBYTES / 8))

static inline vf32 vload_f32(const float *p) { vf32 x; memcpy(&x, p, sizeof x); return x; }
static inline void vstore_f32(float *p, vf32 x) { memcpy(p, &x, sizeof x); }
static inline vf64 vload_f64(const double *p) { vf64 x; memcpy(&x, p, sizeof x); return x; }
static inline void vstore_f64(double *p, vf64 x) { memcpy(p, &x, sizeof x); }
static inline vf32 vload_bf16(const uint16_t *p) {
    vu16 h;
    memcpy(&h, p, sizeof h);
    vu32 w = __builtin_convertvector(h, vu32) << 16;
    vf32 x;
    memcpy(&x, &w, sizeof x);
    return x;
}
static inline void vstore_bf16(uint16_t *p, vf32 x) { /* as bf16_store, lane by lane */
    vu32 u;
    memcpy(&u, &x, sizeof u);
    vu32 nan = (vu32)((u & 0x7fffffffu) > 0x7f800000u);
    vu32 r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~nan) | (((u >> 16) | 0x40u) & nan);
    vu16 h = __builtin_convertvector(r, vu16);
    memcpy(p, &h, sizeof h);
}
/* Store a vector; with `stream`, as non-temporal stores (outputs larger than the cache skip reading
 * the lines they overwrite) where the destination is aligned for them. */
static inline void stream_vec(void *dst, const void *src, size_t n) {
#if defined(__AVX__)
    if (((uintptr_t)dst & 31) == 0 && n % 32 == 0) {
        for (size_t o = 0; o < n; o += 32)
            _mm256_stream_si256((__m256i *)((char *)dst + o), _mm256_loadu_si256((const __m256i *)((const char *)src + o)));
        return;
    }
#endif
    memcpy(dst, src, n);
}
static inline void put_f32(float *dst, vf32 x, int stream) {
    if (stream) stream_vec(dst, &x, sizeof x); else vstore_f32(dst, x);
}
static inline void put_f64(double *dst, vf64 x, int stream) {
    if (stream) stream_vec(dst, &x, sizeof x); else vstore_f64(dst, x);
}
static inline void put_bf16(uint16_t *dst, vf32 x, int stream) {
    if (stream) {
        uint16_t h[VW_f32];
        vstore_bf16(h, x);
        stream_vec(dst, h, sizeof h);
    } else {
        vstore_bf16(dst, x);
    }
}
/* Horizontal sums as a tree of half-width adds: a serial lane-by-lane sum is a chain of 16
 * dependent adds with AVX-512, which at small d cost more than the row's loads. */
typedef float vh8f __attribute__((vector_size(32)));
typedef float vh4f __attribute__((vector_size(16)));
typedef double vh4d __attribute__((vector_size(32)));
typedef double vh2d __attribute__((vector_size(16)));
static inline float hsum4f(vh4f x) { return (x[0] + x[2]) + (x[1] + x[3]); }
static inline float hsum8f(vh8f x) {
    vh4f a, b;
    memcpy(&a, &x, sizeof a);
    memcpy(&b, (char *)&x + sizeof a, sizeof b);
    return hsum4f(a + b);
}
static inline double hsum2d(vh2d x) { return x[0] + x[1]; }
static inline double hsum4d(vh4d x) {
    vh2d a, b;
    memcpy(&a, &x, sizeof a);
    memcpy(&b, (char *)&x + sizeof a, sizeof b);
    return hsum2d(a + b);
}
static inline float vsum_f32(vf32 x) {
#if VBYTES == 64
    vh8f a, b;
    memcpy(&a, &x, sizeof a);
    memcpy(&b, (char *)&x + sizeof a, sizeof b);
    return hsum8f(a + b);
#else
    return hsum8f(x);
#endif
}
static inline double vsum_f64(vf64 x) {
#if VBYTES == 64
    vh4d a, b;
    memcpy(&a, &x, sizeof a);
    memcpy(&b, (char *)&x + sizeof a, sizeof b);
    return hsum4d(a + b);
#else
    return hsum4d(x);
#endif
}

static inline float bf16_load(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t bf16_store(float f) { /* round to nearest even; NaN stays NaN */
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

static inline void stream_fence(void) {
#if defined(__AVX__)
    _mm_sfence();
#endif
}

/* Outputs at least this large bypass the cache (settable, for tests). */
static int64_t stream_threshold = 8 << 20;
int64_t attnres_set_stream_threshold(int64_t bytes) {
    int64_t old = stream_threshold;
    stream_threshold = bytes;
    return old;
}

#define ID_LOAD(x) (x)
#define ID_STORE(x) (x)

typedef struct {
    const void *v, *q, *g, *lse;
    void *out, *lse_out, *dv, *dq;
    int64_t N, M, d, H, m0, m1, tile, nq; /* nq: the queries of the phase-1 states */
    int q_static, key_norm, stream;
    double eps;
    const void *w;   /* the read's output RMSNorm gain [d] (NULL: no output norm) */
    void *dw;        /* its gradient [d] */
    double norm_eps; /* the output RMSNorm's epsilon */
    void *scratch; /* per thread, see the workers */
} job_t;

typedef void *(*worker_t)(void *);

static int clamp_threads(int nthreads, int64_t M) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > M) nthreads = M > 0 ? (int)M : 1;
    return nthreads;
}

/* Tokens per tile of the two-pass workers, for N rows of `row_bytes` bytes per token: as many as
 * fit TILE_BYTES, at least 1, at most MAX_TILE. */
static int64_t tiling(int64_t N, int64_t row_bytes) {
    int64_t per_token = N * row_bytes;
    int64_t t = per_token > 0 ? TILE_BYTES / per_token : MAX_TILE;
    return t < 1 ? 1 : (t > MAX_TILE ? MAX_TILE : t);
}

/* Run `work` on nt contiguous token ranges; thread 0 is the caller. Returns the scratch block
 * (nt slots of `bytes`, one per thread) for the caller to read and free; NULL when out of memory. */
static char *launch(worker_t work, const job_t *proto, int nt, size_t bytes) {
    job_t *jobs = (job_t *)calloc((size_t)nt, sizeof(job_t));
    pthread_t *tid = (pthread_t *)calloc((size_t)nt, sizeof(pthread_t));
    char *scratch = (char *)calloc((size_t)nt, bytes);
    if (!jobs || !tid || !scratch) { free(jobs); free(tid); free(scratch); return NULL; }
    int64_t chunk = (proto->M + nt - 1) / nt;
    for (int t = 0; t < nt; ++t) {
        jobs[t] = *proto;
        jobs[t].m0 = t * chunk < proto->M ? t * chunk : proto->M;
        jobs[t].m1 = (t + 1) * chunk < proto->M ? (t + 1) * chunk : proto->M;
        jobs[t].scratch = scratch + (size_t)t * bytes;
    }
#if defined(_OPENMP)
    /* torch's own OpenMP pool (the loader shares the libgomp torch loaded): its workers are
     * already awake after the previous torch op, and do not compete with fresh threads. */
#pragma omp parallel num_threads(nt)
    {
        const int nth = omp_get_num_threads();
        for (int t = omp_get_thread_num(); t < nt; t += nth) work(&jobs[t]);
    }
#else
    int started = 0;
    for (int t = 1; t < nt; ++t) {
        if (pthread_create(&tid[t], NULL, work, &jobs[t]) != 0) break; /* the rest run inline */
        started = t;
    }
    work(&jobs[0]);
    for (int t = started + 1; t < nt; ++t) work(&jobs[t]);
    for (int t = 1; t <= started; ++t) pthread_join(tid[t], NULL);
#endif
    free(jobs); free(tid);
    return scratch;
}

#define DEFINE_KERNELS(SUF, T, ACC, LOAD, STORE, EXP, LOG, SQRT, V, VW, VLOAD, PUT, ALOAD, ASTORE, VSUM) \
/* *a = sum x^2, *b = sum x.q over n channels, prefetching the bytes at pf on (every caller passes  \
 * the row's own address plus PREFETCH_BYTES: in this form the loop measured ~10 % faster than    \
 * computing that address inside) */                                                              \
static inline void reduce2_##SUF(const T *restrict x, const ACC *restrict q, int64_t n, const char *pf, \
                                 ACC *a, ACC *b) {                                                \
    V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};             \
    int64_t c = 0;                                                                                \
    for (; c + 4 * VW <= n; c += 4 * VW) {                                                        \
        for (size_t o = 0; o < 4 * VW * sizeof(T); o += 64) __builtin_prefetch(pf + c * sizeof(T) + o, 0, 3); \
        const V x0 = VLOAD(x + c), x1 = VLOAD(x + c + VW), x2 = VLOAD(x + c + 2 * VW), x3 = VLOAD(x + c + 3 * VW); \
        a0 += x0 * x0; a1 += x1 * x1; a2 += x2 * x2; a3 += x3 * x3;                               \
        b0 += x0 * ALOAD(q + c); b1 += x1 * ALOAD(q + c + VW);                                    \
        b2 += x2 * ALOAD(q + c + 2 * VW); b3 += x3 * ALOAD(q + c + 3 * VW);                       \
    }                                                                                             \
    for (; c + VW <= n; c += VW) {                                                                \
        const V x0 = VLOAD(x + c);                                                                \
        a0 += x0 * x0; b0 += x0 * ALOAD(q + c);                                                   \
    }                                                                                             \
    ACC ra = VSUM((a0 + a1) + (a2 + a3)), rb = VSUM((b0 + b1) + (b2 + b3));                       \
    for (; c < n; ++c) { ACC xv = LOAD(x[c]); ra += xv * xv; rb += xv * q[c]; }                   \
    *a = ra; *b = rb;                                                                             \
}                                                                                                 \
                                                                                                  \
/* also *e = sum x.g */                                                                           \
static inline void reduce3_##SUF(const T *restrict x, const ACC *restrict q, const T *restrict g, \
                                 int64_t n, ACC *a, ACC *b, ACC *e) {                             \
    V a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0}, e0 = {0}, e1 = {0};                                 \
    int64_t c = 0;                                                                                \
    for (; c + 2 * VW <= n; c += 2 * VW) {                                                        \
        for (size_t o = 0; o < 2 * VW * sizeof(T); o += 64) __builtin_prefetch((const char *)(x + c) + PREFETCH_BYTES + o, 0, 3); \
        const V x0 = VLOAD(x + c), x1 = VLOAD(x + c + VW);                                        \
        a0 += x0 * x0; a1 += x1 * x1;                                                             \
        b0 += x0 * ALOAD(q + c); b1 += x1 * ALOAD(q + c + VW);                                    \
        e0 += x0 * VLOAD(g + c); e1 += x1 * VLOAD(g + c + VW);                                    \
    }                                                                                             \
    for (; c + VW <= n; c += VW) {                                                                \
        const V x0 = VLOAD(x + c);                                                                \
        a0 += x0 * x0; b0 += x0 * ALOAD(q + c); e0 += x0 * VLOAD(g + c);                          \
    }                                                                                             \
    ACC ra = VSUM(a0 + a1), rb = VSUM(b0 + b1), re = VSUM(e0 + e1);                               \
    for (; c < n; ++c) {                                                                          \
        ACC xv = LOAD(x[c]);                                                                      \
        ra += xv * xv; rb += xv * q[c]; re += xv * LOAD(g[c]);                                    \
    }                                                                                             \
    *a = ra; *b = rb; *e = re;                                                                    \
}                                                                                                 \
                                                                                                  \
/* The weighted sum of n sources x_i (rows at offset off), weights p[i * ps], over dh channels,   \
 * four vectors of channels at a time held in registers across all sources, times scale, into out  \
 * (accumulation type: the phase-1 states). */                                                    \
static inline void wsum_##SUF(const T *const *x, int64_t n, int64_t off, const ACC *p, int64_t ps, \
                              int64_t dh, ACC scale, ACC *out) {                                  \
    int64_t c = 0;                                                                                \
    for (; c + 4 * VW <= dh; c += 4 * VW) {                                                       \
        V s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                                 \
        for (int64_t i = 0; i < n; ++i) {                                                         \
            const T *xi = x[i] + off + c;                                                         \
            const ACC pi = p[i * ps];                                                             \
            s0 += pi * VLOAD(xi); s1 += pi * VLOAD(xi + VW);                                      \
            s2 += pi * VLOAD(xi + 2 * VW); s3 += pi * VLOAD(xi + 3 * VW);                         \
        }                                                                                         \
        ASTORE(out + c, s0 * scale); ASTORE(out + c + VW, s1 * scale);                            \
        ASTORE(out + c + 2 * VW, s2 * scale); ASTORE(out + c + 3 * VW, s3 * scale);               \
    }                                                                                             \
    for (; c + VW <= dh; c += VW) {                                                               \
        V s0 = {0};                                                                               \
        for (int64_t i = 0; i < n; ++i) s0 += p[i * ps] * VLOAD(x[i] + off + c);                  \
        ASTORE(out + c, s0 * scale);                                                              \
    }                                                                                             \
    for (; c < dh; ++c) {                                                                         \
        ACC s0 = 0;                                                                               \
        for (int64_t i = 0; i < n; ++i) s0 += p[i * ps] * LOAD(x[i][off + c]);                    \
        out[c] = s0 * scale;                                                                      \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
/* One step of the forward's pipeline, over n channels: the logit sums of the next row xn (from   \
 * memory), *ss = sum xn^2 and *qv = sum xn.q, while the row before it, xc (from cache), joins the \
 * accumulator, y = a y + b xc (y = b xc with `first`), or with to_out, out = (a y + b xc) s      \
 * (non-temporal with `stream`). Either row may be NULL: the pipeline's first and last steps.     \
 * Prefetches along xn's source, as reduce2. */                                                   \
static inline void fwd_step_##SUF(const T *restrict xn, const ACC *restrict q, ACC *ss, ACC *qv,  \
                                  const T *restrict xc, ACC *restrict y, int first, ACC a, ACC b,  \
                                  T *to_out, ACC s, int stream, int64_t n) {                      \
    V a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};                                                     \
    int64_t c = 0;                                                                                \
    for (; c + 2 * VW <= n; c += 2 * VW) {                                                        \
        if (xn) {                                                                                 \
            for (size_t o = 0; o < 2 * VW * sizeof(T); o += 64) __builtin_prefetch((const char *)(xn + c) + PREFETCH_BYTES + o, 0, 3); \
            const V x0 = VLOAD(xn + c), x1 = VLOAD(xn + c + VW);                                  \
            a0 += x0 * x0; a1 += x1 * x1;                                                         \
            b0 += x0 * ALOAD(q + c); b1 += x1 * ALOAD(q + c + VW);                                \
        }                                                                                         \
        if (xc) {                                                                                 \
            V y0 = b * VLOAD(xc + c), y1 = b * VLOAD(xc + c + VW);                                \
            if (!first) { y0 += a * ALOAD(y + c); y1 += a * ALOAD(y + c + VW); }                  \
            if (to_out) { PUT(to_out + c, y0 * s, stream); PUT(to_out + c + VW, y1 * s, stream); } \
            else { ASTORE(y + c, y0); ASTORE(y + c + VW, y1); }                                   \
        }                                                                                         \
    }                                                                                             \
    ACC ra = VSUM(a0 + a1), rb = VSUM(b0 + b1);                                                   \
    for (; c < n; ++c) {                                                                          \
        if (xn) { const ACC x = LOAD(xn[c]); ra += x * x; rb += x * q[c]; }                       \
        if (xc) {                                                                                 \
            const ACC r = b * LOAD(xc[c]) + (first ? (ACC)0 : a * y[c]);                          \
            if (to_out) to_out[c] = STORE(r * s); else y[c] = r;                                  \
        }                                                                                         \
    }                                                                                             \
    *ss = ra; *qv = rb;                                                                           \
}                                                                                                 \
                                                                                                  \
/* Forward, one pass with online softmax. A thread walks its tokens in tiles of j->tile tokens    \
 * whose accumulators fit FWD_ACC_BYTES; inside a tile it takes the sources in turn and each      \
 * source's rows in token order, so every source is read in one long contiguous run. The rows     \
 * ("units": one head's dh channels of one row) form a pipeline: while a unit's logit sums stream  \
 * in from memory, the unit before it, just read and still in L1, is added into its token's       \
 * accumulator with the weight its logit now gives: y = exp(m_old - m_new) y + exp(z - m_new) x,  \
 * the running max m and normaliser l updated as in FlashAttention. The last source's unit writes  \
 * the output, y / l, and the logsumexp m + log l. scratch: acc [tile, d] | max, sum [tile, H] */  \
static void *fwd_worker_##SUF(void *arg) {                                                        \
    job_t *j = (job_t *)arg;                                                                      \
    const T *const *v = (const T *const *)j->v;                                                   \
    const ACC *q = (const ACC *)j->q;                                                             \
    T *out = (T *)j->out;                                                                         \
    ACC *lse = (ACC *)j->lse_out;                                                                 \
    const int64_t N = j->N, d = j->d, H = j->H, dh = d / H, TT = j->tile;                         \
    const ACC eps = (ACC)j->eps, inv_dh = (ACC)1 / (ACC)dh;                                       \
    ACC *acc = (ACC *)j->scratch, *mx = acc + TT * d, *sm = mx + TT * H;                          \
    const T *xc = NULL; /* the unit waiting for its accumulation: source ci, token tile-row tc, head hc */ \
    int64_t ci = 0, tc = 0, hc = 0, mc = 0;                                                       \
    ACC zc = 0;                                                                                   \
    for (int64_t m0 = j->m0; m0 < j->m1 || xc; m0 += TT) {                                        \
        const int done = m0 >= j->m1; /* past the last tile: one step to drain the pipeline */    \
        const int64_t tn = done ? 1 : (m0 + TT <= j->m1 ? TT : j->m1 - m0);                       \
        for (int64_t i = 0; i < (done ? 1 : N); ++i) {                                            \
            for (int64_t t = 0; t < tn; ++t) {                                                    \
                for (int64_t h = 0; h < (done ? 1 : H); ++h) {                                    \
                    const T *xn = done ? NULL : v[i] + (m0 + t) * d + h * dh;                     \
                    const ACC *qn = done ? q : q + (j->q_static ? 0 : (m0 + t) * d) + h * dh;     \
                    ACC a = 1, b = 1, s = 1, ss = 0, qv = 0;                                      \
                    T *dst = NULL;                                                                \
                    if (xc) {                                                                     \
                        const int64_t k = tc * H + hc;                                            \
                        if (ci == 0) { mx[k] = zc; sm[k] = 1; }                                   \
                        else if (zc > mx[k]) { a = EXP(mx[k] - zc); sm[k] = sm[k] * a + 1; mx[k] = zc; } \
                        else { b = EXP(zc - mx[k]); sm[k] += b; }                                 \
                        if (ci == N - 1) {                                                        \
                            dst = out + mc * d + hc * dh;                                         \
                            s = (ACC)1 / sm[k];                                                   \
                            lse[mc * H + hc] = mx[k] + LOG(sm[k]);                                \
                        }                                                                         \
                    }                                                                             \
                    fwd_step_##SUF(xn, qn, &ss, &qv, xc, acc + tc * d + hc * dh, ci == 0, a, b, dst, s, j->stream, dh); \
                    xc = xn; ci = i; tc = t; hc = h; mc = m0 + t;                                 \
                    zc = qv * (j->key_norm ? (ACC)1 / SQRT(ss * inv_dh + eps) : (ACC)1);          \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    stream_fence();                                                                               \
    return NULL;                                                                                  \
}                                                                                                 \
                                                                                                  \
/* Backward. scratch: dq partial [d] | r, z, alpha, s [N, tile, H] each | delta [tile, H] */      \
static void *bwd_worker_##SUF(void *arg) {                                                        \
    job_t *j = (job_t *)arg;                                                                      \
    const T *const *v = (const T *const *)j->v;                                                   \
    const T *g = (const T *)j->g;                                                                 \
    const ACC *q = (const ACC *)j->q;                                                             \
    const ACC *lse = (const ACC *)j->lse;                                                         \
    T *const *dv = (T *const *)j->dv;                                                             \
    const int64_t N = j->N, d = j->d, H = j->H, dh = d / H;                                       \
    const int64_t TT = j->tile, S = N * TT * H;                                                   \
    const ACC eps = (ACC)j->eps, inv_dh = (ACC)1 / (ACC)dh;                                       \
    ACC *dqp = (ACC *)j->scratch;                                                                 \
    ACC *sr = dqp + d, *sz = sr + S, *sa = sz + S, *sg = sa + S, *sd = sg + S;                    \
    ACC *dq = j->dq ? (j->q_static ? dqp : (ACC *)j->dq) : NULL;                                  \
    for (int64_t m0 = j->m0; m0 < j->m1; m0 += TT) {                                              \
        const int64_t tn = m0 + TT <= j->m1 ? TT : j->m1 - m0;                                    \
        for (int64_t k = 0; k < tn * H; ++k) sd[k] = 0;                                           \
        /* pass 1: per-source scalars and delta = sum_i alpha_i (g . v_i) */                      \
        for (int64_t i = 0; i < N; ++i) {                                                         \
            for (int64_t t = 0; t < tn; ++t) {                                                    \
                const int64_t m = m0 + t;                                                         \
                const T *x = v[i] + m * d;                                                        \
                const T *gt = g + m * d;                                                          \
                const ACC *qt = q + (j->q_static ? 0 : m * d);                                    \
                for (int64_t h = 0; h < H; ++h) {                                                 \
                    const int64_t k = (i * TT + t) * H + h;                                       \
                    ACC ss, qv, gv;                                                               \
                    reduce3_##SUF(x + h * dh, qt + h * dh, gt + h * dh, dh, &ss, &qv, &gv);       \
                    ACC r = j->key_norm ? (ACC)1 / SQRT(ss * inv_dh + eps) : (ACC)1;              \
                    ACC z = qv * r, al = EXP(z - lse[m * H + h]);                                 \
                    sr[k] = r; sz[k] = z; sa[k] = al; sg[k] = gv;                                 \
                    sd[t * H + h] += al * gv;                                                     \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        /* the coefficients of pass 2, in place: sr <- a_i = dz_i r_i, sz <- b_i (see the top) */ \
        for (int64_t i = 0; i < N; ++i) {                                                         \
            for (int64_t t = 0; t < tn; ++t) {                                                    \
                for (int64_t h = 0; h < H; ++h) {                                                 \
                    const int64_t k = (i * TT + t) * H + h;                                       \
                    const ACC dz = sa[k] * (sg[k] - sd[t * H + h]), r = sr[k];                    \
                    sr[k] = dz * r;                                                               \
                    sz[k] = j->key_norm ? -dz * sz[k] * r * r * inv_dh : (ACC)0;                  \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        /* pass 2: dv_i = alpha_i g + a_i q + b_i v_i and dq += a_i v_i, two vectors of channels at a \
         * time: g, q and the dq sum stay in registers across the N sources (rows from cache) */  \
        for (int64_t t = 0; t < tn; ++t) {                                                        \
            const int64_t m = m0 + t;                                                             \
            for (int64_t h = 0; h < H; ++h) {                                                     \
                const int64_t o = m * d + h * dh, k0 = t * H + h, ks = TT * H; /* source i: k0 + i ks */ \
                const T *restrict gh = g + o;                                                     \
                const ACC *restrict qh = q + (j->q_static ? h * dh : o);                          \
                ACC *restrict dqh = dq ? dq + (j->q_static ? h * dh : o) : NULL;                  \
                int64_t c = 0;                                                                    \
                for (; c + 2 * VW <= dh; c += 2 * VW) {                                           \
                    const V g0 = VLOAD(gh + c), g1 = VLOAD(gh + c + VW);                          \
                    const V q0 = ALOAD(qh + c), q1 = ALOAD(qh + c + VW);                          \
                    V e0 = {0}, e1 = {0};                                                         \
                    for (int64_t i = 0; i < N; ++i) {                                             \
                        const ACC al = sa[k0 + i * ks], ca = sr[k0 + i * ks], cb = sz[k0 + i * ks]; \
                        const V x0 = VLOAD(v[i] + o + c), x1 = VLOAD(v[i] + o + c + VW);          \
                        if (dv) {                                                                 \
                            PUT(dv[i] + o + c, al * g0 + ca * q0 + cb * x0, j->stream);           \
                            PUT(dv[i] + o + c + VW, al * g1 + ca * q1 + cb * x1, j->stream);      \
                        }                                                                         \
                        e0 += ca * x0; e1 += ca * x1;                                             \
                    }                                                                             \
                    if (dqh) { ASTORE(dqh + c, ALOAD(dqh + c) + e0); ASTORE(dqh + c + VW, ALOAD(dqh + c + VW) + e1); } \
                }                                                                                 \
                for (; c + VW <= dh; c += VW) {                                                   \
                    const V g0 = VLOAD(gh + c), q0 = ALOAD(qh + c);                               \
                    V e0 = {0};                                                                   \
                    for (int64_t i = 0; i < N; ++i) {                                             \
                        const ACC al = sa[k0 + i * ks], ca = sr[k0 + i * ks], cb = sz[k0 + i * ks]; \
                        const V x0 = VLOAD(v[i] + o + c);                                         \
                        if (dv) PUT(dv[i] + o + c, al * g0 + ca * q0 + cb * x0, j->stream);       \
                        e0 += ca * x0;                                                            \
                    }                                                                             \
                    if (dqh) ASTORE(dqh + c, ALOAD(dqh + c) + e0);                                \
                }                                                                                 \
                for (; c < dh; ++c) {                                                             \
                    const ACC gc = LOAD(gh[c]), qc = qh[c];                                       \
                    ACC e0 = 0;                                                                   \
                    for (int64_t i = 0; i < N; ++i) {                                             \
                        const ACC al = sa[k0 + i * ks], ca = sr[k0 + i * ks], cb = sz[k0 + i * ks]; \
                        const ACC xc = LOAD(v[i][o + c]);                                         \
                        if (dv) dv[i][o + c] = STORE(al * gc + ca * qc + cb * xc);                \
                        e0 += ca * xc;                                                            \
                    }                                                                             \
                    if (dqh) dqh[c] += e0;                                                        \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    stream_fence();                                                                               \
    return NULL;                                                                                  \
}                                                                                                 \
                                                                                                  \
int attnres_fwd_##SUF(const void *const *v, const void *q, void *out, void *lse, int64_t N, int64_t M, \
                      int64_t d, int64_t H, int q_static, double eps, int key_norm, int nthreads) { \
    job_t p;                                                                                      \
    memset(&p, 0, sizeof p);                                                                      \
    p.v = v; p.q = q; p.out = out; p.lse_out = lse;                                               \
    p.N = N; p.M = M; p.d = d; p.H = H; p.q_static = q_static; p.key_norm = key_norm; p.eps = eps; \
    if (M <= 0) return 0;                                                                         \
    p.tile = FWD_ACC_BYTES / ((int64_t)sizeof(ACC) * d);                                          \
    if (p.tile < 1) p.tile = 1;                                                                   \
    size_t bytes = sizeof(ACC) * (size_t)(p.tile * (d + 2 * H)) + 64;                             \
    bytes = (bytes + 63) & ~(size_t)63; /* slots stay aligned, no false sharing */                \
    p.stream = (int64_t)sizeof(T) * M * d >= stream_threshold;                                    \
    char *scratch = launch(fwd_worker_##SUF, &p, clamp_threads(nthreads, M), bytes);              \
    if (!scratch) return -1;                                                                      \
    free(scratch);                                                                                \
    return 0;                                                                                     \
}                                                                                                 \
                                                                                                  \
/* dq (may be NULL): [d] if q_static else [M, d], accumulation type, overwritten. */              \
int attnres_bwd_##SUF(const void *const *v, const void *q, const void *lse, const void *g,        \
                      void *const *dv, void *dq, int64_t N, int64_t M, int64_t d, int64_t H,      \
                      int q_static, double eps, int key_norm, int nthreads) {                     \
    job_t p;                                                                                      \
    memset(&p, 0, sizeof p);                                                                      \
    p.v = v; p.q = q; p.lse = lse; p.g = g; p.dv = (void *)dv; p.dq = dq;                         \
    p.N = N; p.M = M; p.d = d; p.H = H; p.q_static = q_static; p.key_norm = key_norm; p.eps = eps; \
    if (dq) memset(dq, 0, sizeof(ACC) * (size_t)(q_static ? d : M * d));                          \
    if (M <= 0) return 0;                                                                         \
    p.tile = tiling(N + 1, (int64_t)sizeof(T) * d); /* + 1: the rows of g */                      \
    size_t bytes = sizeof(ACC) * (size_t)(d + (4 * N + 1) * p.tile * H) + 64;                     \
    bytes = (bytes + 63) & ~(size_t)63;                                                           \
    p.stream = (int64_t)sizeof(T) * N * M * d >= stream_threshold;                                \
    int nt = clamp_threads(nthreads, M);                                                          \
    char *scratch = launch(bwd_worker_##SUF, &p, nt, bytes);                                      \
    if (!scratch) return -1;                                                                      \
    if (dq && q_static) {                                                                         \
        ACC *dqo = (ACC *)dq;                                                                     \
        for (int t = 0; t < nt; ++t) {                                                            \
            const ACC *part = (const ACC *)(scratch + (size_t)t * bytes);                         \
            for (int64_t c = 0; c < d; ++c) dqo[c] += part[c];                                    \
        }                                                                                         \
    }                                                                                             \
    free(scratch);                                                                                \
    return 0;                                                                                     \
}

DEFINE_KERNELS(f32, float, float, ID_LOAD, ID_STORE, expf, logf, sqrtf,
               vf32, VW_f32, vload_f32, put_f32, vload_f32, vstore_f32, vsum_f32)
DEFINE_KERNELS(f64, double, double, ID_LOAD, ID_STORE, exp, log, sqrt,
               vf64, VW_f64, vload_f64, put_f64, vload_f64, vstore_f64, vsum_f64)
DEFINE_KERNELS(bf16, uint16_t, float, bf16_load, bf16_store, expf, logf, sqrtf,
               vf32, VW_f32, vload_bf16, put_bf16, vload_f32, vstore_f32, vsum_f32)

/* Two-phase inference (forward only).
 *
 * Phase 1, attnres_states: Q static queries qs [Q, d] over the same sources v [N, M, d] in one read
 * of them; per query the softmax state as (lse [Q, M, H], out [Q, M, d]) -- a state with
 * max = lse and sum = 1 -- in the accumulation type.
 * Phase 2, attnres_merge: the state of one query, (st_max, st_sum) [M, H] and st_out [M, d],
 * merged with R more sources v [R, M, d] by online softmax; writes the output [M, d] in v's type.
 */
#define DEFINE_TWO_PHASE(SUF, T, ACC, LOAD, STORE, EXP, LOG, SQRT, V, VW, VLOAD, ALOAD, VSUM)     \
static inline ACC dot_##SUF(const T *restrict x, const ACC *restrict q, int64_t n) {              \
    V b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};                                                     \
    int64_t c = 0;                                                                                \
    for (; c + 4 * VW <= n; c += 4 * VW) {                                                        \
        b0 += VLOAD(x + c) * ALOAD(q + c); b1 += VLOAD(x + c + VW) * ALOAD(q + c + VW);           \
        b2 += VLOAD(x + c + 2 * VW) * ALOAD(q + c + 2 * VW); b3 += VLOAD(x + c + 3 * VW) * ALOAD(q + c + 3 * VW); \
    }                                                                                             \
    for (; c + VW <= n; c += VW) b0 += VLOAD(x + c) * ALOAD(q + c);                               \
    ACC rb = VSUM((b0 + b1) + (b2 + b3));                                                         \
    for (; c < n; ++c) rb += LOAD(x[c]) * q[c];                                                   \
    return rb;                                                                                    \
}                                                                                                 \
                                                                                                  \
/* scratch: z, then p, [Q, N, tile, H] */                                                         \
static void *states_worker_##SUF(void *arg) {                                                     \
    job_t *j = (job_t *)arg;                                                                      \
    const T *const *v = (const T *const *)j->v;                                                   \
    const ACC *qs = (const ACC *)j->q;                                                            \
    ACC *out = (ACC *)j->out, *lse = (ACC *)j->lse_out;                                           \
    const int64_t N = j->N, M = j->M, d = j->d, H = j->H, dh = d / H;                             \
    const int64_t TT = j->tile, Q = j->nq;                                                        \
    const ACC eps = (ACC)j->eps, inv_dh = (ACC)1 / (ACC)dh;                                       \
    ACC *zs = (ACC *)j->scratch;                                                                  \
    for (int64_t m0 = j->m0; m0 < j->m1; m0 += TT) {                                              \
        const int64_t tn = m0 + TT <= j->m1 ? TT : j->m1 - m0;                                    \
        for (int64_t i = 0; i < N; ++i) {       /* pass 1: Q logits per row, one read */          \
            for (int64_t t = 0; t < tn; ++t) {                                                    \
                const T *x = v[i] + (m0 + t) * d;                                                 \
                for (int64_t h = 0; h < H; ++h) {                                                 \
                    ACC ss, qv;                                                                   \
                    reduce2_##SUF(x + h * dh, qs + h * dh, dh, (const char *)(x + h * dh) + PREFETCH_BYTES, &ss, &qv); \
                    ACC r = j->key_norm ? (ACC)1 / SQRT(ss * inv_dh + eps) : (ACC)1;              \
                    zs[((0 * N + i) * TT + t) * H + h] = qv * r;                                  \
                    for (int64_t k = 1; k < Q; ++k)                                               \
                        zs[((k * N + i) * TT + t) * H + h] = r * dot_##SUF(x + h * dh, qs + k * d + h * dh, dh); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t k = 0; k < Q; ++k) {                                                         \
            for (int64_t t = 0; t < tn; ++t) {                                                    \
                for (int64_t h = 0; h < H; ++h) {                                                 \
                    ACC mx = -INFINITY, l = 0;                                                    \
                    for (int64_t i = 0; i < N; ++i) {                                             \
                        ACC z = zs[((k * N + i) * TT + t) * H + h];                               \
                        mx = z > mx ? z : mx;                                                     \
                    }                                                                             \
                    for (int64_t i = 0; i < N; ++i) {                                             \
                        ACC *z = &zs[((k * N + i) * TT + t) * H + h];                             \
                        *z = EXP(*z - mx);                                                        \
                        l += *z;                                                                  \
                    }                                                                             \
                    const ACC inv = (ACC)1 / l;                                                   \
                    lse[(k * M + m0 + t) * H + h] = mx + LOG(l);                                  \
                    const int64_t off = (m0 + t) * d + h * dh;                                    \
                    wsum_##SUF(v, N, off, zs + (k * N * TT + t) * H + h, TT * H, dh, inv, out + (k * M + m0 + t) * d + h * dh); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    return NULL;                                                                                  \
}                                                                                                 \
                                                                                                  \
int attnres_states_##SUF(const void *const *v, const void *qs, void *lse, void *out, int64_t Q, int64_t N, \
                         int64_t M, int64_t d, int64_t H, double eps, int key_norm, int nthreads) { \
    job_t p;                                                                                      \
    memset(&p, 0, sizeof p);                                                                      \
    p.v = v; p.q = qs; p.out = out; p.lse_out = lse;                                              \
    p.N = N; p.M = M; p.d = d; p.H = H; p.key_norm = key_norm; p.eps = eps; p.nq = Q;             \
    if (M <= 0 || Q <= 0) return 0;                                                               \
    p.tile = tiling(N, (int64_t)sizeof(T) * d);                                                   \
    size_t bytes = sizeof(ACC) * (size_t)(Q * N * p.tile * H);                                    \
    bytes = (bytes + 63) & ~(size_t)63;                                                           \
    char *scratch = launch(states_worker_##SUF, &p, clamp_threads(nthreads, M), bytes);           \
    if (!scratch) return -1;                                                                      \
    free(scratch);                                                                                \
    return 0;                                                                                     \
}                                                                                                 \
                                                                                                  \
/* scratch: z, then p, [R] */                                                                     \
static void *merge_worker_##SUF(void *arg) {                                                      \
    job_t *j = (job_t *)arg;                                                                      \
    const T *const *v = (const T *const *)j->v;                                                   \
    const ACC *q = (const ACC *)j->q;                                                             \
    const ACC *st_max = (const ACC *)j->lse, *st_sum = (const ACC *)j->g, *st_out = (const ACC *)j->dq; \
    T *out = (T *)j->out;                                                                         \
    const int64_t R = j->N, d = j->d, H = j->H, dh = d / H;                                       \
    const ACC eps = (ACC)j->eps, inv_dh = (ACC)1 / (ACC)dh;                                       \
    ACC *zs = (ACC *)j->scratch;                                                                  \
    for (int64_t m = j->m0; m < j->m1; ++m) {                                                     \
        for (int64_t h = 0; h < H; ++h) {                                                         \
            const int64_t o = m * d + h * dh;                                                     \
            ACC mx = st_max[m * H + h];                                                           \
            for (int64_t r = 0; r < R; ++r) {                                                     \
                ACC ss, qv;                                                                       \
                reduce2_##SUF(v[r] + o, q + h * dh, dh, (const char *)(v[r] + o) + PREFETCH_BYTES, &ss, &qv); \
                ACC rr = j->key_norm ? (ACC)1 / SQRT(ss * inv_dh + eps) : (ACC)1;                 \
                zs[r] = qv * rr;                                                                  \
                mx = zs[r] > mx ? zs[r] : mx;                                                     \
            }                                                                                     \
            ACC w0 = st_sum[m * H + h] * EXP(st_max[m * H + h] - mx), l = w0;                     \
            for (int64_t r = 0; r < R; ++r) { zs[r] = EXP(zs[r] - mx); l += zs[r]; }              \
            const ACC inv = (ACC)1 / l, a0 = w0 * inv;                                            \
            const ACC *restrict so = st_out + o;                                                  \
            T *restrict dst = out + o;                                                            \
            if (R == 1) {                                                                         \
                const T *restrict x0 = v[0] + o;                                                  \
                const ACC p0 = zs[0] * inv;                                                       \
                _Pragma("omp simd")                                                               \
                for (int64_t c = 0; c < dh; ++c) dst[c] = STORE(a0 * so[c] + p0 * LOAD(x0[c]));   \
            } else {                                                                              \
                ACC *restrict acc = zs + R;                                                       \
                _Pragma("omp simd")                                                               \
                for (int64_t c = 0; c < dh; ++c) acc[c] = a0 * so[c];                             \
                for (int64_t r = 0; r < R; ++r) {                                                 \
                    const T *restrict x0 = v[r] + o;                                              \
                    const ACC p0 = zs[r] * inv;                                                   \
                    _Pragma("omp simd")                                                           \
                    for (int64_t c = 0; c < dh; ++c) acc[c] += p0 * LOAD(x0[c]);                  \
                }                                                                                 \
                _Pragma("omp simd")                                                               \
                for (int64_t c = 0; c < dh; ++c) dst[c] = STORE(acc[c]);                          \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    return NULL;                                                                                  \
}                                                                                                 \
                                                                                                  \
int attnres_merge_##SUF(const void *const *v, const void *q, const void *st_max, const void *st_sum, \
                        const void *st_out, void *out, int64_t R, int64_t M, int64_t d, int64_t H, \
                        double eps, int key_norm, int nthreads) {                                 \
    job_t p;                                                                                      \
    memset(&p, 0, sizeof p);                                                                      \
    p.v = v; p.q = q; p.lse = st_max; p.g = st_sum; p.dq = (void *)st_out; p.out = out;           \
    p.N = R; p.M = M; p.d = d; p.H = H; p.key_norm = key_norm; p.eps = eps;                       \
    if (M <= 0) return 0;                                                                         \
    size_t bytes = sizeof(ACC) * (size_t)(R + d) + 64;                                            \
    bytes = (bytes + 63) & ~(size_t)63;                                                           \
    char *scratch = launch(merge_worker_##SUF, &p, clamp_threads(nthreads, M), bytes);            \
    if (!scratch) return -1;                                                                      \
    free(scratch);                                                                                \
    return 0;                                                                                     \
}

DEFINE_TWO_PHASE(f32, float, float, ID_LOAD, ID_STORE, expf, logf, sqrtf, vf32, VW_f32, vload_f32, vload_f32, vsum_f32)
DEFINE_TWO_PHASE(f64, double, double, ID_LOAD, ID_STORE, exp, log, sqrt, vf64, VW_f64, vload_f64, vload_f64, vsum_f64)
DEFINE_TWO_PHASE(bf16, uint16_t, float, bf16_load, bf16_store, expf, logf, sqrtf, vf32, VW_f32, vload_bf16, vload_f32, vsum_f32)

/* Tokens per tile of the read kernels' per-token scalars: a vector of float32 lanes with AVX-512. */
#ifndef RT
#define RT 16
#endif
/* exp of one float for the read kernels' softmax, whose arguments are <= 0 (a logit minus the
 * maximum, or minus lse): Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, then Cephes' degree-5
 * polynomial (about 1 ulp); 0 below -87.3, where expf underflows too. Plain arithmetic, so a loop
 * over the N H logits of a token compiles to vector instructions, where a call to expf per logit
 * was one of the two scalar latency chains that dominated the kernel at small d (the key scale's
 * sqrt and divide the other; `perf annotate`, d 64). exp(0) is exactly 1. float64 keeps libm's exp. */
static inline float exp_lane_f32(float x) {
    const int under = x < -87.3365f;
    x = x < -87.3365f ? -87.3365f : (x > 88.0f ? 88.0f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return under ? 0.0f : p * scale;
}

/* The fused read of a sublayer: depth attention followed by the sublayer's own RMSNorm,
 *
 *   out = sum_i alpha_i v_i   (as above),   y = out * rs * w,   rs = 1 / sqrt(mean_c out_c^2 + norm_eps)
 *
 * over the whole d (w NULL: y = out). Small d is where the per-call cost shows, so these kernels
 * go token by token: all N rows of a token (N d elements: a few KiB) stay in L1 between the
 * logits and the weighted sum, and the per-token scalars live in a few registers' worth of
 * scratch. `out` is never rounded to the sources' type before the norm. Saved for backward: only
 * lse [M, H]; the backward recomputes alpha_i and out in its first pass, applies the RMSNorm's
 * backward, g = rs (w gy) - rs^3 / d (sum_c w_c gy_c out_c) out, then the depth attention's (top of
 * the file) in a second pass, delta = sum_i alpha_i (g . v_i) as there (with one source, dz is
 * then exactly 0, as it must be: g . out summed in another order is not). dw = sum over tokens of gy out rs, reduced per
 * thread and summed in thread order, as the static dq. */
#define DEFINE_READ(SUF, T, ACC, LOAD, STORE, SQRT, EXP, LOG, V, VW, VLOAD, PUT, ALOAD, ASTORE, VSUM) \
static inline ACC sumsq_##SUF(const ACC *restrict x, int64_t n) {                                 \
    V a0 = {0}, a1 = {0};                                                                         \
    int64_t c = 0;                                                                                \
    for (; c + 2 * VW <= n; c += 2 * VW) {                                                        \
        const V x0 = ALOAD(x + c), x1 = ALOAD(x + c + VW);                                        \
        a0 += x0 * x0; a1 += x1 * x1;                                                             \
    }                                                                                             \
    ACC r = VSUM(a0 + a1);                                                                        \
    for (; c < n; ++c) r += x[c] * x[c];                                                          \
    return r;                                                                                     \
}                                                                                                 \
                                                                                                  \
/* The per-token scalars of RT tokens at once: lane t of row k = i H + h is token m0 + t's logit  \
 * (z), key scale (r) or weight; lanes past nt hold z 0, r 1. The reductions run token by token, \
 * everything after them in loops over the RT lanes: sqrt, divide and exp as vector instructions \
 * (a token's own N H logits are too few to fill a vector). */                                  \
static inline void read_logits_##SUF(const job_t *j, int64_t m0, int64_t nt, ACC *restrict z, ACC *restrict r) { \
    const T *const *v = (const T *const *)j->v;                                                   \
    const int64_t N = j->N, d = j->d, H = j->H, dh = d / H, NH = N * H;                           \
    const ACC eps = (ACC)j->eps, inv_dh = (ACC)1 / (ACC)dh;                                       \
    for (int64_t t = 0; t < nt; ++t) {                                                            \
        const int64_t m = m0 + t;                                                                 \
        const ACC *qt = (const ACC *)j->q + (j->q_static ? 0 : m * d);                            \
        for (int64_t i = 0; i < N; ++i) {                                                         \
            const T *x = v[i] + m * d;                                                            \
            for (int64_t h = 0; h < H; ++h) {                                                     \
                ACC ss, qv;                                                                       \
                reduce2_##SUF(x + h * dh, qt + h * dh, dh, (const char *)(x + h * dh) + PREFETCH_BYTES, &ss, &qv); \
                z[(i * H + h) * RT + t] = qv;                                                     \
                r[(i * H + h) * RT + t] = ss * inv_dh + eps;                                      \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    for (int64_t k = 0; k < NH; ++k)                                                              \
        for (int64_t t = nt; t < RT; ++t) { z[k * RT + t] = 0; r[k * RT + t] = 1; }               \
    for (int64_t k = 0; k < NH; ++k) {                                                            \
        ACC *restrict zk = z + k * RT, *restrict rk = r + k * RT;                                 \
        if (j->key_norm) {                                                                        \
            _Pragma("omp simd")                                                                   \
            for (int64_t t = 0; t < RT; ++t) { rk[t] = (ACC)1 / SQRT(rk[t]); zk[t] *= rk[t]; }    \
        } else {                                                                                  \
            for (int64_t t = 0; t < RT; ++t) rk[t] = 1;                                           \
        }                                                                                         \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
/* a [N H, RT] <- exp(z - c), c [H, RT]: one constant per head and lane (a may be z) */          \
static inline void read_exp_##SUF(const ACC *z, const ACC *restrict c, ACC *a, int64_t N, int64_t H) { \
    for (int64_t i = 0; i < N; ++i)                                                               \
        for (int64_t h = 0; h < H; ++h) {                                                         \
            const ACC *zk = z + (i * H + h) * RT, *restrict ch = c + h * RT;                      \
            ACC *ak = a + (i * H + h) * RT;                                                       \
            _Pragma("omp simd")                                                                   \
            for (int64_t t = 0; t < RT; ++t) ak[t] = EXP(zk[t] - ch[t]);                          \
        }                                                                                         \
}                                                                                                 \
                                                                                                  \
/* scratch: z, r [N H, RT] | mx, l [H, RT] | out [d] */                                           \
static void *read_fwd_worker_##SUF(void *arg) {                                                   \
    job_t *j = (job_t *)arg;                                                                      \
    const T *const *v = (const T *const *)j->v;                                                   \
    const ACC *w = (const ACC *)j->w;                                                             \
    T *y = (T *)j->out;                                                                           \
    ACC *lse = (ACC *)j->lse_out;                                                                 \
    const int64_t N = j->N, d = j->d, H = j->H, dh = d / H;                                       \
    ACC *z = (ACC *)j->scratch, *rk = z + N * H * RT, *mx = rk + N * H * RT, *l = mx + H * RT;    \
    ACC *acc = l + H * RT;                                                                        \
    for (int64_t m0 = j->m0; m0 < j->m1; m0 += RT) {                                              \
        const int64_t nt = j->m1 - m0 < RT ? j->m1 - m0 : RT;                                     \
        read_logits_##SUF(j, m0, nt, z, rk);                                                      \
        for (int64_t h = 0; h < H; ++h) {                                                         \
            ACC *restrict mh = mx + h * RT;                                                       \
            for (int64_t t = 0; t < RT; ++t) mh[t] = z[h * RT + t];                               \
            for (int64_t i = 1; i < N; ++i) {                                                     \
                const ACC *restrict zi = z + (i * H + h) * RT;                                    \
                _Pragma("omp simd")                                                               \
                for (int64_t t = 0; t < RT; ++t) mh[t] = zi[t] > mh[t] ? zi[t] : mh[t];           \
            }                                                                                     \
        }                                                                                         \
        read_exp_##SUF(z, mx, z, N, H);                                                           \
        for (int64_t h = 0; h < H; ++h) {                                                         \
            ACC *restrict lh = l + h * RT;                                                        \
            for (int64_t t = 0; t < RT; ++t) lh[t] = 0;                                           \
            for (int64_t i = 0; i < N; ++i) {                                                     \
                const ACC *restrict zi = z + (i * H + h) * RT;                                    \
                _Pragma("omp simd")                                                               \
                for (int64_t t = 0; t < RT; ++t) lh[t] += zi[t];                                  \
            }                                                                                     \
        }                                                                                         \
        for (int64_t t = 0; t < nt; ++t) {                                                        \
            const int64_t m = m0 + t;                                                             \
            for (int64_t h = 0; h < H; ++h) {                                                     \
                const ACC lt = l[h * RT + t];                                                     \
                lse[m * H + h] = mx[h * RT + t] + LOG(lt);                                        \
                wsum_##SUF(v, N, m * d + h * dh, z + h * RT + t, H * RT, dh, (ACC)1 / lt, acc + h * dh); \
            }                                                                                     \
            const ACC rs = w ? (ACC)1 / SQRT(sumsq_##SUF(acc, d) / (ACC)d + (ACC)j->norm_eps) : (ACC)1; \
            T *dst = y + m * d;                                                                   \
            int64_t c = 0;                                                                        \
            for (; c + VW <= d; c += VW) {                                                        \
                const V o = ALOAD(acc + c) * rs;                                                  \
                PUT(dst + c, w ? o * ALOAD(w + c) : o, 0);                                        \
            }                                                                                     \
            for (; c < d; ++c) dst[c] = STORE(acc[c] * rs * (w ? w[c] : (ACC)1));                 \
        }                                                                                         \
    }                                                                                             \
    return NULL;                                                                                  \
}                                                                                                 \
                                                                                                  \
/* scratch: dq partial [d] | dw partial [d] | out [d] | g [d] | r, z, alpha [N H, RT] | lse [H, RT] | g.v [N H] */ \
static void *read_bwd_worker_##SUF(void *arg) {                                                   \
    job_t *j = (job_t *)arg;                                                                      \
    const T *const *v = (const T *const *)j->v;                                                   \
    const T *gy = (const T *)j->g;                                                                \
    const ACC *q = (const ACC *)j->q, *w = (const ACC *)j->w, *lse = (const ACC *)j->lse;         \
    T *const *dv = (T *const *)j->dv;                                                             \
    const int64_t N = j->N, d = j->d, H = j->H, dh = d / H, NR = N * H * RT;                      \
    const ACC inv_dh = (ACC)1 / (ACC)dh;                                                          \
    ACC *dqp = (ACC *)j->scratch, *dwp = dqp + d, *acc = dwp + d, *g = acc + d;                   \
    ACC *r = g + d, *z = r + NR, *al = z + NR, *lc = al + NR, *sg = lc + H * RT;                  \
    for (int64_t m0 = j->m0; m0 < j->m1; m0 += RT) {                                              \
        const int64_t nt = j->m1 - m0 < RT ? j->m1 - m0 : RT;                                     \
        /* pass 1, for the tile: alpha_i from the saved lse */                                    \
        read_logits_##SUF(j, m0, nt, z, r);                                                       \
        for (int64_t h = 0; h < H; ++h)                                                           \
            for (int64_t t = 0; t < RT; ++t) lc[h * RT + t] = t < nt ? lse[(m0 + t) * H + h] : 0; \
        read_exp_##SUF(z, lc, al, N, H);                                                          \
        for (int64_t t = 0; t < nt; ++t) {                                                        \
        const int64_t m = m0 + t;                                                                 \
        const T *gm = gy + m * d;                                                                 \
        const ACC *qt = q + (j->q_static ? 0 : m * d);                                            \
        ACC *dqt = j->dq ? (j->q_static ? dqp : (ACC *)j->dq + m * d) : NULL;                     \
        /* out = sum_i alpha_i v_i */                                                             \
        for (int64_t h = 0; h < H; ++h)                                                           \
            wsum_##SUF(v, N, m * d + h * dh, al + h * RT + t, H * RT, dh, (ACC)1, acc + h * dh);  \
        /* the output RMSNorm's backward: g = dL/dout */                                          \
        if (w) {                                                                                  \
            const ACC rs = (ACC)1 / SQRT(sumsq_##SUF(acc, d) / (ACC)d + (ACC)j->norm_eps);        \
            ACC dot = 0;                                                                          \
            for (int64_t c = 0; c < d; ++c) {                                                     \
                const ACC gc = LOAD(gm[c]);                                                       \
                g[c] = gc * w[c];                                                                 \
                dot += g[c] * acc[c];                                                             \
                if (j->dw) dwp[c] += gc * acc[c] * rs;                                            \
            }                                                                                     \
            const ACC k = rs * rs * rs * dot / (ACC)d;                                            \
            for (int64_t c = 0; c < d; ++c) g[c] = rs * g[c] - k * acc[c];                        \
        } else {                                                                                  \
            for (int64_t c = 0; c < d; ++c) g[c] = LOAD(gm[c]);                                   \
        }                                                                                         \
        /* pass 2, per head: s_i = g . v_i, dz_i = alpha_i (s_i - delta), dv_i and dq (rows from L1) */ \
        for (int64_t h = 0; h < H; ++h) {                                                         \
            const int64_t o = m * d + h * dh;                                                     \
            const ACC *restrict gh = g + h * dh, *restrict qh = qt + h * dh;                      \
            ACC delta = 0;                                                                        \
            for (int64_t i = 0; i < N; ++i) {                                                     \
                sg[i * H + h] = dot_##SUF(v[i] + o, gh, dh);                                      \
                delta += al[(i * H + h) * RT + t] * sg[i * H + h];                                \
            }                                                                                     \
            for (int64_t i = 0; i < N; ++i) {                                                     \
                const int64_t k = i * H + h, kt = k * RT + t;                                     \
                const T *restrict x = v[i] + o;                                                   \
                const ACC ak = al[kt], dz = ak * (sg[k] - delta), a = dz * r[kt];                 \
                const ACC b = j->key_norm ? -dz * z[kt] * r[kt] * r[kt] * inv_dh : (ACC)0;        \
                int64_t c = 0;                                                                    \
                if (dv) {                                                                         \
                    T *restrict dst = dv[i] + o;                                                  \
                    for (; c + VW <= dh; c += VW)                                                 \
                        PUT(dst + c, ak * ALOAD(gh + c) + a * ALOAD(qh + c) + b * VLOAD(x + c), 0); \
                    for (; c < dh; ++c) dst[c] = STORE(ak * gh[c] + a * qh[c] + b * LOAD(x[c]));  \
                }                                                                                 \
                if (dqt) {                                                                        \
                    ACC *restrict dqh = dqt + h * dh;                                             \
                    for (c = 0; c + VW <= dh; c += VW) ASTORE(dqh + c, ALOAD(dqh + c) + a * VLOAD(x + c)); \
                    for (; c < dh; ++c) dqh[c] += a * LOAD(x[c]);                                 \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        }                                                                                         \
    }                                                                                             \
    return NULL;                                                                                  \
}                                                                                                 \
                                                                                                  \
int attnres_read_fwd_##SUF(const void *const *v, const void *q, const void *w, void *y, void *lse, \
                           int64_t N, int64_t M, int64_t d, int64_t H, int q_static, double eps,  \
                           int key_norm, double norm_eps, int nthreads) {                         \
    job_t p;                                                                                      \
    memset(&p, 0, sizeof p);                                                                      \
    p.v = v; p.q = q; p.w = w; p.out = y; p.lse_out = lse;                                        \
    p.N = N; p.M = M; p.d = d; p.H = H; p.q_static = q_static; p.key_norm = key_norm;             \
    p.eps = eps; p.norm_eps = norm_eps;                                                           \
    if (M <= 0) return 0;                                                                         \
    size_t bytes = sizeof(ACC) * (size_t)(2 * N * H * RT + 2 * H * RT + d) + 64;                  \
    bytes = (bytes + 63) & ~(size_t)63;                                                           \
    char *scratch = launch(read_fwd_worker_##SUF, &p, clamp_threads(nthreads, M), bytes);         \
    if (!scratch) return -1;                                                                      \
    free(scratch);                                                                                \
    return 0;                                                                                     \
}                                                                                                 \
                                                                                                  \
/* dq (may be NULL): [d] if q_static else [M, d]; dw (may be NULL): [d]; both overwritten. */     \
int attnres_read_bwd_##SUF(const void *const *v, const void *q, const void *w, const void *lse,   \
                           const void *gy, void *const *dv, void *dq, void *dw, int64_t N,        \
                           int64_t M, int64_t d, int64_t H, int q_static, double eps, int key_norm, \
                           double norm_eps, int nthreads) {                                       \
    job_t p;                                                                                      \
    memset(&p, 0, sizeof p);                                                                      \
    p.v = v; p.q = q; p.w = w; p.lse = lse; p.g = gy; p.dv = (void *)dv; p.dq = dq; p.dw = dw;    \
    p.N = N; p.M = M; p.d = d; p.H = H; p.q_static = q_static; p.key_norm = key_norm;             \
    p.eps = eps; p.norm_eps = norm_eps;                                                           \
    if (dq) memset(dq, 0, sizeof(ACC) * (size_t)(q_static ? d : M * d));                          \
    if (dw) memset(dw, 0, sizeof(ACC) * (size_t)d);                                               \
    if (M <= 0) return 0;                                                                         \
    size_t bytes = sizeof(ACC) * (size_t)(4 * d + 3 * N * H * RT + H * RT + N * H) + 64;          \
    bytes = (bytes + 63) & ~(size_t)63;                                                           \
    int nt = clamp_threads(nthreads, M);                                                          \
    char *scratch = launch(read_bwd_worker_##SUF, &p, nt, bytes); /* calloc: partials start at 0 */ \
    if (!scratch) return -1;                                                                      \
    for (int t = 0; t < nt; ++t) {                                                                \
        const ACC *part = (const ACC *)(scratch + (size_t)t * bytes);                             \
        if (dq && q_static) for (int64_t c = 0; c < d; ++c) ((ACC *)dq)[c] += part[c];            \
        if (dw) for (int64_t c = 0; c < d; ++c) ((ACC *)dw)[c] += part[d + c];                    \
    }                                                                                             \
    free(scratch);                                                                                \
    return 0;                                                                                     \
}

DEFINE_READ(f32, float, float, ID_LOAD, ID_STORE, sqrtf, exp_lane_f32, logf, vf32, VW_f32, vload_f32, put_f32, vload_f32, vstore_f32, vsum_f32)
DEFINE_READ(f64, double, double, ID_LOAD, ID_STORE, sqrt, exp, log, vf64, VW_f64, vload_f64, put_f64, vload_f64, vstore_f64, vsum_f64)
DEFINE_READ(bf16, uint16_t, float, bf16_load, bf16_store, sqrtf, exp_lane_f32, logf, vf32, VW_f32, vload_bf16, put_bf16, vload_f32, vstore_f32, vsum_f32)

int attnres_abi_version(void) { return 10; }

/* Bytes per vector of the hot loops as built (64 with AVX-512, else 32). */
int attnres_vector_bytes(void) { return VBYTES; }

/* 1 when the workers run on OpenMP (shared with torch), 0 on POSIX threads. */
int attnres_uses_openmp(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}
