/* CSR kernels for the simulated fabric, loaded through ctypes by simulator/native.py.
 *
 * Activations use a "token-blocked" layout: a [tokens, features] matrix becomes
 * [blocks, features, BLOCK] with tokens padded by zeros to a multiple of BLOCK. Every non-zero
 * of the weight then touches BLOCK contiguous tokens (vector FMAs), and the features of one
 * block sit contiguously, so the block a row reads stays in L2 without cache-set conflicts.
 * All work is O(nnz * tokens) plus O((rows + cols) * tokens) for packing.
 *
 *   pack:   Xb[b, c, j] = X[b*BLOCK + j, c]            (0 past the last token), and on request
 *           sums[c] = sum_t X[t, c] (the bias gradient, when X is the upstream gradient)
 *   spmm:   Y[b*BLOCK + j, r] = bias[r] + sum_{k in row r} vals[k] * Xb[b, cols[k], j]
 *           (Y = X A^T for the CSR matrix A: W for the forward, W^T for the input gradient).
 *           The values are a contiguous array in CSR order: every token block re-reads them,
 *           and reading them from the dense W instead (no gather per call) was measured up to
 *           2x slower, a cache line of W per non-zero and block. Rows of a block are computed
 *           one vector's width (LANES) at a time into an L1 tile, transposed in registers and
 *           written token-major (a whole cache line per token, streamed past the cache when Y
 *           is large): no token-blocked Y in memory.
 *   pack_spmm: pack then spmm in one call; where both split the token blocks alike, each
 *           thread packs a block right before it multiplies it (the forward packs X, the input
 *           gradient dY; both packed copies stay for sddmm).
 *   sddmm and the fused backward (dX and the weight gradient in one pass): _kernels_grad.c,
 *           included at the end.
 * Build variants (simulator.native.KernelVariant): CSX_VEC_BYTES=32 narrows the vectors on an
 * AVX-512 build; streaming stores and the fused backward's prefetching are run-time arguments.
 *
 * Threads come from OpenMP, built with -fopenmp and linked to libgomp.so.1: torch has loaded
 * that library already, so the loader reuses it and these kernels run on torch's own thread
 * pool. Separate pthreads were measured up to 2x slower on 2 cores: torch's OpenMP workers
 * spin after each torch op and take the core a pthread needs. pack splits token blocks evenly;
 * spmm splits them the same way when the threads divide them evenly, and otherwise, like sddmm,
 * splits rows so that each thread gets an equal share of non-zeros. ctypes releases the GIL for
 * the whole call. Compiled without OpenMP, the pragma is ignored and every call runs on the
 * calling thread.
 */
#include <stdint.h>
#include <stdlib.h>

#define MAX_THREADS 64
/* The threads of an OpenMP parallel region (one without OpenMP). */
#ifdef _OPENMP
#include <omp.h>
#define TEAM_SIZE() omp_get_num_threads()
#define TEAM_MEMBER() omp_get_thread_num()
#else
#define TEAM_SIZE() 1
#define TEAM_MEMBER() 0
#endif
#define BLOCK 64         /* tokens per block; exported as csx_block_tokens() */
/* One vector register where the compiler targets AVX-512, else 32 bytes (one AVX2 register, two
 * SSE/NEON ones): a vector wider than the machine's registers makes GCC split it and spill the
 * accumulators, measured 4.5x slower spmm on an AVX2-only EPYC. */
#if defined(CSX_VEC_BYTES) /* a build variant: 32-byte vectors on an AVX-512 machine */
#define VEC_BYTES CSX_VEC_BYTES
#elif defined(__AVX512F__)
#define VEC_BYTES 64
#else
#define VEC_BYTES 32
#endif
/* sddmm keeps SDDMM_REGS vector registers of gradient resident (half the register file) and
 * sums into SDDMM_ACCS accumulators to hide FMA latency. With AVX-512, 8 registers measured
 * the same as 16 and 24 (spilled) 2.5x slower. */
