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
 * Memory schedule. Each thread walks its tokens in tiles of T tokens. A source's rows for a tile
 * are contiguous, so the first pass over a tile (the reductions) streams T rows per source -- long
 * runs the hardware prefetcher follows -- and leaves the tile in cache for the second pass (the
 * weighted sum, or the gradients). T is chosen so that all N sources of a tile fit TILE_BYTES; when
 * even one token's sources do not, the sources are taken in groups that fit, merged by online
 * softmax (running max and normaliser per token, the accumulator rescaled when the max grows).
 * While a tile is reduced, the rows of the tile two ahead are prefetched, so the memory stream
 * keeps going during the arithmetic; outputs larger than STREAM threshold (8 MiB: the output of
 * the forward, the sources' gradient) are written with non-temporal stores, which skips reading
 * the lines they overwrite. Work is split over tokens between nthreads POSIX threads; the
 * static-query gradient is reduced per thread, then summed in thread order: deterministic.
 * Threads: OpenMP when built with -fopenmp (cpu.py does, sharing torch's libgomp and its awake
 * workers), POSIX threads otherwise.
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
#ifndef MAX_TILE
#define MAX_TILE 32
#endif
#define LANES 32 /* independent partial sums per reduction: hides the FMA latency */

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

/* Copy n bytes to dst with non-temporal stores where possible: outputs much larger than the
 * cache are written straight to memory, without first reading the lines they replace. */
static inline void stream_bytes(void *dst, const void *src, size_t n) {
#if defined(__AVX__)
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (32 - ((uintptr_t)d & 31)) & 31;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    for (; n >= 32; n -= 32, d += 32, s += 32)
        _mm256_stream_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)s));
    memcpy(d, s, n);
#else
    memcpy(dst, src, n);
#endif
}

static inline void stream_fence(void) {
#if defined(__AVX__)
    _mm_sfence();
#endif
}

static inline void prefetch_bytes(const void *p, size_t n) {
    const char *c = (const char *)p;
    for (size_t off = 0; off < n; off += 64) __builtin_prefetch(c + off, 0, 2);
}

/* Where the next tile is prefetched: 1 = during pass 2, 2 = during pass 1 (row by row). */
#ifndef PF_MODE
#define PF_MODE 2
#endif
static const int pf_mode = PF_MODE;
#ifndef PF_TILES
#define PF_TILES 2
#endif
static const int pf_tiles = PF_TILES; /* how many tiles ahead */

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
    int64_t N, M, d, H, m0, m1, tile, group;
    int q_static, key_norm, stream;
    double eps;
    void *scratch; /* per thread, see the workers */
} job_t;

typedef void *(*worker_t)(void *);

static int clamp_threads(int nthreads, int64_t M) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > M) nthreads = M > 0 ? (int)M : 1;
    return nthreads;
}

/* Tokens per tile and sources per group for rows of `row_bytes` bytes. */
static void tiling(int64_t N, int64_t row_bytes, int64_t *tile, int64_t *group) {
    int64_t per_token = N * row_bytes;
    int64_t t = per_token > 0 ? TILE_BYTES / per_token : MAX_TILE;
    if (t >= 1) {
        *tile = t > MAX_TILE ? MAX_TILE : t;
        *group = N;
    } else {
        int64_t gsz = TILE_BYTES / (row_bytes > 0 ? row_bytes : 1);
        *tile = 1;
        *group = gsz < 1 ? 1 : (gsz > N ? N : gsz);
    }
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

#define DEFINE_KERNELS(SUF, T, ACC, LOAD, STORE, EXP, LOG, SQRT)                                  \
/* *a = sum x^2, *b = sum x.q over n channels */                                                  \
static inline void reduce2_##SUF(const T *restrict x, const ACC *restrict q, int64_t n,          \
                                 ACC *a, ACC *b) {                                                \
    ACC sa[LANES] = {0}, sb[LANES] = {0}, ra = 0, rb = 0;                                         \
    int64_t c = 0;                                                                                \
    for (; c + LANES <= n; c += LANES) {                                                          \
        _Pragma("omp simd")                                                                       \
        for (int l = 0; l < LANES; ++l) {                                                         \
            ACC xv = LOAD(x[c + l]);                                                              \
            sa[l] += xv * xv;                                                                     \
            sb[l] += xv * q[c + l];                                                               \
        }                                                                                         \
    }                                                                                             \
    for (; c < n; ++c) { ACC xv = LOAD(x[c]); ra += xv * xv; rb += xv * q[c]; }                   \
    for (int l = 0; l < LANES; ++l) { ra += sa[l]; rb += sb[l]; }                                 \
    *a = ra; *b = rb;                                                                             \
}                                                                                                 \
                                                                                                  \
