/* Weight-gradient kernels of simulator/_kernels.c (included there, after DEFINE_KERNELS, whose
 * vector types, transpose and tile writer they use):
 *
 *   sddmm:    vals[k] = sum_{b, j} Gb[b, r, j] * Xb[b, cols[k], j] for each non-zero k (of row r,
 *             column cols[k]): the weight gradient as values in CSR order; on request also the
 *             dense gradient, G[r, cols[k]] = vals[k] and 0 elsewhere in row r.
 *   backward: dX and the weight gradient in one pass over W^T's CSR (a kernel variant, issue 46).
 *             For row c of W^T (input feature c) and each of its non-zeros j (output r = cols_t[j],
 *             weight w_j), the upstream gradient's tile Gb[b, r, :] is loaded once and used twice:
 *                 dX[b*BLOCK + t, c] += w_j * Gb[b, r, t]          (dX = dY W, as spmm over W^T)
 *                 dW_t[j] += sum_t Gb[b, r, t] * Xb[b, c, t]       (Xb[b, c, :] held in registers)
 *             so the backward streams the upstream gradient's tiles from L2 once where the split
 *             form (spmm over W^T, then sddmm) streams them and the activations' tiles. dW_t is
 *             summed in W^T's order (each thread's stretch contiguous) and scattered to W's order
 *             at the end. Measured against the split form on an AVX-512 Xeon (1 thread, 512
 *             tokens, 90% sparse): 1.2x at 1024 x 1024, 2.5x at 1024 x 4096 (the split sddmm
 *             streams 4 activation blocks of 1 MiB each), but 0.9x at 4096 x 1024 with the
 *             weight gradient summed in W's order (scattered sums, 1.7 MiB): hence W^T's order.
 *             Which form a shape runs is measured per machine (simulator.crossover).
 */

/* Prefetch into L1 the `bytes` of a tile at p (one cache line at a time), and as many at each
 * of `copies` tiles `stride` bytes apart (further token blocks). */
static inline __attribute__((always_inline)) void prefetch_tiles(const void *p, int bytes,
                                                                 int copies, int64_t stride) {
    for (int t = 0; t < copies; t++)
        for (int line = 0; line < bytes; line += 64)
            __builtin_prefetch((const char *)p + t * stride + line, 0, 3);
}