#if defined(__AVX512F__)
#define SDDMM_REGS 16
#else
#define SDDMM_REGS 8
#endif
#define SDDMM_ACCS 4
/* Sum of one vector's lanes, once per non-zero and token group in sddmm. GCC keeps a plain
 * `for (lane) sum += v[lane]` in order (no -ffast-math): 15 dependent scalar adds plus the lane
 * extracts, about 30 instructions against the 16 FMAs they follow. Halving the vector
 * (extract, add) takes log2(lanes) steps: measured sddmm 1.16-1.34x faster with AVX-512 and
 * 1.20-1.24x on an AVX2 build (bench/roofline.py shapes). __builtin_shuffle halving instead
 * made GCC rebuild the index vectors per call, 2x slower: hence the intrinsics. */
#if defined(__AVX512F__) && VEC_BYTES == 64
#include <immintrin.h>
#define HSUM_f32(v) _mm512_reduce_add_ps((__m512)(v))
#define HSUM_f64(v) _mm512_reduce_add_pd((__m512d)(v))
#elif defined(__AVX__) && VEC_BYTES == 32
#include <immintrin.h>
static inline float hsum256_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline double hsum256_pd(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
#define HSUM_f32(v) hsum256_ps((__m256)(v))
#define HSUM_f64(v) hsum256_pd((__m256d)(v))
#else /* other targets: lane by lane */
#define HSUM_LANES(v, T)                                                                   \
    ({                                                                                     \
        T sum_ = 0;                                                                        \
        for (int lane_ = 0; lane_ < VEC_BYTES / (int)sizeof(T); lane_++) sum_ += (v)[lane_]; \
        sum_;                                                                              \
    })
#define HSUM_f32(v) HSUM_LANES(v, float)
#define HSUM_f64(v) HSUM_LANES(v, double)
#endif

/* Non-temporal (streaming) vector stores, for spmm's output: Y is written once, a whole cache
 * line per store, 64 token rows apart, so a plain store first reads each line from memory (a
 * read for ownership) and the 64 streams defeat the prefetchers. Streamed, spmm measured
 * 1.1-1.4x faster on an AVX-512 EPYC (1024^2, 512 and 2048 tokens, 90-99% sparse), 1.1-1.3x
 * with the next op reading Y (an elementwise op) counted in; outputs under STREAM_MIN_BYTES
 * (cache-sized: the consumer would find them in L2) keep plain stores. Stores need a
 * vector-aligned address and an sfence before another thread reads them. */
#define STREAM_MIN_BYTES (256 * 1024)
#if defined(__AVX512F__) && VEC_BYTES == 64
#define STREAM_f32(p, v) _mm512_stream_ps((p), (__m512)(v))
#define STREAM_f64(p, v) _mm512_stream_pd((p), (__m512d)(v))
#define STREAM_FENCE() _mm_sfence()
#elif defined(__AVX__) && VEC_BYTES == 32
#define STREAM_f32(p, v) _mm256_stream_ps((p), (__m256)(v))
#define STREAM_f64(p, v) _mm256_stream_pd((p), (__m256d)(v))
#define STREAM_FENCE() _mm_sfence()
#else /* other targets: plain stores */
#define STREAM_f32(p, v) (*(__typeof__(v) *)(p) = (v))
#define STREAM_f64(p, v) (*(__typeof__(v) *)(p) = (v))
#define STREAM_FENCE() ((void)0)
#endif

/* {0, 1, ..., lanes - 1} as vector literals, so that the transpose's shuffle masks are
 * compile-time constants: masks filled lane by lane in a loop were not folded, and an AVX2
 * build then emulated each two-source shuffle with two permutes and a blend. */
#define IOTA4 {0, 1, 2, 3}
#define IOTA8 {0, 1, 2, 3, 4, 5, 6, 7}
#define IOTA16 {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#if VEC_BYTES == 64
#define IOTA_f32 IOTA16
#define IOTA_f64 IOTA8
#else
#define IOTA_f32 IOTA8
#define IOTA_f64 IOTA4
#endif

int csx_block_tokens(void) { return BLOCK; }

/* CSR of a row-major bool mask and of its transpose in one pass after counting (a mask update
 * rebuilds both in about the time of reading the mask once; torch's nonzero on the transposed
 * view plus a search for the transpose order took ~100 ms at 4096 x 1024):
 *   indptr/cols/flat_index      CSR of W (flat_index = r * n_cols + c)
 *   indptr_t/cols_t/t_order     CSR of W^T, t_order[j] = position in W's CSR of its j-th entry
 * indptr and indptr_t come filled (prefix sums of csx_mask_counts). Rows of W are visited in
 * order, so within each column of W^T the rows come out ascending. */
void csx_mask_counts(const uint8_t *mask, int64_t rows, int64_t n_cols, int32_t *row_counts,
                     int32_t *col_counts) {
    for (int64_t c = 0; c < n_cols; c++) col_counts[c] = 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = mask + r * n_cols;
        int32_t count = 0;
        for (int64_t c = 0; c < n_cols; c++) {
            count += row[c];
            col_counts[c] += row[c];
        }
        row_counts[r] = count;
    }
}

