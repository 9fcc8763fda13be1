/* y = op(x Wᵀ + b) for float32 on CPU, with W packed once into column panels.
 *
 * Why not oneDNN here: a decode step's GEMMs have few rows (one per sequence)
 * and weights far larger than the caches, so each call streams its weights
 * from memory once. oneDNN's kernels (and ours without the prefetch below)
 * then stall on the first pass over each block of weights (docs/benchmarks.md,
 * "The native GEMM", has the measurements; at prefill sizes the two are on a par).
 *
 * Layout: W (N, K) becomes panels of NR = 48 output columns, panel p holding
 * W[p*48 .. p*48+47][k] for k = 0..K-1 as K rows of 48 floats (the last
 * panel zero-padded). A tile of up to 8 rows x 48 columns keeps its 24
 * accumulators in registers over the whole K loop: per k, three loads of W and
 * eight broadcasts of x feed 24 FMAs (a 32-column tile, two loads and eight
 * broadcasts for 16 FMAs, kept the FMA units busy a smaller share of the time:
 * docs/benchmarks.md, "The native GEMM's tile").
 *
 * Order of work: rows in equal blocks of at most MC (x's block stays in L2
 * for K up to ~2000), then panels, each block's split evenly between the
 * threads (a thread with a whole block while the other has a sliver would
 * leave a core idle); within a block, 8-row tiles. While a block's tiles run
 * over panel p, each tile prefetches its share of panel p + 1, so the next
 * panel's weights arrive from memory spread over the whole panel's compute
 * instead of in one burst when its first tile starts (a lone tile, one to
 * eight rows, prefetches nothing: it streams, and the hardware prefetcher
 * keeps up). With more than one tile, K longer than KMAX runs in chunks, each
 * resuming the sums the last one stored, so a tile's rows of x stay in L1.
 *
 * Each output is one sum over k in order, in float32 with FMA: the results
 * differ from torch's matmul only in rounding (~1e-6 relative).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#ifndef KVSERVE_SOURCE_SHA256
#define KVSERVE_SOURCE_SHA256 ""
#endif
/* The SHA-256 of this file and the headers beside it as it was built (setup.py, levels.py's
   source_digest): kernels/library.py refuses a library built from another version of them. */
const char *kvserve_source_sha256(void) { return KVSERVE_SOURCE_SHA256; }

#define NR 48   /* columns per panel: three 16-float vectors */
#define MR 8    /* rows per tile */
#define MC 128  /* rows per block: a chat turn's chunk (~80 rows) streams the weights once */
#define KMAX 2048  /* longer K is split into chunks of at most KC */
#define KC 1024

enum { OP_NONE = 0, OP_SILU = 1, OP_MUL = 2, OP_ADD = 3 };

/* W (n, k) into panels, W[col][kk] at w[col * col_stride + kk * k_stride]: a weight's rows
   (k_stride 1), or Vᵀ from V's rows (col_stride 1: attention's P V, V changing every call). */
void kvserve_gemm_pack_f32(const float *w, int64_t n, int64_t k, int64_t col_stride, int64_t k_stride,
                           float *panels, int threads) {
    int64_t np = (n + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < np; ++p)
        for (int64_t kk = 0; kk < k; ++kk)
            for (int64_t j = 0; j < NR; ++j) {
                int64_t col = p * NR + j;
                panels[(p * k + kk) * NR + j] = col < n ? w[col * col_stride + kk * k_stride] : 0.0f;
            }
}

/* The epilogue on one finished row segment of up to 48 outputs. Not inlined: inside
 * a tile, its vectorised expf call made GCC keep the accumulators in memory. */
static __attribute__((noinline)) void finish_row(float *y, int ncols, const float *bias, int op, const float *other) {
    for (int j = 0; j < ncols; ++j) {
        float v = y[j] + (bias ? bias[j] : 0.0f);
        if (op == OP_SILU)   /* below -88 expf(-v) overflows (-ffast-math assumes it cannot); silu is ~0 there */
            v = v > -88.0f ? v / (1.0f + expf(-v)) : 0.0f;
        else if (op == OP_MUL)
            v *= other[j];
        else if (op == OP_ADD)
            v += other[j];
        y[j] = v;
    }
}

/* The lanes of a 16-float vector that hold one of `ncols` outputs counted from its first. */
static inline __mmask16 lanes(int ncols) {
    return ncols >= 16 ? 0xffff : ncols <= 0 ? 0 : (__mmask16)((1u << ncols) - 1);
}

/* rows x 48 outputs over k values of K (a chunk of it: `resume` continues the sums stored
   in y, `finish` applies the epilogue after the last chunk); `rows` is a constant in each
   inlined copy, so the unused accumulators vanish and the rest stay in registers. */