/* also *e = sum x.g */                                                                           \
static inline void reduce3_##SUF(const T *restrict x, const ACC *restrict q, const T *restrict g, \
                                 int64_t n, ACC *a, ACC *b, ACC *e) {                             \
    ACC sa[LANES] = {0}, sb[LANES] = {0}, se[LANES] = {0}, ra = 0, rb = 0, re = 0;                \
    int64_t c = 0;                                                                                \
    for (; c + LANES <= n; c += LANES) {                                                          \
        _Pragma("omp simd")                                                                       \
        for (int l = 0; l < LANES; ++l) {                                                         \
            ACC xv = LOAD(x[c + l]);                                                              \
            sa[l] += xv * xv;                                                                     \
            sb[l] += xv * q[c + l];                                                               \
            se[l] += xv * LOAD(g[c + l]);                                                         \
        }                                                                                         \
    }                                                                                             \
    for (; c < n; ++c) {                                                                          \
        ACC xv = LOAD(x[c]);                                                                      \
        ra += xv * xv; rb += xv * q[c]; re += xv * LOAD(g[c]);                                    \
    }                                                                                             \
    for (int l = 0; l < LANES; ++l) { ra += sa[l]; rb += sb[l]; re += se[l]; }                    \
    *a = ra; *b = rb; *e = re;                                                                    \
}                                                                                                 \
                                                                                                  \
