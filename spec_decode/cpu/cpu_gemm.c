/* Small-batch float32 projections for AVX2 CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ b[N]).
 *
 * Built and loaded by spec_decode/cpu/cpu_gemm.py (see its docstring for why and when it is used).
 *
 * W comes packed in panels of 16 output columns, [ceil(N / 16), K, 16] (zero padded), so a
 * microkernel streams each panel once, contiguously, for a block of up to 6 rows of x. Every
 * output starts at bias (or 0) and takes one fused multiply-add per k, acc = fma(x[m, k],
 * W[n, k], acc), for k = 0, 1, ..., K - 1 in that order. So an output depends neither on M nor on
 * the other rows (batch invariant), and a torch loop over k that emulates each FMA exactly gives
 * the same bits (reference_panel_linear in cpu_gemm.py). NaN and Inf propagate as IEEE arithmetic
 * says. The panels hold float32 or bf16 weights (panels_bf16): bf16 goes up to float32 exactly as
 * it is loaded, so both give the same bits for the same values, and bf16 streams half the bytes.
 * The functions carry target("avx2,fma"): the file builds with any flags, and cpu_gemm.py calls
 * it only on a CPU that has both.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16
#define MAX_BLOCK_ROWS 6

/* Eight weights from element i of the panels, as float32: bf16 bits are a float32's high half. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) __m256
load_w(const void *panels, size_t i, const int WB) {
    if (WB) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)panels + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)panels + i);
}

/* R rows x P panels of accumulators: R * P * 2 ymm registers (at most 12 of the 16). WB: bf16 panels. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
micro(const int R, const int P, const int WB, int K, int N, const float *x, const void *panels,
      const float *bias, float *y, int panel0, int num_panels) {
    __m256 acc[MAX_BLOCK_ROWS][4][2];
    for (int p = 0; p < P; p++) {
        const float *b = bias ? bias + (size_t)(panel0 + p) * PANEL : NULL;
        __m256 b0 = b ? _mm256_loadu_ps(b) : _mm256_setzero_ps();
        __m256 b1 = b ? _mm256_loadu_ps(b + 8) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            acc[r][p][0] = b0;
            acc[r][p][1] = b1;
        }
    }
    /* A block of 4 or more rows streams one panel at a time (WIDE_PANELS), and one stream leaves most of
     * the memory bandwidth idle when the weights come from DRAM (a float32 target overflows the L3):
     * each k also prefetches its line of the next panel, one panel (K lines) ahead. Fewer rows run
     * 2-4 panels side by side, where prefetching measured slower. No arithmetic changes. */
    const char *next = (const char *)panels + ((size_t)(panel0 + 1) * K * PANEL << (WB ? 1 : 2));
    const int prefetch = R >= 4 && panel0 + 1 < num_panels;
    for (int k = 0; k < K; k++) {
        size_t w = ((size_t)panel0 * K + k) * PANEL;   /* element offset of this k in the first panel */
        if (prefetch && (!WB || (k & 1) == 0))   /* 16 bf16 weights are half a cache line */
            _mm_prefetch(next + ((size_t)k * PANEL << (WB ? 1 : 2)), _MM_HINT_T0);
        for (int r = 0; r < R; r++) {   /* one broadcast live at a time: the accumulators keep the registers */
            __m256 xv = _mm256_broadcast_ss(x + (size_t)r * K + k);
            for (int p = 0; p < P; p++) {
                size_t wp = w + (size_t)p * K * PANEL;
                acc[r][p][0] = _mm256_fmadd_ps(xv, load_w(panels, wp, WB), acc[r][p][0]);
                acc[r][p][1] = _mm256_fmadd_ps(xv, load_w(panels, wp + 8, WB), acc[r][p][1]);
            }
        }
    }
    for (int p = 0; p < P; p++) {
        int n0 = (panel0 + p) * PANEL;
        int valid = N - n0 < PANEL ? N - n0 : PANEL;
        for (int r = 0; r < R; r++) {
            float *out = y + (size_t)r * N + n0;
            if (valid == PANEL) {
                _mm256_storeu_ps(out, acc[r][p][0]);
                _mm256_storeu_ps(out + 8, acc[r][p][1]);
            } else {   /* the zero-padded last panel: keep its real columns */
                float tmp[PANEL];
                _mm256_storeu_ps(tmp, acc[r][p][0]);
                _mm256_storeu_ps(tmp + 8, acc[r][p][1]);
                memcpy(out, tmp, (size_t)valid * sizeof(float));
            }
        }
    }
}