static inline __attribute__((always_inline)) void tile(
        const int rows, const float *x, int64_t ldx, const float *panel, int64_t k,
        const float *prefetch, int64_t prefetch_lines, float *y, int64_t ldy, int ncols,
        int resume, int finish, const float *bias, int op, const float *other, int64_t ldo) {
    int64_t due = 0;   /* prefetch_lines spread evenly over the k loop, without a division */
    const __mmask16 m0 = lanes(ncols), m1 = lanes(ncols - 16), m2 = lanes(ncols - 32);
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00,
           c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00, c40 = c00, c41 = c00,
           c42 = c00, c50 = c00, c51 = c00, c52 = c00, c60 = c00, c61 = c00, c62 = c00, c70 = c00,
           c71 = c00, c72 = c00;
    if (resume) {   /* the float32 sums stored after the last chunk: the order of k is kept */
#define LOAD(i) if (rows > i) { c##i##0 = _mm512_maskz_loadu_ps(m0, y + i * ldy); \
            c##i##1 = _mm512_maskz_loadu_ps(m1, y + i * ldy + 16); \
            c##i##2 = _mm512_maskz_loadu_ps(m2, y + i * ldy + 32); }
        LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5) LOAD(6) LOAD(7)
#undef LOAD
    }
    for (int64_t kk = 0; kk < k; ++kk) {
        const __m512 b0 = _mm512_loadu_ps(panel + kk * NR), b1 = _mm512_loadu_ps(panel + kk * NR + 16),
                     b2 = _mm512_loadu_ps(panel + kk * NR + 32);
        for (due += prefetch_lines; due >= k; due -= k, prefetch += 16)
            _mm_prefetch((const char *)prefetch, _MM_HINT_T1);
#define ROW(i) if (rows > i) { __m512 a = _mm512_set1_ps(x[i * ldx + kk]); \
            c##i##0 = _mm512_fmadd_ps(a, b0, c##i##0); c##i##1 = _mm512_fmadd_ps(a, b1, c##i##1); \
            c##i##2 = _mm512_fmadd_ps(a, b2, c##i##2); }
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7)
#undef ROW
    }
#define STORE(i) if (rows > i) { \
            _mm512_mask_storeu_ps(y + i * ldy, m0, c##i##0); _mm512_mask_storeu_ps(y + i * ldy + 16, m1, c##i##1); \
            _mm512_mask_storeu_ps(y + i * ldy + 32, m2, c##i##2); \
            if (finish && (bias || op != OP_NONE)) finish_row(y + i * ldy, ncols, bias, op, other ? other + i * ldo : 0); }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7)
#undef STORE
}

static void tile_of(int rows, const float *x, int64_t ldx, const float *panel, int64_t k,
                    const float *prefetch, int64_t prefetch_lines, float *y, int64_t ldy, int ncols,
                    int resume, int finish, const float *bias, int op, const float *other, int64_t ldo) {
#define CASE(r) case r: tile(r, x, ldx, panel, k, prefetch, prefetch_lines, y, ldy, ncols, \
                             resume, finish, bias, op, other, ldo); break;
    switch (rows) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
}

/* y (m, n; rows ldy apart) = op(x (m, k; rows ldx apart) Wᵀ + bias); `other` (rows ldo
   apart) for OP_MUL and OP_ADD. */
void kvserve_gemm_f32(const float *x, int64_t ldx, const float *panels, const float *bias,
                      float *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                      int op, const float *other, int64_t ldo, int threads) {
    const int64_t np = (n + NR - 1) / NR, nblocks = (m + MC - 1) / MC;
    /* blocks of equal size, a whole number of tiles each: 200 rows are 104 + 96, not 128 + 72 */
    const int64_t block = ((m + nblocks - 1) / nblocks + MR - 1) / MR * MR;
    /* K in equal chunks of at most KC once it is longer than KMAX, so that a tile's 8 rows of x
       stay in L1 and a block's in L2 (a 7B model's 11008-long down projection); a single tile's
       rows fit as they are, and every chunk costs a barrier */
    const int64_t nchunks = k <= KMAX || m <= MR ? 1 : (k + KC - 1) / KC, chunk = (k + nchunks - 1) / nchunks;
    #pragma omp parallel num_threads(threads)
    for (int64_t row0 = 0; row0 < m; row0 += block)
        for (int64_t k0 = 0; k0 < k; k0 += chunk) {
            const int64_t rows = m - row0 < block ? m - row0 : block, tiles = (rows + MR - 1) / MR;
            const int64_t kc = k - k0 < chunk ? k - k0 : chunk;
            /* tile t prefetches the t-th of `tiles` equal parts of the next panel's chunk
               (64-byte lines; the last part is shorter); a lone tile streams, the hardware
               prefetcher does better */
            const int64_t all_lines = kc * NR / 16, lines = (all_lines + tiles - 1) / tiles;
            #pragma omp for schedule(static)   /* every block's panels split evenly between the threads */
            for (int64_t p = 0; p < np; ++p) {
                const float *panel = panels + (p * k + k0) * NR;
                const int prefetch = p + 1 < np && tiles > 1;   /* the last panel has no next */
                const int ncols = (int)(n - p * NR < NR ? n - p * NR : NR);
                for (int64_t t = 0; t < tiles; ++t) {
                    const int64_t r = row0 + t * MR, first = t * lines;
                    const int64_t count = !prefetch || first >= all_lines ? 0
                                          : all_lines - first < lines ? all_lines - first : lines;
                    tile_of((int)(rows - t * MR < MR ? rows - t * MR : MR), x + r * ldx + k0, ldx, panel, kc,
                            count ? panel + k * NR + first * 16 : 0, count, y + r * ldy + p * NR, ldy, ncols,
                            k0 > 0, k0 + kc == k, bias ? bias + p * NR : 0, op,
                            other ? other + r * ldo + p * NR : 0, ldo);
                }
            }
        }
}