/* Forward. scratch: acc [tile, d] | z, then p, [group, tile, H] | max, sum [tile, H] | row [dh] */ \
static void *fwd_worker_##SUF(void *arg) {                                                        \
    job_t *j = (job_t *)arg;                                                                      \
    const T *const *v = (const T *const *)j->v;                                                   \
    const ACC *q = (const ACC *)j->q;                                                             \
    T *out = (T *)j->out;                                                                         \
    ACC *lse = (ACC *)j->lse_out;                                                                 \
    const int64_t N = j->N, d = j->d, H = j->H, dh = d / H;                                       \
    const int64_t TT = j->tile, G = j->group;                                                     \
    const ACC eps = (ACC)j->eps, inv_dh = (ACC)1 / (ACC)dh;                                      \
    ACC *acc = (ACC *)j->scratch, *zs = acc + TT * d, *mx = zs + G * TT * H, *sm = mx + TT * H;  \
    T *row = (T *)(sm + TT * H);                                                                  \
    for (int64_t m0 = j->m0; m0 < j->m1; m0 += TT) {                                              \
        const int64_t tn = m0 + TT <= j->m1 ? TT : j->m1 - m0;                                    \
        for (int64_t k = 0; k < tn * H; ++k) { mx[k] = -INFINITY; sm[k] = 0; }                    \
        memset(acc, 0, sizeof(ACC) * (size_t)(tn * d));                                           \
        for (int64_t g0 = 0; g0 < N; g0 += G) {                                                   \
            const int64_t gn = g0 + G <= N ? G : N - g0;                                          \
            /* pass 1: logits of the group, streaming tn contiguous rows per source */            \
            for (int64_t i = 0; i < gn; ++i) {                                                    \
                for (int64_t t = 0; t < tn; ++t) {                                                \
                    const T *x = v[g0 + i] + (m0 + t) * d;                                        \
                    const ACC *qt = q + (j->q_static ? 0 : (m0 + t) * d);                         \
                    if (pf_mode == 2 && G == N && m0 + pf_tiles * TT + t < j->m1)                 \
                        prefetch_bytes(x + pf_tiles * TT * d, sizeof(T) * (size_t)d);             \
                    for (int64_t h = 0; h < H; ++h) {                                             \
                        ACC ss, qv;                                                               \
                        reduce2_##SUF(x + h * dh, qt + h * dh, dh, &ss, &qv);                     \
                        ACC r = j->key_norm ? (ACC)1 / SQRT(ss * inv_dh + eps) : (ACC)1;          \
                        zs[(i * TT + t) * H + h] = qv * r;                                        \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            /* online softmax update: new max, rescale, weights p_i = exp(z_i - max) */           \
            for (int64_t t = 0; t < tn; ++t) {                                                    \
                for (int64_t h = 0; h < H; ++h) {                                                 \
                    const int64_t k = t * H + h;                                                  \
                    ACC gmax = -INFINITY;                                                         \
                    for (int64_t i = 0; i < gn; ++i) {                                            \
                        ACC z = zs[(i * TT + t) * H + h];                                         \
                        gmax = z > gmax ? z : gmax;                                               \
                    }                                                                             \
                    if (gmax > mx[k]) {                                                           \
                        if (g0 > 0) {                                                             \
                            ACC sc = EXP(mx[k] - gmax);                                           \
                            ACC *a = acc + t * d + h * dh;                                        \
                            sm[k] *= sc;                                                          \
                            _Pragma("omp simd")                                                   \
                            for (int64_t c = 0; c < dh; ++c) a[c] *= sc;                          \
                        }                                                                         \
                        mx[k] = gmax;                                                             \
                    }                                                                             \
                    for (int64_t i = 0; i < gn; ++i) {                                            \
                        ACC *z = &zs[(i * TT + t) * H + h];                                       \
                        *z = EXP(*z - mx[k]);                                                     \
                        sm[k] += *z;                                                              \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            /* pass 2: acc += sum_i p_i v_i, four sources per sweep, rows from cache */           \
            for (int64_t t = 0; t < tn; ++t) {                                                    \
                /* the same token of the next tile, all its sources: in flight while we add */    \
                if (pf_mode == 1 && G == N && m0 + TT + t < j->m1) {                              \
                    for (int64_t i = 0; i < N; ++i)                                               \
                        prefetch_bytes(v[i] + (m0 + TT + t) * d, sizeof(T) * (size_t)d);          \
                }                                                                                 \
                for (int64_t h = 0; h < H; ++h) {                                                 \
                    ACC *restrict a = acc + t * d + h * dh;                                       \
                    const T *const *src = v + g0;                                                 \
                    const int64_t off = (m0 + t) * d + h * dh;                                    \
                    int64_t i = 0;                                                                \
                    for (; i + 4 <= gn; i += 4) {                                                 \
                        const T *restrict x0 = src[i] + off, *restrict x1 = src[i + 1] + off;     \
                        const T *restrict x2 = src[i + 2] + off, *restrict x3 = src[i + 3] + off; \
                        const ACC p0 = zs[(i * TT + t) * H + h], p1 = zs[((i + 1) * TT + t) * H + h]; \
                        const ACC p2 = zs[((i + 2) * TT + t) * H + h], p3 = zs[((i + 3) * TT + t) * H + h]; \
                        _Pragma("omp simd")                                                       \
                        for (int64_t c = 0; c < dh; ++c)                                          \
                            a[c] += p0 * LOAD(x0[c]) + p1 * LOAD(x1[c]) + p2 * LOAD(x2[c]) + p3 * LOAD(x3[c]); \
                    }                                                                             \
                    for (; i < gn; ++i) {                                                         \
                        const T *restrict x0 = src[i] + off;                                      \
                        const ACC p0 = zs[(i * TT + t) * H + h];                                  \
                        _Pragma("omp simd")                                                       \
                        for (int64_t c = 0; c < dh; ++c) a[c] += p0 * LOAD(x0[c]);                \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t t = 0; t < tn; ++t) {                                                        \
            for (int64_t h = 0; h < H; ++h) {                                                     \
                const int64_t k = t * H + h;                                                      \
                const ACC inv = (ACC)1 / sm[k];                                                   \
                const ACC *restrict a = acc + t * d + h * dh;                                     \
                T *restrict o = out + (m0 + t) * d + h * dh;                                      \
                if (j->stream) {                                                                  \
                    _Pragma("omp simd")                                                           \
                    for (int64_t c = 0; c < dh; ++c) row[c] = STORE(a[c] * inv);                  \
                    stream_bytes(o, row, sizeof(T) * (size_t)dh);                                 \
                } else {                                                                          \
                    _Pragma("omp simd")                                                           \
                    for (int64_t c = 0; c < dh; ++c) o[c] = STORE(a[c] * inv);                    \
                }                                                                                 \
                lse[(m0 + t) * H + h] = mx[k] + LOG(sm[k]);                                       \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    stream_fence();                                                                               \
    return NULL;                                                                                  \
}                                                                                                 \
                                                                                                  \
/* Backward. scratch: dq partial [d] | r, z, alpha, s [N, tile, H] each | delta [tile, H] | row */ \
static void *bwd_worker_##SUF(void *arg) {                                                        \
    job_t *j = (job_t *)arg;                                                                      \
    const T *const *v = (const T *const *)j->v;                                                   \
    const T *g = (const T *)j->g;                                                                 \
    const ACC *q = (const ACC *)j->q;                                                             \
    const ACC *lse = (const ACC *)j->lse;                                                         \
    T *const *dv = (T *const *)j->dv;                                                             \
    const int64_t N = j->N, d = j->d, H = j->H, dh = d / H;                                       \
    const int64_t TT = j->tile, S = N * TT * H;                                                   \
    const ACC eps = (ACC)j->eps, inv_dh = (ACC)1 / (ACC)dh;                                      \
    ACC *dqp = (ACC *)j->scratch;                                                                 \
    ACC *sr = dqp + d, *sz = sr + S, *sa = sz + S, *sg = sa + S, *sd = sg + S;                   \
    T *row = (T *)(sd + TT * H);                                                                  \
    ACC *dq = j->dq ? (j->q_static ? dqp : (ACC *)j->dq) : NULL;                                 \
    for (int64_t m0 = j->m0; m0 < j->m1; m0 += TT) {                                              \
        const int64_t tn = m0 + TT <= j->m1 ? TT : j->m1 - m0;                                    \
        for (int64_t k = 0; k < tn * H; ++k) sd[k] = 0;                                           \
        /* pass 1: per-source scalars and delta = sum_i alpha_i (g . v_i) */                      \
        for (int64_t i = 0; i < N; ++i) {                                                         \
            for (int64_t t = 0; t < tn; ++t) {                                                    \
                const int64_t m = m0 + t;                                                         \
                const T *x = v[i] + m * d;                                                        \
                const T *gt = g + m * d;                                                          \
                if (pf_mode == 2 && m0 + pf_tiles * TT + t < j->m1) {                             \
                    prefetch_bytes(x + pf_tiles * TT * d, sizeof(T) * (size_t)d);                 \
                    if (i == 0) prefetch_bytes(gt + pf_tiles * TT * d, sizeof(T) * (size_t)d);    \
                }                                                                                 \
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
        /* pass 2: dv_i = alpha_i g + a_i q + b_i v_i and dq += a_i v_i, rows from cache */       \
        for (int64_t i = 0; i < N; ++i) {                                                         \
            for (int64_t t = 0; t < tn; ++t) {                                                    \
                const int64_t m = m0 + t;                                                         \
                if (pf_mode == 1 && m0 + TT + t < j->m1) { /* next tile's rows, in flight */      \
                    prefetch_bytes(v[i] + (m + TT) * d, sizeof(T) * (size_t)d);                 \
                    if (i == 0) prefetch_bytes(g + (m + TT) * d, sizeof(T) * (size_t)d);          \
                }                                                                                 \
                for (int64_t h = 0; h < H; ++h) {                                                 \
                    const int64_t k = (i * TT + t) * H + h, o = m * d + h * dh;                   \
                    const T *restrict x = v[i] + o;                                               \
                    const T *restrict gh = g + o;                                                 \
                    const ACC *restrict qh = q + (j->q_static ? h * dh : o);                      \
                    const ACC al = sa[k], dz = al * (sg[k] - sd[t * H + h]), ca = dz * sr[k];     \
                    const ACC cb = j->key_norm ? -dz * sz[k] * sr[k] * sr[k] * inv_dh : (ACC)0;   \
                    if (dv) {                                                                     \
                        T *restrict dx = j->stream ? row : dv[i] + o;                             \
                        _Pragma("omp simd")                                                       \
                        for (int64_t c = 0; c < dh; ++c)                                          \
                            dx[c] = STORE(al * LOAD(gh[c]) + ca * qh[c] + cb * LOAD(x[c]));       \
                        if (j->stream) stream_bytes(dv[i] + o, row, sizeof(T) * (size_t)dh);     \
                    }                                                                             \
                    if (dq) {                                                                     \
                        ACC *restrict dqh = dq + (j->q_static ? h * dh : o);                      \
                        _Pragma("omp simd")                                                       \
                        for (int64_t c = 0; c < dh; ++c) dqh[c] += ca * LOAD(x[c]);               \
                    }                                                                             \
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
    tiling(N, (int64_t)sizeof(T) * d, &p.tile, &p.group);                                         \
    size_t bytes = sizeof(ACC) * (size_t)(p.tile * d + (p.group + 2) * p.tile * H) + sizeof(T) * (size_t)(d / H) + 64; \
    bytes = (bytes + 63) & ~(size_t)63; /* slots stay aligned, no false sharing */                 \
    p.stream = (int64_t)sizeof(T) * M * d >= stream_threshold;                                      \
    char *scratch = launch(fwd_worker_##SUF, &p, clamp_threads(nthreads, M), bytes);              \
    if (!scratch) return -1;                                                                      \
    free(scratch);                                                                                \
    return 0;                                                                                     \
}                                                                                                 \
                                                                                                  \
/* dq (may be NULL): [d] if q_static else [M, d], accumulation type, overwritten. */             \
int attnres_bwd_##SUF(const void *const *v, const void *q, const void *lse, const void *g,      \
                      void *const *dv, void *dq, int64_t N, int64_t M, int64_t d, int64_t H,      \
                      int q_static, double eps, int key_norm, int nthreads) {                     \
    job_t p;                                                                                      \
    memset(&p, 0, sizeof p);                                                                      \
    p.v = v; p.q = q; p.lse = lse; p.g = g; p.dv = (void *)dv; p.dq = dq;                                 \
    p.N = N; p.M = M; p.d = d; p.H = H; p.q_static = q_static; p.key_norm = key_norm; p.eps = eps; \
    if (dq) memset(dq, 0, sizeof(ACC) * (size_t)(q_static ? d : M * d));                          \
    if (M <= 0) return 0;                                                                         \
    tiling(N + 1, (int64_t)sizeof(T) * d, &p.tile, &p.group); /* + 1: the rows of g */            \
    size_t bytes = sizeof(ACC) * (size_t)(d + (4 * N + 1) * p.tile * H) + sizeof(T) * (size_t)(d / H) + 64; \
    bytes = (bytes + 63) & ~(size_t)63;                                                           \
    p.stream = (int64_t)sizeof(T) * N * M * d >= stream_threshold;                      \
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

DEFINE_KERNELS(f32, float, float, ID_LOAD, ID_STORE, expf, logf, sqrtf)
DEFINE_KERNELS(f64, double, double, ID_LOAD, ID_STORE, exp, log, sqrt)
DEFINE_KERNELS(bf16, uint16_t, float, bf16_load, bf16_store, expf, logf, sqrtf)

/* Two-phase inference (forward only).
 *
 * Phase 1, attnres_states: Q static queries qs [Q, d] over the same sources v [N, M, d] in one read
 * of them; per query the softmax state as (lse [Q, M, H], out [Q, M, d]) -- a state with
 * max = lse and sum = 1 -- in the accumulation type.
 * Phase 2, attnres_merge: the state of one query, (st_max, st_sum) [M, H] and st_out [M, d],
 * merged with R more sources v [R, M, d] by online softmax; writes the output [M, d] in v's type.
 */
#define DEFINE_TWO_PHASE(SUF, T, ACC, LOAD, STORE, EXP, LOG, SQRT)                                \
static inline ACC dot_##SUF(const T *restrict x, const ACC *restrict q, int64_t n) {             \
    ACC sb[LANES] = {0}, rb = 0;                                                                  \
    int64_t c = 0;                                                                                \
    for (; c + LANES <= n; c += LANES) {                                                          \
        _Pragma("omp simd")                                                                       \
        for (int l = 0; l < LANES; ++l) sb[l] += LOAD(x[c + l]) * q[c + l];                       \
    }                                                                                             \
    for (; c < n; ++c) rb += LOAD(x[c]) * q[c];                                                   \
    for (int l = 0; l < LANES; ++l) rb += sb[l];                                                  \
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
    const int64_t TT = j->tile, Q = j->group;                                                     \
    const ACC eps = (ACC)j->eps, inv_dh = (ACC)1 / (ACC)dh;                                      \
    ACC *zs = (ACC *)j->scratch;                                                                  \
    for (int64_t m0 = j->m0; m0 < j->m1; m0 += TT) {                                              \
        const int64_t tn = m0 + TT <= j->m1 ? TT : j->m1 - m0;                                    \
        for (int64_t i = 0; i < N; ++i) {       /* pass 1: Q logits per row, one read */          \
            for (int64_t t = 0; t < tn; ++t) {                                                    \
                const T *x = v[i] + (m0 + t) * d;                                                 \
                for (int64_t h = 0; h < H; ++h) {                                                 \
                    ACC ss, qv;                                                                   \
                    reduce2_##SUF(x + h * dh, qs + h * dh, dh, &ss, &qv);                         \
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
                    ACC *restrict a = out + (k * M + m0 + t) * d + h * dh;                        \
                    const int64_t off = (m0 + t) * d + h * dh;                                    \
                    memset(a, 0, sizeof(ACC) * (size_t)dh);                                       \
                    int64_t i = 0;                                                                \
                    for (; i + 4 <= N; i += 4) {                                                  \
                        const T *restrict x0 = v[i] + off, *restrict x1 = v[i + 1] + off;         \
                        const T *restrict x2 = v[i + 2] + off, *restrict x3 = v[i + 3] + off;     \
                        const ACC p0 = zs[((k * N + i) * TT + t) * H + h] * inv;                  \
                        const ACC p1 = zs[((k * N + i + 1) * TT + t) * H + h] * inv;              \
                        const ACC p2 = zs[((k * N + i + 2) * TT + t) * H + h] * inv;              \
                        const ACC p3 = zs[((k * N + i + 3) * TT + t) * H + h] * inv;              \
                        _Pragma("omp simd")                                                       \
                        for (int64_t c = 0; c < dh; ++c)                                          \
                            a[c] += p0 * LOAD(x0[c]) + p1 * LOAD(x1[c]) + p2 * LOAD(x2[c]) + p3 * LOAD(x3[c]); \
                    }                                                                             \
                    for (; i < N; ++i) {                                                          \
                        const T *restrict x0 = v[i] + off;                                        \
                        const ACC p0 = zs[((k * N + i) * TT + t) * H + h] * inv;                  \
                        _Pragma("omp simd")                                                       \
                        for (int64_t c = 0; c < dh; ++c) a[c] += p0 * LOAD(x0[c]);                \
                    }                                                                             \
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
    p.N = N; p.M = M; p.d = d; p.H = H; p.key_norm = key_norm; p.eps = eps; p.group = Q;          \
    if (M <= 0 || Q <= 0) return 0;                                                               \
    int64_t unused;                                                                               \
    tiling(N, (int64_t)sizeof(T) * d, &p.tile, &unused);                                          \
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
    const ACC eps = (ACC)j->eps, inv_dh = (ACC)1 / (ACC)dh;                                      \
    ACC *zs = (ACC *)j->scratch;                                                                  \
    for (int64_t m = j->m0; m < j->m1; ++m) {                                                     \
        for (int64_t h = 0; h < H; ++h) {                                                         \
            const int64_t o = m * d + h * dh;                                                     \
            ACC mx = st_max[m * H + h];                                                           \
            for (int64_t r = 0; r < R; ++r) {                                                     \
                ACC ss, qv;                                                                       \
                reduce2_##SUF(v[r] + o, q + h * dh, dh, &ss, &qv);                                \
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
int attnres_merge_##SUF(const void *const *v, const void *q, const void *st_max, const void *st_sum,   \
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

DEFINE_TWO_PHASE(f32, float, float, ID_LOAD, ID_STORE, expf, logf, sqrtf)
DEFINE_TWO_PHASE(f64, double, double, ID_LOAD, ID_STORE, exp, log, sqrt)
DEFINE_TWO_PHASE(bf16, uint16_t, float, bf16_load, bf16_store, expf, logf, sqrtf)

int attnres_abi_version(void) { return 7; }

/* 1 when the workers run on OpenMP (shared with torch), 0 on POSIX threads. */
int attnres_uses_openmp(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}