/* Panels per microkernel call for a block of R rows: as many accumulators as the registers hold. */
#define WIDE_PANELS(R) ((R) == 1 ? 4 : (R) == 2 ? 3 : (R) == 3 ? 2 : 1)

#define ROW_BLOCK(R, WB)                                                                 \
    do {                                                                                 \
        int p = 0;                                                                       \
        for (; p + WIDE_PANELS(R) <= num_panels; p += WIDE_PANELS(R))                    \
            micro(R, WIDE_PANELS(R), WB, K, N, x, panels, bias, y, p, num_panels);       \
        for (; p < num_panels; p++) micro(R, 1, WB, K, N, x, panels, bias, y, p, num_panels); \
    } while (0)

#define ROW_BLOCKS(WB)                      \
    switch (R) {                            \
    case 1: ROW_BLOCK(1, WB); break;        \
    case 2: ROW_BLOCK(2, WB); break;        \
    case 3: ROW_BLOCK(3, WB); break;        \
    case 4: ROW_BLOCK(4, WB); break;        \
    case 5: ROW_BLOCK(5, WB); break;        \
    default: ROW_BLOCK(6, WB); break;       \
    }

__attribute__((target("avx2,fma"))) static void row_block(int R, int K, int N, const float *x, const void *panels,
                                                      int panels_bf16, const float *bias, float *y) {
    int num_panels = (N + PANEL - 1) / PANEL;
    if (panels_bf16) {
        ROW_BLOCKS(1)
    } else {
        ROW_BLOCKS(0)
    }
}

/* x: [M, K] row-major; panels: [ceil(N / 16), K, 16], float32 or (panels_bf16) bf16; bias:
 * [ceil(N / 16) * 16] float32 or NULL; y: [M, N]. */
__attribute__((target("avx2,fma"))) void safespec_panel_linear(int M, int K, int N, const float *x, const void *panels,
                                                           int panels_bf16, const float *bias, float *y) {
    for (int m0 = 0; m0 < M; m0 += MAX_BLOCK_ROWS) {
        int rows = M - m0 < MAX_BLOCK_ROWS ? M - m0 : MAX_BLOCK_ROWS;
        row_block(rows, K, N, x + (size_t)m0 * K, panels, panels_bf16, bias, y + (size_t)m0 * N);
    }
}

/* bf16 -> float32 is exact: the bf16 bits are the high half of the float32's. */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bf16, rounded to nearest even, as torch's scalar conversion (NaN -> a quiet NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The same projection for bf16 x and y: x goes up to float32 (exactly), the float32 result of
 * safespec_panel_linear rounds to bf16 once. A block of rows at a time, through small buffers.
 * Returns 0, or -1 when the buffers cannot be allocated (y is then left as it was). */
__attribute__((target("avx2,fma"))) int safespec_panel_linear_bf16(int M, int K, int N, const uint16_t *x,
                                                               const void *panels, int panels_bf16,
                                                               const float *bias, uint16_t *y) {
    float *xf = malloc(sizeof(float) * (size_t)MAX_BLOCK_ROWS * (K > 0 ? K : 1));
    float *yf = malloc(sizeof(float) * (size_t)MAX_BLOCK_ROWS * (N > 0 ? N : 1));
    if (!xf || !yf) {
        free(xf);
        free(yf);
        return -1;
    }
    for (int m0 = 0; m0 < M; m0 += MAX_BLOCK_ROWS) {
        int rows = M - m0 < MAX_BLOCK_ROWS ? M - m0 : MAX_BLOCK_ROWS;
        for (size_t i = 0; i < (size_t)rows * K; i++) xf[i] = bf16_to_f32(x[(size_t)m0 * K + i]);
        row_block(rows, K, N, xf, panels, panels_bf16, bias, yf);
        for (size_t i = 0; i < (size_t)rows * N; i++) y[(size_t)m0 * N + i] = f32_to_bf16(yf[i]);
    }
    free(xf);
    free(yf);
    return 0;
}