int csx_mask_fill(const uint8_t *mask, int64_t rows, int64_t n_cols, const int32_t *indptr,
                  int32_t *cols, int64_t *flat_index, const int32_t *indptr_t, int32_t *cols_t,
                  int64_t *t_order) {
    int32_t *cursor = malloc(sizeof(int32_t) * (size_t)(n_cols > 0 ? n_cols : 1));
    if (!cursor) return 1;
    for (int64_t c = 0; c < n_cols; c++) cursor[c] = indptr_t[c];
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = mask + r * n_cols;
        int32_t k = indptr[r];
        for (int64_t c = 0; c < n_cols; c++) {
            if (!row[c]) continue;
            cols[k] = (int32_t)c;
            flat_index[k] = r * n_cols + c;
            const int32_t j = cursor[c]++;
            cols_t[j] = (int32_t)r;
            t_order[j] = k;
            k++;
        }
    }
    free(cursor);
    return 0;
}

/* Sum of `n` floats read `reps` times with vector loads (bench/roofline.py: with n sized to L2,
 * the L2 read bandwidth that bounds a kernel loading one activation vector per FMA). */
float csx_read_bandwidth_probe(const float *buf, int64_t n, int64_t reps) {
    typedef float vec __attribute__((vector_size(VEC_BYTES), aligned(sizeof(float))));
    enum { LANES = VEC_BYTES / sizeof(float) };
    vec acc[4] = {{0}};
    for (int64_t r = 0; r < reps; r++)
        for (int64_t i = 0; i + 4 * LANES <= n; i += 4 * LANES)
            for (int a = 0; a < 4; a++) acc[a] += *(const vec *)(buf + i + a * LANES);
    float sum = 0;
    for (int a = 0; a < 4; a++)
        for (int l = 0; l < LANES; l++) sum += acc[a][l];
    return sum;
}

typedef struct {
    const int32_t *indptr;
    const int32_t *cols;
    const void *vals;
    const void *bias;
    const void *src;   /* Xb for spmm/sddmm, the token-major matrix for pack */
    const void *grad;  /* Gb for sddmm and backward */
    void *out;
    void *dense;       /* sddmm: the dense gradient to write as well, or NULL; backward: the
                          weight gradient summed in W^T's order (scratch) */
    void *grad_values; /* backward: the weight gradient, values in W's CSR order */
    const int64_t *order; /* backward: W^T's j-th non-zero is W's order[j]-th */
    int64_t begin, end; /* this thread's rows (spmm, sddmm, backward) or blocks (pack) */
    int64_t features;   /* columns of the CSR matrix (spmm, sddmm, backward: W^T's) or of the
                           token-major matrix (pack) */
    int64_t blocks, tokens; /* token blocks; real tokens */
    int64_t rows;           /* rows of W (spmm, sddmm) */
    int by_blocks;          /* spmm: begin/end are token blocks (of every row), not rows */
    int thread;             /* this share's index, 0 .. threads - 1 */
    void *partial;          /* pack: per-thread column sums, [threads, features], or NULL */
    const void *unpacked;   /* spmm: token-major X, packed into src block by block just before
                               the block is used (pack fused in), or NULL: src comes packed */
    int stream;             /* spmm: write Y with streaming stores where aligned */
    int prefetch;           /* backward: prefetch the upstream tiles of the non-zero this many
                               ahead (0: none) */
} work_t;