#define DEFINE_GRAD_KERNELS(T, S, I)                                                              \
    /* One row's gradient for GROUP blocks (GROUP * VECS vectors) stays in registers while each  \
     * of the row's non-zeros streams its activation tile past it: one load per FMA and one      \
     * horizontal reduction per GROUP * VECS FMAs. */                                             \
    static inline __attribute__((always_inline)) void sddmm_rows_##S(                             \
        const work_t *w, int64_t b0, int group, T *out) {                                         \
        const int64_t n = w->features, m = w->rows;                                               \
        const T *gsrc = (const T *)w->grad, *xsrc = (const T *)w->src;                            \
        for (int64_t r = w->begin; r < w->end; r++) {                                             \
            const int32_t kbegin = w->indptr[r], kend = w->indptr[r + 1];                         \
            if (kbegin == kend) continue;                                                         \
            vec_##S g[SDDMM_VECS_##S];                                                            \
            for (int i = 0; i < group * VECS_##S; i++)                                            \
                g[i] = ((const vec_##S *)(gsrc + ((b0 + i / VECS_##S) * m + r) * BLOCK))          \
                    [i % VECS_##S];                                                               \
            for (int32_t k = kbegin; k < kend; k++) {                                             \
                const T *x = xsrc + (b0 * n + w->cols[k]) * BLOCK;                                \
                vec_##S acc[SDDMM_ACCS] = {{0}};                                                  \
                for (int i = 0; i < group * VECS_##S; i++)                                        \
                    acc[i % SDDMM_ACCS] += g[i] *                                                 \
                        ((const vec_##S *)(x + (i / VECS_##S) * n * BLOCK))[i % VECS_##S];        \
                for (int a = 1; a < SDDMM_ACCS; a++) acc[0] += acc[a];                            \
                out[k] += HSUM_##S(acc[0]);                                                       \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* Rows [begin, end) of the dense gradient [rows, features] (w->dense): zeroed, then the      \
     * row's values (w->out, CSR order) scattered in. */                                          \
    static void dense_rows_worker_##S(const work_t *w) {                                          \
        const int64_t n = w->features;                                                            \
        const T *sums = (const T *)w->out;                                                        \
        T *grad = (T *)w->dense;                                                                  \
        for (int64_t r = w->begin; r < w->end; r++) {                                             \
            T *row = grad + r * n;                                                                \
            for (int64_t c = 0; c < n; c++) row[c] = 0;                                           \
            for (int32_t k = w->indptr[r]; k < w->indptr[r + 1]; k++) row[w->cols[k]] = sums[k];  \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* The sums accumulate over the token groups in the output values themselves: CSR order, so  \
     * each thread's rows own one contiguous, L2-sized stretch of them (summing in a dense        \
     * gradient instead touched a scattered cache line per non-zero and group, measured 1.5x     \
     * slower at 4096 x 1024 and 2048 tokens). Only when a dense gradient is asked for does a    \
     * second pass write its rows, by the same thread while its sums are still in cache. */      \
    static void sddmm_worker_##S(const work_t *w) {                                               \
        T *sums = (T *)w->out;                                                                    \
        for (int64_t k = w->indptr[w->begin]; k < w->indptr[w->end]; k++) sums[k] = 0;            \
        int64_t b0 = 0;                                                                           \
        for (; b0 + SDDMM_GROUP_##S <= w->blocks; b0 += SDDMM_GROUP_##S)                          \
            sddmm_rows_##S(w, b0, SDDMM_GROUP_##S, sums);                                         \
        for (; b0 < w->blocks; b0++) sddmm_rows_##S(w, b0, 1, sums);                              \
        if (w->dense) dense_rows_worker_##S(w);                                                   \
    }                                                                                             \
                                                                                                  \
    void csx_sddmm_##S(const int32_t *indptr, const int32_t *cols, int64_t rows,                 \
                       int64_t features, const T *gb, const T *xb, int64_t blocks, T *vals,       \
                       T *dense, int threads) {                                                   \
        const work_t proto = {.indptr = indptr, .cols = cols, .src = xb, .grad = gb,              \
                              .out = vals, .dense = dense, .features = features,                  \
                              .blocks = blocks, .rows = rows};                                    \
        run_threads(sddmm_worker_##S, &proto, indptr, rows, threads);                             \
    }                                                                                             \
                                                                                                  \
    /* The dense gradient [rows, features] holding `vals` (CSR order) at the pattern's non-zeros  \
     * and 0 elsewhere, rows split by non-zeros. */                                               \
    void csx_dense_rows_##S(const int32_t *indptr, const int32_t *cols, int64_t rows,            \
                            int64_t features, const T *vals, T *dense, int threads) {            \
        const work_t proto = {.indptr = indptr, .cols = cols, .out = (void *)vals,                \
                              .dense = dense, .features = features, .rows = rows};                \
        run_threads(dense_rows_worker_##S, &proto, indptr, rows, threads);                        \
    }                                                                                             \
                                                                                                  \
    /* Rows [begin, end) of W^T in token blocks b .. b + group - 1 (group 1 or 2, a constant at  \
     * each call), their upstream gradient packed in gb (block after block): LANES rows at a     \
     * time, each row's activation tiles in registers while its non-zeros stream their upstream  \
     * tiles past them (one horizontal sum per non-zero and group); dX rows go through L1 tiles \
     * and write_tile, as spmm's output does. dX sums a row's non-zeros in order, sums[j] a     \
     * group at a time. */                                                                       \
    static inline __attribute__((always_inline)) void backward_blocks_##S(                        \
        const work_t *w, int64_t b, int group, const T *gb) {                                     \
        enum { V = VECS_##S };                                                                    \
        const int64_t n = w->rows, m = w->features; /* W^T is [n, m] */                           \
        const T *vals = (const T *)w->vals;                                                       \
        T *sums = (T *)w->dense;                                                                  \
        const T *xb = (const T *)w->src + b * n * BLOCK;                                          \
        const int32_t last = w->indptr[w->end]; /* past this thread's last non-zero */           \
        vec_##S tile[2][LANES_##S][V];                                                            \
        for (int64_t c0 = w->begin; c0 < w->end; c0 += LANES_##S) {                               \
            const int64_t c1 = c0 + LANES_##S < w->end ? c0 + LANES_##S : w->end;                 \
            for (int64_t c = c0; c < c1; c++) {                                                   \
                vec_##S x[2 * V], a[2 * V];                                                       \
                for (int i = 0; i < group * V; i++) {                                             \
                    x[i] = ((const vec_##S *)(xb + ((i / V) * n + c) * BLOCK))[i % V];            \
                    a[i] = (vec_##S){0};                                                          \
                }                                                                                 \
                for (int32_t j = w->indptr[c]; j < w->indptr[c + 1]; j++) {                       \
                    if (w->prefetch) /* the upstream tiles of non-zero j+d (this thread's) */    \
                        prefetch_tiles(gb + (int64_t)w->cols[j + w->prefetch < last              \
                                                             ? j + w->prefetch : last - 1] * BLOCK, \
                                       BLOCK * sizeof(T), group, m * BLOCK * sizeof(T));         \
                    const T *g = gb + (int64_t)w->cols[j] * BLOCK;                                \
                    const T v = vals[j];                                                          \
                    vec_##S acc[SDDMM_ACCS] = {{0}};                                              \
                    for (int i = 0; i < group * V; i++) {                                         \
                        const vec_##S d = ((const vec_##S *)(g + (i / V) * m * BLOCK))[i % V];    \
                        a[i] += v * d;                                                            \
                        acc[i % SDDMM_ACCS] += d * x[i];                                          \
                    }                                                                             \
                    for (int s = 1; s < SDDMM_ACCS; s++) acc[0] += acc[s];                        \
                    sums[j] += HSUM_##S(acc[0]);                                                  \
                }                                                                                 \
                for (int i = 0; i < group * V; i++) tile[i / V][c - c0][i % V] = a[i];            \
            }                                                                                     \
            for (int k = 0; k < group; k++) {                                                     \
                const int64_t left = w->tokens - (b + k) * BLOCK;                                 \
                write_tile_##S(tile[k], c0, c1, b + k, left < BLOCK ? left : BLOCK, n,            \
                               (T *)w->out, w->stream);                                           \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* dX [tokens, n] and the weight gradient (values in W's CSR order, `grad_values`) from the   \
     * CSR of W^T (indptr_t, cols_t, its values vals_t, order = W^T's position -> W's), the      \
     * token-major upstream gradient g [tokens, m] and the packed activations xb [blocks, n,     \
     * BLOCK]; with bias_sums, also g's column sums (the bias gradient). `group` token blocks    \
     * (1 or 2) go through each pass over W^T: two halve the horizontal sums and the passes, at  \
     * twice the upstream tiles held in L2 (measured 1.1x faster at 1024 x 1024 and 512 tokens,  \
     * 0.67x at 4096 x 1024 on an AVX-512 Xeon: a variant). `scratch` holds nnz sums in W^T's    \
     * order, `buffers` one group of packed blocks of g per thread: every thread packs each group \
     * whole into its own buffer and then computes its rows of it, with no barrier, so the       \
     * tiles it reads are in its own L2. Packing a shared group instead (each thread its share   \
     * of g's features, one barrier per group) made each thread read half its tiles from the    \
     * other core's L2: measured on a 2-core AVX-512 Xeon (1024^2, 512 tokens) the private pack \
     * is 1.27x faster at 97% and 1.08x at 90%, though every thread packs all of g. Rows of W^T   \
     * are split by non-zeros, and every feature's bias sum is taken by one thread (the owner of \
     * its share of features), so every thread count gives the same bits. */                   \
    void csx_backward_##S(const int32_t *indptr_t, const int32_t *cols_t, const T *vals_t,       \
                          const int64_t *order, int64_t n, int64_t m, const T *g, T *bias_sums,   \
                          const T *xb, int64_t tokens, T *dx, T *scratch, T *grad_values,         \
                          T *buffers, int group, int threads, int stream, int prefetch) {         \
        if (threads > MAX_THREADS) threads = MAX_THREADS;                                         \
        if (threads > n) threads = (int)n;                                                        \
        if (threads < 1) threads = 1;                                                             \
        const int64_t blocks = (tokens + BLOCK - 1) / BLOCK;                                      \
        const int64_t vectors = (m + LANES_##S - 1) / LANES_##S; /* g's features, in vectors */  \
        int64_t rows[MAX_THREADS + 1];                                                            \
        split(indptr_t, n, threads, rows);                                                        \
        work_t work[MAX_THREADS];                                                                 \
        for (int i = 0; i < threads; i++)                                                         \
            work[i] = (work_t){.indptr = indptr_t, .cols = cols_t, .vals = vals_t, .src = xb,     \
                               .out = dx, .dense = scratch, .features = m, .begin = rows[i],      \
                               .end = rows[i + 1], .tokens = tokens, .rows = n, .thread = i,      \
                               .stream = streams_##S(stream, dx, n, tokens),                      \
                               .prefetch = prefetch};                                             \
        _Pragma("omp parallel num_threads(threads)") {                                            \
            const int team = TEAM_SIZE(), id = TEAM_MEMBER(); /* 1 and 0 without OpenMP */      \
            for (int i = id; i < threads; i += team) {                                            \
                for (int32_t j = indptr_t[rows[i]]; j < indptr_t[rows[i + 1]]; j++)               \
                    scratch[j] = 0;                                                               \
                const int64_t f0 = vectors * i / threads * LANES_##S;                             \
                const int64_t f1 = vectors * (i + 1) / threads * LANES_##S;                       \
                for (int64_t c = f0; bias_sums && c < f1 && c < m; c++) bias_sums[c] = 0;         \
            }                                                                                     \
            T *gb = buffers + (int64_t)id * group * m * BLOCK; /* this member's own copy */    \
            for (int64_t b = 0; b < blocks; b += group) {                                         \
                const int here = b + group <= blocks ? group : 1; /* a last single block */     \
                for (int i = 0; i < threads; i++) {                                               \
                    const int64_t f0 = vectors * i / threads * LANES_##S;                         \
                    const int64_t f1 = vectors * (i + 1) / threads * LANES_##S;                   \
                    pack_blocks_##S(g, tokens, m, b, b + here, f0, f1 < m ? f1 : m, b, gb,        \
                                    i % team == id ? bias_sums : 0);                              \
                }                                                                                 \
                for (int i = id; i < threads; i += team) {                                        \
                    if (here == 2)                                                                \
                        backward_blocks_##S(&work[i], b, 2, gb);                                  \
                    else                                                                          \
                        backward_blocks_##S(&work[i], b, 1, gb);                                  \
                }                                                                                 \
            }                                                                                     \
            for (int i = id; i < threads; i += team) {                                            \
                if (work[i].stream) STREAM_FENCE();                                               \
                for (int32_t j = indptr_t[rows[i]]; j < indptr_t[rows[i + 1]]; j++)               \
                    grad_values[order[j]] = scratch[j];                                           \
            }                                                                                     \
        }                                                                                         \
    }