/* Ranges [bounds[i], bounds[i+1]) of `units`: equal non-zeros per thread when indptr is given,
 * equal units otherwise. */
static void split(const int32_t *indptr, int64_t units, int threads, int64_t *bounds) {
    bounds[0] = 0;
    bounds[threads] = units;
    int64_t nnz = indptr ? indptr[units] : 0, r = 0;
    for (int i = 1; i < threads; i++) {
        if (!indptr) {
            bounds[i] = units * i / threads;
            continue;
        }
        int64_t target = nnz * i / threads;
        while (r < units && indptr[r] < target) r++;
        bounds[i] = r;
    }
}

/* Runs fn on every thread's share; returns the number of shares. */
static int run_threads(void (*fn)(const work_t *), const work_t *proto, const int32_t *indptr,
                       int64_t units, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > units) threads = (int)units;
    if (threads < 1) threads = 1;
    int64_t bounds[MAX_THREADS + 1];
    work_t work[MAX_THREADS];
    split(indptr, units, threads, bounds);
    for (int i = 0; i < threads; i++) {
        work[i] = *proto;
        work[i].begin = bounds[i];
        work[i].end = bounds[i + 1];
        work[i].thread = i;
    }
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int i = 0; i < threads; i++) fn(&work[i]);
    return threads;
}

#define DEFINE_KERNELS(T, S, I)                                                                   \
    typedef T vec_##S __attribute__((vector_size(VEC_BYTES), aligned(sizeof(T))));                \
    typedef I ivec_##S __attribute__((vector_size(VEC_BYTES)));                                   \
    enum { LANES_##S = VEC_BYTES / sizeof(T), VECS_##S = BLOCK / LANES_##S,                       \
           /* blocks whose gradient fits in SDDMM_REGS registers (at least one) */                \
           SDDMM_GROUP_##S = SDDMM_REGS / VECS_##S > 0 ? SDDMM_REGS / VECS_##S : 1,               \
           SDDMM_VECS_##S = SDDMM_GROUP_##S * VECS_##S };                                         \
                                                                                                  \
    /* In-register transpose of a LANES x LANES tile held as LANES vectors: log2(LANES) stages  \
     * of two-source shuffles, each swapping the off-diagonal h x h blocks of every 2h x 2h     \
     * block (about 1/4 shuffle per element against about 1 scalar move). Both loops unrolled: \
     * rolled, GCC 12 kept the tile on the stack and built the masks at run time (a load and a  \
     * store per shuffle); unrolled, pack measured 1.3-2x and spmm 1.05-1.2x faster at 1024^2. */ \
    static inline __attribute__((always_inline)) void transpose_##S(vec_##S *v) {                 \
        _Pragma("GCC unroll 8") for (int h = LANES_##S / 2; h >= 1; h /= 2) {                    \
            const ivec_##S k = IOTA_##S, upper = (k & h) != 0;                                    \
            const ivec_##S lo = k + (upper & (LANES_##S - h));                                    \
            const ivec_##S hi = k + (upper & LANES_##S) + (~upper & h);                           \
            _Pragma("GCC unroll 16") for (int i = 0; i < LANES_##S; i++) {                        \
                if (i & h) continue;                                                              \
                const vec_##S a = v[i], b = v[i + h];                                             \
                v[i] = __builtin_shuffle(a, b, lo);                                               \
                v[i + h] = __builtin_shuffle(a, b, hi);                                           \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* LANES token rows at a time (outer) across all features (inner): LANES rows are read    \
     * sequentially, which the hardware prefetchers follow. Features outer read one line from  \
     * each of the block's 64 rows per step (64 streams) and measured 1.25-1.35x slower. */    \
    /* Blocks [begin, end) of x, features [f_begin, f_end) (f_begin a multiple of LANES), into    \
     * xb at block index b - skip (skip > 0: into a buffer holding fewer blocks). */               \
    static void pack_blocks_##S(const T *x, int64_t tokens, int64_t n, int64_t begin,             \
                                int64_t end, int64_t f_begin, int64_t f_end, int64_t skip, T *xb, \
                                T *sums) {                                                        \
        for (int64_t b = begin; b < end; b++) {                                                   \
            T *dst = xb + (b - skip) * n * BLOCK;                                                 \
            const T *src = x + b * BLOCK * n;                                                     \
            const int64_t valid = tokens - b * BLOCK < BLOCK ? tokens - b * BLOCK : BLOCK;        \
            for (int64_t j0 = 0; j0 < BLOCK; j0 += LANES_##S) {                                   \
                for (int64_t c0 = f_begin; c0 < f_end; c0 += LANES_##S) {                         \
                    const int64_t c1 = c0 + LANES_##S < f_end ? c0 + LANES_##S : f_end;           \
                    if (c1 - c0 == LANES_##S && j0 + LANES_##S <= valid) {                        \
                        vec_##S v[LANES_##S];                                                     \
                        for (int j = 0; j < LANES_##S; j++)                                       \
                            v[j] = *(const vec_##S *)(src + (j0 + j) * n + c0);                   \
                        if (sums) { /* the rows as loaded: LANES columns per vector add */        \
                            vec_##S total = v[0];                                                 \
                            for (int j = 1; j < LANES_##S; j++) total += v[j];                    \
                            *(vec_##S *)(sums + c0) += total;                                     \
                        }                                                                         \
                        transpose_##S(v);                                                         \
                        for (int c = 0; c < LANES_##S; c++)                                       \
                            *(vec_##S *)(dst + (c0 + c) * BLOCK + j0) = v[c];                     \
                        continue;                                                                 \
                    }                                                                             \
                    for (int64_t j = j0; j < j0 + LANES_##S; j++)                                 \
                        for (int64_t c = c0; c < c1; c++) {                                       \
                            dst[c * BLOCK + j] = j < valid ? src[j * n + c] : (T)0;               \
                            if (sums && j < valid) sums[c] += src[j * n + c];                     \
                        }                                                                         \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* This thread's column sums (when asked for) in its row of `partial`, zeroed first. */       \
    static T *thread_sums_##S(const work_t *w) {                                                  \
        T *sums = w->partial ? (T *)w->partial + w->thread * w->features : 0;                     \
        if (sums)                                                                                 \
            for (int64_t c = 0; c < w->features; c++) sums[c] = 0;                                \
        return sums;                                                                              \
    }                                                                                             \
                                                                                                  \
    static void pack_worker_##S(const work_t *w) {                                                \
        pack_blocks_##S((const T *)w->src, w->tokens, w->features, w->begin, w->end, 0,           \
                        w->features, 0, (T *)w->out, thread_sums_##S(w));                         \
    }                                                                                             \
                                                                                                  \
    /* sums = the threads' partial sums added in thread order (what pack returns). */             \
    static void add_partials_##S(T *sums, const T *partial, int threads, int64_t features) {      \
        for (int64_t c = 0; c < features; c++) sums[c] = 0;                                       \
        for (int i = 0; i < threads; i++)                                                         \
            for (int64_t c = 0; c < features; c++) sums[c] += partial[i * features + c];          \
    }                                                                                             \
                                                                                                  \
    /* The LANES rows [r0, r1) of token block b, held as a tile (tile[r][q]: row r's q-th vector \
     * of tokens), written token-major into y ([tokens, m]): transposed in registers so that    \
     * each token gets LANES contiguous outputs (a whole cache line), streamed past the cache   \
     * when `stream` (and the lines are aligned). spmm's output and the fused backward's dX.    \
     * Stores need an sfence before another thread reads streamed lines. */                     \
    static inline __attribute__((always_inline)) void write_tile_##S(                             \
        vec_##S (*tile)[VECS_##S], int64_t r0, int64_t r1, int64_t b, int64_t valid, int64_t m,   \
        T *y, int stream) {                                                                       \
        if (r1 - r0 == LANES_##S) {                                                               \
            stream = stream && r0 % LANES_##S == 0; /* aligned lines */                           \
            for (int q = 0; q < VECS_##S; q++) {                                                  \
                vec_##S v[LANES_##S];                                                             \
                for (int r = 0; r < LANES_##S; r++) v[r] = tile[r][q];                            \
                transpose_##S(v);                                                                 \
                for (int j = 0; j < LANES_##S && q * LANES_##S + j < valid; j++) {                \
                    T *line = y + (b * BLOCK + q * LANES_##S + j) * m + r0;                       \
                    if (stream)                                                                   \
                        STREAM_##S(line, v[j]);                                                   \
                    else                                                                          \
                        *(vec_##S *)line = v[j];                                                  \
                }                                                                                 \
            }                                                                                     \
            return;                                                                               \
        }                                                                                         \
        const T *flat = (const T *)tile;                                                          \
        for (int64_t j = 0; j < valid; j++)                                                       \
            for (int64_t r = 0; r < r1 - r0; r++)                                                 \
                y[(b * BLOCK + j) * m + r0 + r] = flat[r * BLOCK + j];                            \
    }                                                                                             \
                                                                                                  \
    /* Rows of one token block are computed LANES at a time into an L1-resident tile, which is  \
     * then written token-major by write_tile: no token-blocked copy of Y ever reaches memory.  \
     * Measured against this on an AVX-512 Xeon (48 KiB L1d, 2 MiB L2), all slower or equal:    \
     * L1-sized column panels of the block (Y rows of the block kept in L2, or 32-128-row        \
     * chunks kept in L1; 10-50% slower: a row has only ~3-13 non-zeros per panel, and the      \
     * per-row-and-panel overhead outweighs the L1 hits; remeasured for issue 46 with 64-256-   \
     * feature panels and 32-128-row chunks: 0-35% slower), 4 accumulator sets instead of 2     \
     * (issue 46: within +-3%), prefetching the tile 4-32 non-zeros ahead (1 to 4 lines: within \
     * the noise, +-10%; as a calibrated variant, 8 ahead, up to 1.15x slower at 4096 x 1024),   \
     * and BLOCK 32 or 128 instead of 64 (all within +-7%). */                                   \
    static void spmm_worker_##S(const work_t *w) {                                                \
        const T *vals = (const T *)w->vals, *bias = (const T *)w->bias;                           \
        const int64_t n = w->features, m = w->rows;                                               \
        T *y = (T *)w->out;                                                                       \
        vec_##S tile[LANES_##S][VECS_##S];                                                        \
        const int64_t row_begin = w->by_blocks ? 0 : w->begin;                                    \
        const int64_t row_end = w->by_blocks ? w->rows : w->end;                                  \
        const int64_t block_begin = w->by_blocks ? w->begin : 0;                                  \
        const int64_t block_end = w->by_blocks ? w->end : w->blocks;                              \
        T *sums = w->unpacked ? thread_sums_##S(w) : 0;                                           \
        for (int64_t b = block_begin; b < block_end; b++) {                                       \
            if (w->unpacked) /* by_blocks: this thread packs the blocks it reads */               \
                pack_blocks_##S((const T *)w->unpacked, w->tokens, n, b, b + 1, 0, n, 0,          \
                                (T *)w->src, sums);                                               \
            const T *xb = (const T *)w->src + b * n * BLOCK;                                      \
            const int64_t valid = w->tokens - b * BLOCK < BLOCK ? w->tokens - b * BLOCK : BLOCK;  \
            for (int64_t r0 = row_begin; r0 < row_end; r0 += LANES_##S) {                        \
                const int64_t r1 = r0 + LANES_##S < row_end ? r0 + LANES_##S : row_end;           \
                for (int64_t r = r0; r < r1; r++) {                                               \
                    vec_##S a[VECS_##S], c[VECS_##S];                                             \
                    const T init = bias ? bias[r] : (T)0;                                         \
                    for (int q = 0; q < VECS_##S; q++) {                                          \
                        a[q] = (vec_##S){0} + init;                                               \
                        c[q] = (vec_##S){0};                                                      \
                    }                                                                             \
                    int32_t k = w->indptr[r];                                                     \
                    const int32_t end = w->indptr[r + 1];                                         \
                    for (; k + 1 < end; k += 2) { /* two accumulator sets hide FMA latency */     \
                        const vec_##S *x0 = (const vec_##S *)(xb + (int64_t)w->cols[k] * BLOCK);  \
                        const vec_##S *x1 =                                                       \
                            (const vec_##S *)(xb + (int64_t)w->cols[k + 1] * BLOCK);              \
                        const T v0 = vals[k], v1 = vals[k + 1];                                   \
                        for (int q = 0; q < VECS_##S; q++) {                                      \
                            a[q] += v0 * x0[q];                                                   \
                            c[q] += v1 * x1[q];                                                   \
                        }                                                                         \
                    }                                                                             \
                    if (k < end) {                                                                \
                        const vec_##S *x0 = (const vec_##S *)(xb + (int64_t)w->cols[k] * BLOCK);  \
                        for (int q = 0; q < VECS_##S; q++) a[q] += vals[k] * x0[q];               \
                    }                                                                             \
                    for (int q = 0; q < VECS_##S; q++) tile[r - r0][q] = a[q] + c[q];             \
                }                                                                                 \
                write_tile_##S(tile, r0, r1, b, valid, m, y, w->stream);                          \
            }                                                                                     \
        }                                                                                         \
        if (w->stream) STREAM_FENCE();                                                            \
    }                                                                                             \
                                                                                                  \
    /* out[k] = src[index[k]]: the non-zero values in CSR order, gathered from the dense W (or    \
     * from the CSR-ordered values, in the order of W^T's CSR), about 5x faster than            \
     * torch's index_select on one core. */                                                       \
    void csx_gather_##S(const T *src, const int64_t *index, int64_t n, T *out) {                  \
        for (int64_t k = 0; k < n; k++) out[k] = src[index[k]];                                   \
    }                                                                                             \
                                                                                                  \
    /* With `sums`, also the column sums of x (the bias gradient when x is the upstream           \
     * gradient: no second pass over it), summed per thread in `partial` ([threads, features])    \
     * and then over the threads in order. */                                                     \
    void csx_pack_##S(const T *x, int64_t tokens, int64_t features, T *xb, T *sums,               \
                      T *partial, int threads) {                                                  \
        const int64_t blocks = (tokens + BLOCK - 1) / BLOCK;                                      \
        const work_t proto = {.src = x, .out = xb, .features = features, .blocks = blocks,        \
                              .tokens = tokens, .partial = sums ? partial : 0};                   \
        const int used = run_threads(pack_worker_##S, &proto, 0, blocks, threads);                \
        if (sums) add_partials_##S(sums, partial, used, features);                                \
    }                                                                                             \
                                                                                                  \
    /* Whether an output Y [tokens, rows] is streamed: asked for (`stream`, a kernel variant:    \
     * issue 46 measured streaming 0.9-1.1x on an AVX-512 Xeon, where the EPYC gained), large    \
     * enough, and whole vectors of a token's outputs aligned (rows a multiple of the lanes, Y   \
     * vector-aligned). */                                                                       \
    static int streams_##S(int stream, const T *y, int64_t rows, int64_t tokens) {                \
        return stream && rows * tokens * (int64_t)sizeof(T) >= STREAM_MIN_BYTES                   \
            && rows % LANES_##S == 0 && (uintptr_t)y % VEC_BYTES == 0;                            \
    }                                                                                             \
                                                                                                  \
    void csx_spmm_##S(const int32_t *indptr, const int32_t *cols, const T *vals, const T *bias,   \
                      int64_t rows, int64_t features, const T *xb, int64_t tokens, T *y,          \
                      int threads, int stream) {                                                  \
        /* Token blocks split evenly across the threads when they can: each thread then reads     \
         * only the blocks it packed itself (pack splits blocks the same way), from its own L2,   \
         * and writes whole token rows of Y. Measured on 2 cores against splitting rows by        \
         * non-zeros: spmm 1.11-1.23x faster at 1024 x 1024 and 512 tokens, a whole forward +     \
         * backward 1.05-1.13x at 512 tokens and 0.99-1.08x at 2048. */                           \
        const int64_t blocks = (tokens + BLOCK - 1) / BLOCK;                                      \
        const int by_blocks = threads <= 1 || blocks % threads == 0;                              \
        const work_t proto = {.indptr = indptr, .cols = cols, .vals = vals, .bias = bias,         \
                              .src = xb, .out = y, .features = features, .blocks = blocks,        \
                              .tokens = tokens, .rows = rows, .by_blocks = by_blocks,             \
                              .stream = streams_##S(stream, y, rows, tokens)};                    \
        if (by_blocks)                                                                            \
            run_threads(spmm_worker_##S, &proto, 0, blocks, threads);                             \
        else                                                                                      \
            run_threads(spmm_worker_##S, &proto, indptr, rows, threads);                          \
    }                                                                                             \
                                                                                                  \
    /* csx_pack (of x into xb, with pack_threads) then csx_spmm (with threads) over xb, fused     \
     * where spmm splits token blocks as pack does (the same thread count, dividing the blocks):  \
     * each thread then packs a block right before it reads it, from L2 instead of memory (the    \
     * packed blocks are written all the same: the weight gradient reads them), and the column    \
     * sums are summed as pack sums them (same shares, same order), so both ways give the same    \
     * bits. */                                                                                   \
    void csx_pack_spmm_##S(const T *x, T *xb, T *sums, T *partial, int pack_threads,              \
                           const int32_t *indptr, const int32_t *cols, const T *vals,             \
                           const T *bias, int64_t rows, int64_t features, int64_t tokens, T *y,   \
                           int threads, int stream) {                                             \
        const int64_t blocks = (tokens + BLOCK - 1) / BLOCK;                                      \
        if (threads != pack_threads || (threads > 1 && blocks % threads != 0)) {                  \
            csx_pack_##S(x, tokens, features, xb, sums, partial, pack_threads);                   \
            csx_spmm_##S(indptr, cols, vals, bias, rows, features, xb, tokens, y, threads,        \
                         stream);                                                                 \
            return;                                                                               \
        }                                                                                         \
        const work_t proto = {.indptr = indptr, .cols = cols, .vals = vals, .bias = bias,         \
                              .src = xb, .out = y, .features = features, .blocks = blocks,        \
                              .tokens = tokens, .rows = rows, .by_blocks = 1, .unpacked = x,      \
                              .partial = sums ? partial : 0,                                      \
                              .stream = streams_##S(stream, y, rows, tokens)};                    \
        const int used = run_threads(spmm_worker_##S, &proto, 0, blocks, threads);                \
        if (sums) add_partials_##S(sums, partial, used, features);                                \
    }

/* The weight-gradient kernels (sddmm, and the fused backward): DEFINE_GRAD_KERNELS. */
#include "_kernels_grad.c"

DEFINE_KERNELS(float, f32, int32_t)
DEFINE_KERNELS(double, f64, int64_t)
DEFINE_GRAD_KERNELS(float, f32, int32_t)
DEFINE_GRAD_KERNELS(double, f64, int64_t)
