/* Small-batch float32 projections for AVX2 CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ b[N]); and, at the
 * end of the file, the batch-invariant attention (safespec_attention).
 *
 * Built and loaded by spec_decode/cpu/cpu_gemm.py (see its docstring for why and when it is used).
 *
 * W comes packed in panels of 16 output columns, [ceil(N / 16), K, 16] (zero padded), so a
 * microkernel streams a few panels (or, on AVX2, octets: half panels) contiguously, for a block of
 * up to 6 rows of x (12 on AVX-512F). Every
 * output starts at bias (or 0) and takes one fused multiply-add per k, acc = fma(x[m, k],
 * W[n, k], acc), for k = 0, 1, ..., K - 1 in that order. So an output depends neither on M nor on
 * the other rows (batch invariant), and a torch loop over k that emulates each FMA exactly gives
 * the same bits (reference_panel_linear in cpu_gemm.py). NaN and Inf propagate as IEEE arithmetic
 * says. The panels hold float32 or bf16 weights (panels_bf16): bf16 goes up to float32 exactly as
 * it is loaded, so both give the same bits for the same values, and bf16 streams half the bytes.
 * The functions carry target("avx2,fma") (or "avx512f" for the 16-lane path below, taken at run time
 * where the CPU has it): the file builds with any flags, and cpu_gemm.py calls it only on a CPU that
 * has AVX2 and FMA.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16
#define MAX_BLOCK_ROWS 6

/* 8 float32 values from element i of a float32 or (BF) bf16 array (weights, activations, K/V rows), widened
 * exactly: bf16 bits are a float32's high half. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) __m256
load8(const void *p, size_t i, const int BF) {
    if (BF) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

/* Output columns per AVX2 register: a panel is two octets, octet o is half o & 1 of panel o >> 1. */
#define OCTET 8
#define MAX_OCTETS 8

/* Element offset of octet o's eight weights at k. */
static inline size_t octet_at(int o, int K, int k) {
    return ((size_t)(o >> 1) * K + k) * PANEL + (size_t)(o & 1) * OCTET;
}

/* [a.lo, b.lo], and [a.hi, b.hi] into *hi: columns {0-7} and {8-15} of a panel as {0-3, 8-11} and {4-7, 12-15}
 * (the order unpacking a panel's bf16 words gives), or back. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) __m256
interleave_lanes(__m256 a, __m256 b, __m256 *hi) {
    *hi = _mm256_permute2f128_ps(a, b, 0x31);
    return _mm256_permute2f128_ps(a, b, 0x20);
}

/* R rows x Q octets of accumulators: R * Q ymm registers. WB: bf16 panels, each weight vector widened
 * once a k for all rows (from 2 rows, or whole panels at any row count), so the accumulators, the Q
 * widened vectors and one broadcast share the 16 registers. Octets rather than whole panels let a block
 * of 2 or 3 rows fit that budget (5 and 3 octets) without re-widening a vector per row. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
micro(const int R, const int Q, const int WB, int K, int N, const float *x, const void *panels,
      const float *bias, float *y, int octet0, int num_panels) {
    __m256 acc[MAX_BLOCK_ROWS][MAX_OCTETS];
    /* Two bf16 octets of one panel: its 16 weights at k are one 32-byte load, and unpacking its words
     * against zeros widens them in two instructions instead of four (fewer instructions a weight, which
     * counts even for one row: its loop is not bound by memory alone). The unpack works within each 128-bit
     * lane, so the two accumulators of a row hold the columns {0-3, 8-11} and {4-7, 12-15}; the bias goes in
     * and the sums come out in that order. Each column's FMA chain is unchanged. */
    const int paired = WB && Q % 2 == 0 && (octet0 & 1) == 0;
    for (int q = 0; q < Q; q++) {
        __m256 b = bias ? _mm256_loadu_ps(bias + (size_t)(octet0 + q) * OCTET) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) acc[r][q] = b;
    }
    if (paired)
        for (int r = 0; r < R; r++)
            for (int q = 0; q < Q; q += 2) acc[r][q] = interleave_lanes(acc[r][q], acc[r][q + 1], &acc[r][q + 1]);
    /* A block of 4 or more rows streams few panels at once, and few streams leave most of the memory
     * bandwidth idle when the weights come from DRAM (a float32 target overflows the L3): each k also
     * prefetches its line of the panel after this call's last. Fewer rows run more panels side by side,
     * where prefetching measured slower. No arithmetic changes. */
    const int next_panel = ((octet0 + Q - 1) >> 1) + 1;
    const char *next = (const char *)panels + ((size_t)next_panel * K * PANEL << (WB ? 1 : 2));
    const int prefetch = R >= 4 && next_panel < num_panels;
    for (int k = 0; k < K; k++) {
        if (prefetch && (!WB || (k & 1) == 0))   /* 16 bf16 weights are half a cache line */
            _mm_prefetch(next + ((size_t)k * PANEL << (WB ? 1 : 2)), _MM_HINT_T0);
        if (WB && (R >= 2 || paired)) {   /* widen each weight vector once for all rows */
            __m256 wv[MAX_OCTETS];
            if (paired) {
                for (int q = 0; q < Q; q += 2) {
                    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panels +
                                                                          octet_at(octet0 + q, K, k)));
                    wv[q] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), h));
                    wv[q + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), h));
                }
            } else {
                for (int q = 0; q < Q; q++) wv[q] = load8(panels, octet_at(octet0 + q, K, k), 1);
            }
            for (int r = 0; r < R; r++) {
                __m256 xv = _mm256_broadcast_ss(x + (size_t)r * K + k);
                for (int q = 0; q < Q; q++) acc[r][q] = _mm256_fmadd_ps(xv, wv[q], acc[r][q]);
            }
        } else {    /* one broadcast live at a time: the accumulators keep the registers */
            for (int r = 0; r < R; r++) {
                __m256 xv = _mm256_broadcast_ss(x + (size_t)r * K + k);
                for (int q = 0; q < Q; q++)
                    acc[r][q] = _mm256_fmadd_ps(xv, load8(panels, octet_at(octet0 + q, K, k), WB), acc[r][q]);
            }
        }
    }
    if (paired)   /* back to column order: interleaving the lanes twice is the identity */
        for (int r = 0; r < R; r++)
            for (int q = 0; q < Q; q += 2) acc[r][q] = interleave_lanes(acc[r][q], acc[r][q + 1], &acc[r][q + 1]);
    for (int q = 0; q < Q; q++) {
        int n0 = (octet0 + q) * OCTET;
        int valid = N - n0 < OCTET ? N - n0 : OCTET;
        for (int r = 0; r < R; r++) {
            float *out = y + (size_t)r * N + n0;
            if (valid == OCTET) {
                _mm256_storeu_ps(out, acc[r][q]);
            } else {   /* the zero-padded last octet: keep its real columns */
                float tmp[OCTET];
                _mm256_storeu_ps(tmp, acc[r][q]);
                memcpy(out, tmp, (size_t)valid * sizeof(float));
            }
        }
    }
}

/* Octets per microkernel call for a block of R rows: accumulators and widened weights within the
 * 16 registers. */
#define WIDE_OCTETS(R) ((R) == 1 ? 8 : (R) == 2 ? 5 : (R) == 3 ? 3 : 2)

#define ROW_BLOCK(R, WB)                                                                  \
    do {                                                                                  \
        int o = 0;                                                                        \
        for (; o + WIDE_OCTETS(R) <= num_octets; o += WIDE_OCTETS(R))                     \
            micro(R, WIDE_OCTETS(R), WB, K, N, x, panels, bias, y, o, num_panels);        \
        for (; o < num_octets; o++) micro(R, 1, WB, K, N, x, panels, bias, y, o, num_panels); \
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
    int num_panels = (N + PANEL - 1) / PANEL, num_octets = (N + OCTET - 1) / OCTET;
    if (panels_bf16) {
        ROW_BLOCKS(1)
    } else {
        ROW_BLOCKS(0)
    }
}

/* ------------------------------------------------------------------------------------------------
 * The same projection on AVX-512F CPUs: a panel of 16 outputs is one zmm register, so each row and panel
 * takes one 16-lane FMA per k where the AVX2 path takes two 8-lane ones, and the 32 registers let up to
 * MAX_BLOCK_ROWS_512 rows share every loaded weight vector. Lanes run across outputs only: each output
 * still starts at bias (or 0) and takes acc = fma(x[m, k], W[n, k], acc) for k = 0, 1, ..., K - 1 in that
 * order, one rounding per FMA, so it gives the AVX2 path's bits (and reference_panel_linear's) exactly.
 * Chosen at run time (safespec_panel_isa) when the CPU and OS support AVX-512F; the AVX2 path is unchanged.
 */
#define MAX_BLOCK_ROWS_512 12
#define MAX_PANELS_512 6

/* Sixteen weights from element i of the panels, as float32 (bf16 widened exactly, as load8). */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) __m512
load_w16(const void *panels, size_t i, const int WB) {
    if (WB) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panels + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)panels + i);
}

/* R rows x P panels of accumulators: R * P zmm registers (at most 24 of the 32) and P weight vectors.
 * WB: bf16 panels. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void
micro512(const int R, const int P, const int WB, int K, int N, const float *x, const void *panels,
         const float *bias, float *y, int panel0, int num_panels) {
    __m512 acc[MAX_BLOCK_ROWS_512][MAX_PANELS_512];
    for (int p = 0; p < P; p++) {
        __m512 b0 = bias ? _mm512_loadu_ps(bias + (size_t)(panel0 + p) * PANEL) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) acc[r][p] = b0;
    }
    /* the panels after this call's, one call ahead (see micro: a single stream leaves bandwidth idle) */
    const char *next = (const char *)panels + ((size_t)(panel0 + P) * K * PANEL << (WB ? 1 : 2));
    const int prefetch = R >= 4 && panel0 + P < num_panels;   /* as micro: fewer rows measured slower with it */
    const int ahead = num_panels - panel0 - P < P ? num_panels - panel0 - P : P;
    for (int k = 0; k < K; k++) {
        size_t w = ((size_t)panel0 * K + k) * PANEL;
        if (prefetch && (!WB || (k & 1) == 0))
            for (int p = 0; p < ahead; p++)
                _mm_prefetch(next + (((size_t)p * K + k) * PANEL << (WB ? 1 : 2)), _MM_HINT_T0);
        __m512 wv[MAX_PANELS_512];
        for (int p = 0; p < P; p++) wv[p] = load_w16(panels, w + (size_t)p * K * PANEL, WB);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_set1_ps(x[(size_t)r * K + k]);
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
        }
    }
    for (int p = 0; p < P; p++) {
        int n0 = (panel0 + p) * PANEL;
        int valid = N - n0 < PANEL ? N - n0 : PANEL;
        __mmask16 keep = (__mmask16)((1u << valid) - 1u);   /* the zero-padded last panel: its real columns */
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (size_t)r * N + n0, keep, acc[r][p]);
    }
}

/* Panels per call for a block of R rows: R * P accumulators plus P weight vectors within the 32 registers.
 * Few rows run more panels side by side (more weight streams in flight where the layer comes from memory). */
#define WIDE_PANELS_512(R) ((R) <= 2 ? 6 : (R) <= 6 ? 4 : (R) <= 8 ? 3 : 2)

#define ROW_BLOCK_512(R, WB)                                                                  \
    do {                                                                                      \
        int p = 0;                                                                            \
        for (; p + WIDE_PANELS_512(R) <= num_panels; p += WIDE_PANELS_512(R))                 \
            micro512(R, WIDE_PANELS_512(R), WB, K, N, x, panels, bias, y, p, num_panels);     \
        for (; p < num_panels; p++) micro512(R, 1, WB, K, N, x, panels, bias, y, p, num_panels); \
    } while (0)

#define ROW_BLOCKS_512(WB)                      \
    switch (R) {                                \
    case 1: ROW_BLOCK_512(1, WB); break;        \
    case 2: ROW_BLOCK_512(2, WB); break;        \
    case 3: ROW_BLOCK_512(3, WB); break;        \
    case 4: ROW_BLOCK_512(4, WB); break;        \
    case 5: ROW_BLOCK_512(5, WB); break;        \
    case 6: ROW_BLOCK_512(6, WB); break;        \
    case 7: ROW_BLOCK_512(7, WB); break;        \
    case 8: ROW_BLOCK_512(8, WB); break;        \
    case 9: ROW_BLOCK_512(9, WB); break;        \
    case 10: ROW_BLOCK_512(10, WB); break;      \
    case 11: ROW_BLOCK_512(11, WB); break;      \
    default: ROW_BLOCK_512(12, WB); break;      \
    }

__attribute__((target("avx512f"))) static void row_block_512(int R, int K, int N, const float *x, const void *panels,
                                                            int panels_bf16, const float *bias, float *y) {
    int num_panels = (N + PANEL - 1) / PANEL;
    if (panels_bf16) {
        ROW_BLOCKS_512(1)
    } else {
        ROW_BLOCKS_512(0)
    }
}

/* ------------------------------------------------------------------------------------------------ dispatch
 * 0: not chosen yet; 1: AVX2 (8 lanes); 2: AVX-512F (16 lanes). Both give the same bits for every
 * input, so the choice changes speed only. */
static int panel_isa = 0;

static int best_isa(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 2 : 1;   /* libgcc checks the OS saves the zmm state */
}

/* Set the path (1: AVX2, 2: AVX-512F, 0: the best this CPU supports) and return the one in use:
 * asking for AVX-512F where the CPU lacks it keeps AVX2. Tests force each path through it. */
int safespec_panel_isa(int want) {
    int best = best_isa();
    panel_isa = want == 1 ? 1 : want == 2 ? best : want == 0 ? best : (panel_isa ? panel_isa : best);
    return panel_isa;
}

static inline int isa(void) {
    if (!panel_isa) panel_isa = best_isa();
    return panel_isa;
}

/* The core's float32 FMA peak, for measurements (spec-bench gemm): PEAK_CHAINS independent accumulators of
 * 8 (AVX2) or 16 (AVX-512F) lanes, one FMA each a step, enough chains to hide the FMA latency on every x86
 * core we know. Returns a value that depends on every chain, so the compiler keeps them all. */
#define PEAK_CHAINS 12

__attribute__((target("avx2,fma"))) static float fma_peak_avx2(long steps) {
    __m256 acc[PEAK_CHAINS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-6f);
    for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm256_set1_ps((float)c);
    for (long i = 0; i < steps; i++)
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    float out[8], sum = 0.0f;
    for (int c = 0; c < PEAK_CHAINS; c++) {
        _mm256_storeu_ps(out, acc[c]);
        sum += out[0];
    }
    return sum;
}

__attribute__((target("avx512f"))) static float fma_peak_avx512(long steps) {
    __m512 acc[PEAK_CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-6f);
    for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
    for (long i = 0; i < steps; i++)
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    float sum = 0.0f;
    for (int c = 0; c < PEAK_CHAINS; c++) sum += _mm512_reduce_add_ps(acc[c]);
    return sum;
}

/* steps x PEAK_CHAINS FMAs of 8 lanes (isa 1) or 16 (isa 2, where the CPU has AVX-512F; else AVX2). Returns
 * the lanes per FMA it ran, and writes the chains' value to *sink. */
int safespec_fma_peak(int want_isa, long steps, float *sink) {
    if (want_isa == 2 && best_isa() == 2) {
        *sink = fma_peak_avx512(steps);
        return 16;
    }
    *sink = fma_peak_avx2(steps);
    return 8;
}

/* Rows per block: AVX-512F splits M into near-equal blocks of at most MAX_BLOCK_ROWS_512 rows; AVX2 takes
 * blocks of MAX_BLOCK_ROWS and the rest last, which measured faster than near-equal blocks there (a block's
 * size changes no output: every row's outputs are the same chains in any block). */
static inline int block_rows(int M, int m0, int avx512) {
    if (!avx512) return M - m0 < MAX_BLOCK_ROWS ? M - m0 : MAX_BLOCK_ROWS;
    int left = M - m0, blocks = (left + MAX_BLOCK_ROWS_512 - 1) / MAX_BLOCK_ROWS_512;
    return (left + blocks - 1) / blocks;
}

/* A lone row with float32 panels stays on the AVX2 path even where AVX-512F is chosen: there the layer is
 * read from memory at one FMA per weight, and the 8-lane loop measured faster. Either path gives the same bits. */
static void any_row_block(int avx512, int R, int K, int N, const float *x, const void *panels, int panels_bf16,
                          const float *bias, float *y) {
    if (avx512 && (R > 1 || panels_bf16)) row_block_512(R, K, N, x, panels, panels_bf16, bias, y);
    else row_block(R, K, N, x, panels, panels_bf16, bias, y);
}

/* x: [M, K] row-major; panels: [ceil(N / 16), K, 16], float32 or (panels_bf16) bf16; bias:
 * [ceil(N / 16) * 16] float32 or NULL; y: [M, N]. */
void safespec_panel_linear(int M, int K, int N, const float *x, const void *panels, int panels_bf16,
                           const float *bias, float *y) {
    int avx512 = isa() == 2;
    for (int m0 = 0; m0 < M;) {
        int rows = block_rows(M, m0, avx512);
        any_row_block(avx512, rows, K, N, x + (size_t)m0 * K, panels, panels_bf16, bias, y + (size_t)m0 * N);
        m0 += rows;
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


static inline float load1(const void *p, size_t i, const int BF) {
    return BF ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float round_as(float f, const int BF) { return BF ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline void store1(void *p, size_t i, float f, const int BF) {
    if (BF) ((uint16_t *)p)[i] = f32_to_bf16(f);
    else ((float *)p)[i] = f;
}

/* Eight float32 values rounded to bf16 lane by lane exactly as f32_to_bf16 rounds one (NaN -> 0x7fc0): the
 * bf16 bits in the low half of each 32-bit lane. */
__attribute__((target("avx2,fma"))) static inline __m256i bf16_bits8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

/* round_as for eight lanes. */
__attribute__((target("avx2,fma"))) static inline __m256 round8(__m256 f, const int BF) {
    return BF ? _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(f), 16)) : f;
}

/* store1 for eight lanes, at elements i .. i + 7. */
__attribute__((target("avx2,fma"))) static inline void store8(void *p, size_t i, __m256 f, const int BF) {
    if (BF) {
        const __m256i r = bf16_bits8(f);   /* each lane <= 0xffff, so the unsigned saturating pack is exact */
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i),
                         _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    } else {
        _mm256_storeu_ps((float *)p + i, f);
    }
}

/* dst[i] = load1(src, i, BF) for i < n: whole octets by load8, the rest one at a time (exact either way). */
__attribute__((target("avx2,fma"))) static void widen_row(size_t n, const void *src, const int BF, float *dst) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src, i, BF));
    for (; i < n; i++) dst[i] = load1(src, i, BF);
}

/* store1(dst, at + i, src[i], BF) for i < n: whole octets by store8, the rest one at a time (the same rounding). */
__attribute__((target("avx2,fma"))) static void narrow_row(size_t n, const float *src, void *dst, size_t at,
                                                        const int BF) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) store8(dst, at + i, _mm256_loadu_ps(src + i), BF);
    for (; i < n; i++) store1(dst, at + i, src[i], BF);
}

/* The same projection for bf16 x and y: x goes up to float32 (exactly), the float32 result of
 * safespec_panel_linear rounds to bf16 once. A block of rows at a time, through small buffers.
 * Returns 0, or -1 when the buffers cannot be allocated (y is then left as it was). */
__attribute__((target("avx2,fma"))) int safespec_panel_linear_bf16(int M, int K, int N, const uint16_t *x,
                                                                  const void *panels, int panels_bf16,
                                                                  const float *bias, uint16_t *y) {
    const int avx512 = isa() == 2;
    const size_t most = avx512 ? MAX_BLOCK_ROWS_512 : MAX_BLOCK_ROWS;
    float *xf = malloc(sizeof(float) * most * (K > 0 ? K : 1));
    float *yf = malloc(sizeof(float) * most * (N > 0 ? N : 1));
    if (!xf || !yf) {
        free(xf);
        free(yf);
        return -1;
    }
    for (int m0 = 0; m0 < M;) {
        int rows = block_rows(M, m0, avx512);
        widen_row((size_t)rows * K, x + (size_t)m0 * K, 1, xf);
        any_row_block(avx512, rows, K, N, xf, panels, panels_bf16, bias, yf);
        narrow_row((size_t)rows * N, yf, y, (size_t)m0 * N, 1);
        m0 += rows;
    }
    free(xf);
    free(yf);
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Batch-invariant attention (spec_decode/cpu/attention.py): each query row's arithmetic alone, in one fixed
 * order (the rows of one kv head may share their loads of keys and values: attend_group below).
 *
 * For query row r of (batch b, kv head h), the keys s it may see (mask[b, r, s]) are taken in
 * ascending s, and only those: a masked key costs nothing and changes nothing, so neither the padded
 * key count S nor the other rows of the block can change a row's bits. For each visible key:
 *   score = dot(q * scale, k_s): 8 lanes, lane l accumulating d = l, l + 8, ... by FMA, the lanes
 *           summed ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then d past the last whole
 *           8 by FMA in d order;
 *   p_s   = exp_ps(score - max over the visible scores) (exp_ps below: the same arithmetic in every lane);
 *   den   = p_s summed in key order, one accumulator; acc[d] = fma(p_s, v_s[d], acc[d]) in key order;
 *   out   = acc / den.
 * Key order is the order of cache rows, which on a draft tree's path is its logical order (a node's
 * ancestors sit before it, one per depth), so a path gets the bits of the same tokens decoded one at
 * a time. NaN in a visible key or value reaches the row (the max skips it, exp and the sums carry it);
 * a masked one never does. All arithmetic is explicit (the file builds with -ffp-contract=off), so
 * reference_attention (attention.py) reproduces it bit for bit in torch.
 */

/* exp of 8 float32 values, Cephes' expf: x = n ln2 + r, exp(r) = 1 + r + r^2 P(r) with P of degree 5, times
 * 2^n; inputs below -88.38 give 0 or a tiny value, NaN stays NaN. Multiplies and adds are separate
 * operations, so reference_exp (attention.py) repeats them one torch op at a time. */
__attribute__((target("avx2,fma"))) static inline __m256 exp_ps(__m256 x) {
    const __m256 nan_mask = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 x_in = x;
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, z), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
    return _mm256_blendv_ps(y, x_in, nan_mask);
}

/* dot(qs, k row) in the lane order above; qs is float32, the key float32 or (BF) bf16. */
__attribute__((target("avx2,fma"))) static inline float dot_row(const float *qs, const void *k, size_t k0, int D,
                                                              const int BF) {
    __m256 a = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qs + d), load8(k, k0 + d, BF), a);
    float l[8];
    _mm256_storeu_ps(l, a);
    float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (; d < D; d++) s = __builtin_fmaf(qs[d], load1(k, k0 + d, BF), s);
    return s;
}

/* The scores of 8 visible keys (cache rows idx[0..7]) at once: 8 independent FMA chains, so their latencies
 * overlap where dot_row's single chain waits on each FMA. Each key's arithmetic is dot_row's: lane l sums
 * d = l, l + 8, ... by FMA; hadd adds neighbouring lanes, twice, then the halves, which is
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); d past the last whole 8 by FMA in d order. */
__attribute__((target("avx2,fma"))) static inline void dot_8_rows(const float *qs, const void *k, size_t kv0,
                                                                const int *idx, int D, const int BF, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const size_t r0 = kv0 + (size_t)idx[0] * D, r1 = kv0 + (size_t)idx[1] * D, r2 = kv0 + (size_t)idx[2] * D,
                 r3 = kv0 + (size_t)idx[3] * D, r4 = kv0 + (size_t)idx[4] * D, r5 = kv0 + (size_t)idx[5] * D,
                 r6 = kv0 + (size_t)idx[6] * D, r7 = kv0 + (size_t)idx[7] * D;
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qs + d);
        a0 = _mm256_fmadd_ps(qv, load8(k, r0 + d, BF), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k, r1 + d, BF), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k, r2 + d, BF), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k, r3 + d, BF), a3);
        a4 = _mm256_fmadd_ps(qv, load8(k, r4 + d, BF), a4);
        a5 = _mm256_fmadd_ps(qv, load8(k, r5 + d, BF), a5);
        a6 = _mm256_fmadd_ps(qv, load8(k, r6 + d, BF), a6);
        a7 = _mm256_fmadd_ps(qv, load8(k, r7 + d, BF), a7);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));   /* keys 0-3: low, high half */
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));   /* keys 4-7 */
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
    if (d < D) {
        const size_t r[8] = {r0, r1, r2, r3, r4, r5, r6, r7};
        for (int j = 0; j < 8; j++)
            for (int e = d; e < D; e++) out[j] = __builtin_fmaf(qs[e], load1(k, r[j] + e, BF), out[j]);
    }
}

/* acc[d] = fma(p[j], v row idx[j] [d], acc[d]) for the n visible keys j in key order, from acc[d] = 0 (or,
 * from_acc, from the acc given: a row's keys after its group's common prefix, attend_group below): the
 * keys run inside a block of 8 vectors of acc held in registers, so an FMA waits on its own element's
 * previous one only (a loop over keys outside one over d would store and reload acc at every key). */
__attribute__((target("avx2,fma"))) static inline void weighted_rows(float *acc, const float *p, const void *v,
                                                                   size_t kv0, const int *idx, int n, int D,
                                                                   const int BF, const int from_acc) {
    int d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256 c0, c1, c2, c3, c4, c5, c6, c7;
        if (from_acc) {
            c0 = _mm256_loadu_ps(acc + d), c1 = _mm256_loadu_ps(acc + d + 8), c2 = _mm256_loadu_ps(acc + d + 16);
            c3 = _mm256_loadu_ps(acc + d + 24), c4 = _mm256_loadu_ps(acc + d + 32), c5 = _mm256_loadu_ps(acc + d + 40);
            c6 = _mm256_loadu_ps(acc + d + 48), c7 = _mm256_loadu_ps(acc + d + 56);
        } else {
            c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
        }
        for (int j = 0; j < n; j++) {
            const __m256 pv = _mm256_set1_ps(p[j]);
            const size_t r = kv0 + (size_t)idx[j] * D + d;
            c0 = _mm256_fmadd_ps(pv, load8(v, r, BF), c0);
            c1 = _mm256_fmadd_ps(pv, load8(v, r + 8, BF), c1);
            c2 = _mm256_fmadd_ps(pv, load8(v, r + 16, BF), c2);
            c3 = _mm256_fmadd_ps(pv, load8(v, r + 24, BF), c3);
            c4 = _mm256_fmadd_ps(pv, load8(v, r + 32, BF), c4);
            c5 = _mm256_fmadd_ps(pv, load8(v, r + 40, BF), c5);
            c6 = _mm256_fmadd_ps(pv, load8(v, r + 48, BF), c6);
            c7 = _mm256_fmadd_ps(pv, load8(v, r + 56, BF), c7);
        }
        _mm256_storeu_ps(acc + d, c0);
        _mm256_storeu_ps(acc + d + 8, c1);
        _mm256_storeu_ps(acc + d + 16, c2);
        _mm256_storeu_ps(acc + d + 24, c3);
        _mm256_storeu_ps(acc + d + 32, c4);
        _mm256_storeu_ps(acc + d + 40, c5);
        _mm256_storeu_ps(acc + d + 48, c6);
        _mm256_storeu_ps(acc + d + 56, c7);
    }
    for (; d + 8 <= D; d += 8) {
        __m256 c = from_acc ? _mm256_loadu_ps(acc + d) : _mm256_setzero_ps();
        for (int j = 0; j < n; j++) c = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v, kv0 + (size_t)idx[j] * D + d, BF), c);
        _mm256_storeu_ps(acc + d, c);
    }
    for (; d < D; d++) {
        float c = from_acc ? acc[d] : 0.0f;
        for (int j = 0; j < n; j++) c = __builtin_fmaf(p[j], load1(v, kv0 + (size_t)idx[j] * D + d, BF), c);
        acc[d] = c;
    }
}

/* The keys a row sees, ascending: their cache rows into idx; returns how many. */
static int visible_keys(int S, const uint8_t *mask, int *idx) {
    int n = 0;
    for (int s = 0; s < S; s++)
        if (mask[s]) idx[n++] = s;
    return n;
}

/* p[j] = the score of key idx[j] for j < n, the row alone (dot_8_rows, then dot_row for the last few). */
__attribute__((target("avx2,fma"))) static void row_scores(const float *qs, const void *k, size_t kv0, const int *idx,
                                                         int n, int D, const int BF, float *p) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        if (BF) dot_8_rows(qs, k, kv0, idx + i, D, 1, p + i);
        else dot_8_rows(qs, k, kv0, idx + i, D, 0, p + i);
    }
    for (; i < n; i++) p[i] = BF ? dot_row(qs, k, kv0 + (size_t)idx[i] * D, D, 1) : dot_row(qs, k, kv0 + (size_t)idx[i] * D, D, 0);
}

/* The largest of p[0..n) from m (NaN skipped). */
static inline float max_from(float m, const float *p, int n) {
    for (int i = 0; i < n; i++)
        if (p[i] > m) m = p[i];
    return m;
}

/* The scores p[0..n) become exp_ps(score - m), m their max. */
__attribute__((target("avx2,fma"))) static void exp_scores(float *p, int n, float m) {
    int i = 0;
    const __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i), mv)));
    if (i < n) {   /* the tail through the same vector code: a key's bits never depend on its lane */
        float t[8] = {0};
        memcpy(t, p + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(t, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(t), mv)));
        memcpy(p + i, t, sizeof(float) * (size_t)(n - i));
    }
}

/* den + p[0] + ... + p[n - 1], one add at a time in key order. */
static inline float sum_from(float den, const float *p, int n) {
    for (int j = 0; j < n; j++) den += p[j];
    return den;
}

/* The scores p[0..n) become exp_ps(score - max); returns their sum in key order (den). */
static float softmax_weights(float *p, int n) {
    exp_scores(p, n, max_from(-INFINITY, p, n));
    return sum_from(0.0f, p, n);
}

/* One query row: qs [D] float32 (already scaled), keys/values at k0/v0 + s * D, mask [S] (1 byte each). */
__attribute__((target("avx2,fma"))) static void attend_row(int S, int D, const float *qs, const void *k,
                                                         const void *v, size_t kv0, int kv_bf16,
                                                         const uint8_t *mask, int *idx, float *p, float *acc) {
    const int n = visible_keys(S, mask, idx);
    row_scores(qs, k, kv0, idx, n, D, kv_bf16, p);
    const float den = softmax_weights(p, n);
    if (kv_bf16) weighted_rows(acc, p, v, kv0, idx, n, D, 1, 0);
    else weighted_rows(acc, p, v, kv0, idx, n, D, 0, 0);
    for (int j = 0; j < D; j++) acc[j] = acc[j] / den;
}

/* ------------------------------------------------------------------------------------------------
 * Rows that share a kv head share its widened keys and values. A group holds up to GROUP_ROWS query rows
 * of one kv head (in attention_block, the query heads of one token, whose masks are alike). Over the
 * visible keys that begin every row's list alike (the common prefix: for a causal or tree block, every
 * committed key), each loaded K or V vector serves every row of the group; each row's keys after it run
 * alone. Every row keeps the arithmetic of attend_row: its score of a key is dot_row's chain in the same
 * lane order and sum, and its acc[d] takes the same FMAs in key order (the prefix's, then the rest's), so
 * a row's bits never depend on its group. */
#define GROUP_ROWS 3

/* Scores of keys idx[0..n) for G rows that all see them (qs [G][D], p [G][ps]): four keys at a time, so
 * the G * 4 FMA chains overlap; each chain and its lane sum is dot_8_rows'. D a multiple of 8. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
group_scores(const int G, const float *qs, const void *k, size_t kv0, const int *idx, int n, int D, const int BF,
             float *p, size_t ps) {
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        __m256 a[GROUP_ROWS][4];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) a[g][c] = _mm256_setzero_ps();
        const size_t r[4] = {kv0 + (size_t)idx[j] * D, kv0 + (size_t)idx[j + 1] * D, kv0 + (size_t)idx[j + 2] * D,
                             kv0 + (size_t)idx[j + 3] * D};
        for (int d = 0; d < D; d += 8)
            for (int c = 0; c < 4; c++) {
                const __m256 kv = load8(k, r[c] + d, BF);
                for (int g = 0; g < G; g++) a[g][c] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + (size_t)g * D + d), kv, a[g][c]);
            }
        for (int g = 0; g < G; g++) {
            const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
            _mm_storeu_ps(p + g * ps + j, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
        }
    }
    for (; j < n; j++)
        for (int g = 0; g < G; g++) p[g * ps + j] = dot_row(qs + (size_t)g * D, k, kv0 + (size_t)idx[j] * D, D, BF);
}

/* acc[g][d] = fma(p[g][j], v row idx[j] [d], acc[g][d]) for keys j < n in key order, from 0, for G rows that
 * all see them: Q octets of d at a time, each loaded V vector serving every row. D a multiple of 8. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
group_weighted(const int G, const int Q, float *acc, const float *p, size_t ps, const void *v, size_t kv0,
               const int *idx, int n, int d, int D, const int BF) {
    __m256 c[GROUP_ROWS][4];
    for (int g = 0; g < G; g++)
        for (int q = 0; q < Q; q++) c[g][q] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        const size_t r = kv0 + (size_t)idx[j] * D + d;
        __m256 pv[GROUP_ROWS];
        for (int g = 0; g < G; g++) pv[g] = _mm256_set1_ps(p[g * ps + j]);
        for (int q = 0; q < Q; q++) {
            const __m256 vv = load8(v, r + (size_t)q * 8, BF);
            for (int g = 0; g < G; g++) c[g][q] = _mm256_fmadd_ps(pv[g], vv, c[g][q]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int q = 0; q < Q; q++) _mm256_storeu_ps(acc + (size_t)g * D + d + q * 8, c[g][q]);
}

/* G rows of one kv head (qs [G][D] scaled, masks[g] their mask rows; idx, p [G][S]; acc [G][D]): each row's
 * output into acc as attend_row gives it. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
attend_group(const int G, int S, int D, const float *qs, const void *k, const void *v, size_t kv0, const int BF,
             const uint8_t *const *masks, int *idx, float *p, float *acc) {
    int n[GROUP_ROWS], common = S;
    for (int g = 0; g < G; g++) {
        n[g] = visible_keys(S, masks[g], idx + (size_t)g * S);
        if (n[g] < common) common = n[g];
    }
    for (int g = 1; g < G; g++)   /* the common prefix of the rows' key lists */
        for (int j = 0; j < common; j++)
            if (idx[(size_t)g * S + j] != idx[j]) {
                common = j;
                break;
            }
    if (D % 8) common = 0;   /* the shared loops take whole octets of d */
    group_scores(G, qs, k, kv0, idx, common, D, BF, p, (size_t)S);
    for (int g = 0; g < G; g++) {
        const size_t o = (size_t)g * S;
        row_scores(qs + (size_t)g * D, k, kv0, idx + o + common, n[g] - common, D, BF, p + o + common);
    }
    /* each row's max and sum take its keys in order; over the common keys the rows' loops run side by side,
     * so that their one-add-at-a-time chains overlap */
    float m[GROUP_ROWS], den[GROUP_ROWS];
    for (int g = 0; g < G; g++) m[g] = -INFINITY;
    for (int j = 0; j < common; j++)
        for (int g = 0; g < G; g++)
            if (p[(size_t)g * S + j] > m[g]) m[g] = p[(size_t)g * S + j];
    for (int g = 0; g < G; g++) {
        m[g] = max_from(m[g], p + (size_t)g * S + common, n[g] - common);
        exp_scores(p + (size_t)g * S, n[g], m[g]);
        den[g] = 0.0f;
    }
    for (int j = 0; j < common; j++)
        for (int g = 0; g < G; g++) den[g] += p[(size_t)g * S + j];
    for (int g = 0; g < G; g++) den[g] = sum_from(den[g], p + (size_t)g * S + common, n[g] - common);
    if (common > 0) {
        int d = 0;
        for (; d + 32 <= D; d += 32) group_weighted(G, 4, acc, p, (size_t)S, v, kv0, idx, common, d, D, BF);
        for (; d < D; d += 8) group_weighted(G, 1, acc, p, (size_t)S, v, kv0, idx, common, d, D, BF);
    }
    for (int g = 0; g < G; g++) {
        const size_t o = (size_t)g * S;
        float *a = acc + (size_t)g * D;
        weighted_rows(a, p + o + common, v, kv0, idx + o + common, n[g] - common, D, BF, common > 0);
        for (int j = 0; j < D; j++) a[j] = a[j] / den[g];
    }
}

/* attend_group for 1 <= G <= GROUP_ROWS rows; one row alone is attend_row. */
__attribute__((target("avx2,fma"))) static void attend_rows(int G, int S, int D, const float *qs, const void *k,
                                                          const void *v, size_t kv0, int BF,
                                                          const uint8_t *const *masks, int *idx, float *p, float *acc) {
    if (G == 1) attend_row(S, D, qs, k, v, kv0, BF, masks[0], idx, p, acc);
    else if (G == 2 && BF) attend_group(2, S, D, qs, k, v, kv0, 1, masks, idx, p, acc);
    else if (G == 2) attend_group(2, S, D, qs, k, v, kv0, 0, masks, idx, p, acc);
    else if (BF) attend_group(3, S, D, qs, k, v, kv0, 1, masks, idx, p, acc);
    else attend_group(3, S, D, qs, k, v, kv0, 0, masks, idx, p, acc);
}

/* q: [B, H, R, D] at element strides (q_sb, q_sh, q_sr), float32 or (q_bf16) bf16; k, v: [B, H, >= S, D]
 * at strides (kv_sb, kv_sh, D), float32 or (kv_bf16) bf16; mask: [B, R, S] bytes at strides (m_sb, m_sr,
 * 1); out: [B, H, R, D] contiguous, float32 or (out_bf16) bf16. Returns 0, or -1 when out of memory. */
__attribute__((target("avx2,fma"))) int safespec_attention(int B, int H, int R, int S, int D, const void *q, int q_bf16,
                                                          int64_t q_sb, int64_t q_sh, int64_t q_sr, const void *k,
                                                          const void *v, int kv_bf16, int64_t kv_sb, int64_t kv_sh,
                                                          const uint8_t *mask, int64_t m_sb, int64_t m_sr,
                                                          float scale, void *out, int out_bf16) {
    int *idx = malloc(sizeof(int) * (size_t)(S > 0 ? S : 1));
    float *p = malloc(sizeof(float) * (size_t)(S > 0 ? S : 1));
    float *qs = malloc(sizeof(float) * (size_t)(D > 0 ? D : 1) * 2);
    if (!idx || !p || !qs) {
        free(idx);
        free(p);
        free(qs);
        return -1;
    }
    float *acc = qs + D;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int r = 0; r < R; r++) {
                size_t q0 = (size_t)(b * q_sb + h * q_sh + r * q_sr);
                for (int d = 0; d < D; d++) qs[d] = load1(q, q0 + d, q_bf16) * scale;
                attend_row(S, D, qs, k, v, (size_t)(b * kv_sb + h * kv_sh), kv_bf16, mask + b * m_sb + r * m_sr,
                           idx, p, acc);
                size_t o0 = (((size_t)b * H + h) * R + r) * D;
                narrow_row((size_t)D, acc, out, o0, out_bf16);
            }
    free(idx);
    free(p);
    free(qs);
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * RMSNorm (spec_decode/cpu/norm.py), one row of H values at a time, in one fixed order:
 *   ss  = sum of x[d] * x[d]: 8 lanes, lane l adding d = l, l + 8, ... (multiply, then add), the lanes
 *         summed ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then d past the last whole 8 in d order;
 *   r   = 1 / sqrt(ss / H + eps);
 *   out = w * (x * r), where a bf16 x rounds x * r to bf16 before the weight multiply (as HF Llama),
 *         and the product rounds once to out's dtype.
 * torch's mean reduces in an order that follows its build's vector width, so the same row got other bits
 * on an AVX-512 torch; this order is the same on every CPU. reference_rms_norm (norm.py) repeats it in
 * torch bit for bit. NaN or Inf in a row makes the row NaN where it would in exact arithmetic order. */
__attribute__((target("avx2,fma"))) void safespec_rms_norm(int rows, int H, const void *x, int x_bf16, const void *w,
                                                          int w_bf16, float eps, void *out, int out_bf16) {
    for (int m = 0; m < rows; m++) {
        const size_t x0 = (size_t)m * H;
        __m256 lanes = _mm256_setzero_ps();
        int d = 0;
        for (; d + 8 <= H; d += 8) {
            const __m256 v = load8(x, x0 + d, x_bf16);
            lanes = _mm256_add_ps(lanes, _mm256_mul_ps(v, v));
        }
        float l[8];
        _mm256_storeu_ps(l, lanes);
        float ss = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
        for (; d < H; d++) {
            const float v = load1(x, x0 + d, x_bf16);
            ss = ss + v * v;
        }
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        const __m256 rv = _mm256_set1_ps(r);
        for (d = 0; d + 8 <= H; d += 8) {
            __m256 y = _mm256_mul_ps(load8(x, x0 + d, x_bf16), rv);
            if (x_bf16) y = round8(y, 1);
            store8(out, x0 + d, _mm256_mul_ps(load8(w, (size_t)d, w_bf16), y), out_bf16);
        }
        for (; d < H; d++) {
            float y = load1(x, x0 + d, x_bf16) * r;
            if (x_bf16) y = bf16_to_f32(f32_to_bf16(y));
            const float o = load1(w, (size_t)d, w_bf16) * y;
            if (out_bf16) ((uint16_t *)out)[x0 + d] = f32_to_bf16(o);
            else ((float *)out)[x0 + d] = o;
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * One attention layer's work between its two projections (spec_decode/cpu/attention.py,
 * attention_block): rope on q and k, the K/V rows written into the cache, each query row attended
 * as safespec_attention does, and the rows laid out for o_proj, in one call instead of a dozen ops.
 *
 * Rope is HF's rotate_half: out[d] = x[d] * cos[d] + rot[d] * sin[d], rot[d] = -x[d + D/2] below D/2 and
 * x[d - D/2] above. With bf16 (BF) every product and the sum round to bf16, as torch's bf16 ops do one
 * op at a time, so the roped rows carry the bits of the torch expression. */
__attribute__((target("avx2,fma"))) static void rope_row(const void *x, size_t x0, const void *cos, const void *sin,
                                                      size_t c0, int D, const int BF, float *dst) {
    const int half = D / 2;
    int d = 0;
    if (half % 8 == 0) {   /* whole octets on each side of D / 2: the same operations eight lanes at a time */
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (; d < D; d += 8) {
            const __m256 a = round8(_mm256_mul_ps(load8(x, x0 + d, BF), load8(cos, c0 + d, BF)), BF);
            const __m256 r = d < half ? _mm256_xor_ps(load8(x, x0 + d + half, BF), sign) : load8(x, x0 + d - half, BF);
            const __m256 b = round8(_mm256_mul_ps(r, load8(sin, c0 + d, BF)), BF);
            _mm256_storeu_ps(dst + d, round8(_mm256_add_ps(a, b), BF));
        }
    }
    for (; d < D; d++) {
        const float a = round_as(load1(x, x0 + d, BF) * load1(cos, c0 + d, BF), BF);
        const float r = d < half ? -load1(x, x0 + d + half, BF) : load1(x, x0 + d - half, BF);
        const float b = round_as(r * load1(sin, c0 + d, BF), BF);
        dst[d] = round_as(a + b, BF);
    }
}

/* qkv: [B, T, (NH + 2 NKV) D] contiguous: the q heads, then the k heads, then the v heads; cos, sin: D
 * values a row at element strides (cs_sb, cs_st); pos: the rows' cache positions, int64 at strides
 * (pos_sb, pos_st); kc, vc: one layer's cache [B, NKV, >= S, D] at strides (kv_sb, kv_sh, D); mask:
 * [B, R, S] bytes at strides (m_sb, m_sr, 1), R = (NH / NKV) T, the same for every kv head: row
 * rep * T + t serves query head h * (NH / NKV) + rep of token t; out: [B, T, NH D] contiguous.
 * Everything float32 or (BF) bf16. Returns 0, or -1 when out of memory (nothing written then). */
__attribute__((target("avx2,fma"))) int safespec_attention_block(
        int B, int T, int NH, int NKV, int D, const void *qkv, int BF, const void *cos, const void *sin,
        int64_t cs_sb, int64_t cs_st, const int64_t *pos, int64_t pos_sb, int64_t pos_st, void *kc, void *vc,
        int64_t kv_sb, int64_t kv_sh, const uint8_t *mask, int64_t m_sb, int64_t m_sr, int S, float scale,
        void *out) {
    const size_t W = (size_t)(NH + 2 * NKV) * D;
    const int n_rep = NH / NKV;
    const size_t Dn = (size_t)(D > 0 ? D : 1), Sn = (size_t)(S > 0 ? S : 1);
    float *q = malloc(sizeof(float) * ((size_t)B * T * NH * D + (2 * GROUP_ROWS + 1) * Dn));
    int *idx = malloc(sizeof(int) * GROUP_ROWS * Sn);
    float *p = malloc(sizeof(float) * GROUP_ROWS * Sn);
    if (!q || !idx || !p) {
        free(q);
        free(idx);
        free(p);
        return -1;
    }
    float *qs = q + (size_t)B * T * NH * D, *acc = qs + GROUP_ROWS * Dn, *krow = acc + GROUP_ROWS * Dn;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const size_t x0 = ((size_t)b * T + t) * W, c0 = (size_t)(b * cs_sb + t * cs_st);
            const size_t row = (size_t)pos[b * pos_sb + t * pos_st];
            for (int h = 0; h < NH; h++)
                rope_row(qkv, x0 + (size_t)h * D, cos, sin, c0, D, BF, q + (((size_t)b * T + t) * NH + h) * D);
            for (int h = 0; h < NKV; h++) {
                const size_t dst = (size_t)(b * kv_sb + h * kv_sh) + row * D;
                rope_row(qkv, x0 + (size_t)(NH + h) * D, cos, sin, c0, D, BF, krow);
                narrow_row((size_t)D, krow, kc, dst, BF);
                if (BF) memcpy((uint16_t *)vc + dst, (const uint16_t *)qkv + x0 + (size_t)(NH + NKV + h) * D, 2 * (size_t)D);
                else memcpy((float *)vc + dst, (const float *)qkv + x0 + (size_t)(NH + NKV + h) * D, 4 * (size_t)D);
            }
        }
    /* a kv head's rows in groups of GROUP_ROWS, token by token: a token's query heads see the same keys */
    const int rows = n_rep * T;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NKV; h++)
            for (int i0 = 0; i0 < rows; i0 += GROUP_ROWS) {
                const int G = rows - i0 < GROUP_ROWS ? rows - i0 : GROUP_ROWS;
                const uint8_t *masks[GROUP_ROWS];
                for (int g = 0; g < G; g++) {
                    const int t = (i0 + g) / n_rep, rep = (i0 + g) % n_rep;
                    const float *qr = q + (((size_t)b * T + t) * NH + h * n_rep + rep) * D;
                    for (int d = 0; d < D; d++) qs[(size_t)g * D + d] = qr[d] * scale;
                    masks[g] = mask + b * m_sb + (rep * T + t) * m_sr;
                }
                attend_rows(G, S, D, qs, kc, vc, (size_t)(b * kv_sb + h * kv_sh), BF, masks, idx, p, acc);
                for (int g = 0; g < G; g++) {
                    const int t = (i0 + g) / n_rep, hq = h * n_rep + (i0 + g) % n_rep;
                    narrow_row((size_t)D, acc + (size_t)g * D, out, ((size_t)b * T + t) * NH * D + (size_t)hq * D, BF);
                }
            }
    free(q);
    free(idx);
    free(p);
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * SwiGLU's middle (spec_decode/cpu/mlp.py): out = silu(gate) * up from the fused gate_up projection's
 * rows [gate | up], each element alone:
 *   e = exp_ps(-g) (the attention kernel's exp, 8 lanes, a row's tail through the same vector code);
 *   s = g / (e + 1), rounded to bf16 for a bf16 model (torch's cast of a float32 silu);
 *   out = s * u, rounded once to the model's dtype.
 * reference_silu_mul (mlp.py) repeats it in torch bit for bit. */
__attribute__((target("avx2,fma"))) void safespec_silu_mul(int rows, int I, const void *gate_up, int BF, void *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    for (int m = 0; m < rows; m++) {
        const size_t g0 = (size_t)m * 2 * I, u0 = g0 + I, o0 = (size_t)m * I;
        int d = 0;
        for (; d + 8 <= I; d += 8) {
            const __m256 gv = load8(gate_up, g0 + d, BF);
            const __m256 e = exp_ps(_mm256_xor_ps(gv, sign));
            const __m256 s = round8(_mm256_div_ps(gv, _mm256_add_ps(e, one)), BF);
            store8(out, o0 + d, _mm256_mul_ps(s, load8(gate_up, u0 + d, BF)), BF);
        }
        if (d < I) {   /* the tail through the same vector code: an element's bits never depend on its lane */
            const int n = I - d;
            float g[8] = {0}, s[8];
            for (int j = 0; j < n; j++) g[j] = load1(gate_up, g0 + d + j, BF);
            const __m256 gv = _mm256_loadu_ps(g);
            const __m256 e = exp_ps(_mm256_xor_ps(gv, sign));
            _mm256_storeu_ps(s, _mm256_div_ps(gv, _mm256_add_ps(e, one)));
            for (int j = 0; j < n; j++) store1(out, o0 + d + j, round_as(s[j], BF) * load1(gate_up, u0 + d + j, BF), BF);
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * One decoder layer in one call (spec_decode/cpu/layer.py): the functions above in the order a layer's
 * modules call them, with the residual adds between, so that a decode step's layer costs one call
 * instead of a dozen Python calls around the same arithmetic:
 *   h = rms_norm(x, in_norm) (skipped when in_norm is NULL), qkv = h Wqkv^T (+ b), a = attention_block(qkv),
 *   x1 = x + a Wo^T (+ b), h2 = rms_norm(x1, post_norm), out = x1 + down(silu_mul(h2 Wgu^T (+ b))) (+ b).
 * Each step is the same function the modules call, and an add rounds once to the dtype as torch's does,
 * so the layer gives the modules' bits. Everything float32 or (BF) bf16; panels float32 or bf16 each. */
struct safespec_projection {
    const void *panels;
    const float *bias;   /* NULL: none */
    int panels_bf16, K, N;
};

struct safespec_layer {
    const void *in_norm, *post_norm;   /* weights [H] in the dtype; in_norm NULL: no input norm */
    float in_eps, post_eps, scale;
    int NH, NKV, D;
    struct safespec_projection qkv, o, gate_up, down;
};

/* y[M, N] = x[M, K] W^T (+ b) in the dtype (BF); 0, or -1 when out of memory. */
static int project(const struct safespec_projection *p, int M, const void *x, void *y, const int BF) {
    if (BF) return safespec_panel_linear_bf16(M, p->K, p->N, x, p->panels, p->panels_bf16, p->bias, y);
    safespec_panel_linear(M, p->K, p->N, x, p->panels, p->panels_bf16, p->bias, y);
    return 0;
}

/* out[i] = a[i] + b[i] rounded once to the dtype, for i < n. */
__attribute__((target("avx2,fma"))) static void add_rows(size_t n, const void *a, const void *b, void *out,
                                                      const int BF) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) store8(out, i, _mm256_add_ps(load8(a, i, BF), load8(b, i, BF)), BF);
    for (; i < n; i++) store1(out, i, load1(a, i, BF) + load1(b, i, BF), BF);
}

/* x, out: [B, T, H] contiguous; the rope, position, cache and mask arguments as safespec_attention_block's.
 * Returns 0, or -1 when out of memory (out is then not written; the cache may hold the block's K/V rows,
 * which no committed length covers). */
int safespec_decoder_layer(const struct safespec_layer *L, int B, int T, int H, int I, const void *x, int BF,
                           const void *cos, const void *sin, int64_t cs_sb, int64_t cs_st, const int64_t *pos,
                           int64_t pos_sb, int64_t pos_st, void *kc, void *vc, int64_t kv_sb, int64_t kv_sh,
                           const uint8_t *mask, int64_t m_sb, int64_t m_sr, int S, void *out) {
    const size_t M = (size_t)B * T, elt = BF ? 2 : 4, A = (size_t)L->NH * L->D;
    const size_t sizes[6] = {M * H, M * L->qkv.N, M * A, M * H, M * 2 * I, M * I};
    size_t total = 0;
    for (int i = 0; i < 6; i++) total += sizes[i];
    char *buf = malloc(elt * (total > 0 ? total : 1));
    if (!buf) return -1;
    char *h = buf, *qkv = h + elt * sizes[0], *att = qkv + elt * sizes[1], *x1 = att + elt * sizes[2];
    char *gu = x1 + elt * sizes[3], *s = gu + elt * sizes[4];
    int rc = 0;
    if (L->in_norm) safespec_rms_norm((int)M, H, x, BF, L->in_norm, BF, L->in_eps, h, BF);
    rc = project(&L->qkv, (int)M, L->in_norm ? (const void *)h : x, qkv, BF);
    if (!rc)
        rc = safespec_attention_block(B, T, L->NH, L->NKV, L->D, qkv, BF, cos, sin, cs_sb, cs_st, pos, pos_sb,
                                      pos_st, kc, vc, kv_sb, kv_sh, mask, m_sb, m_sr, S, L->scale, att);
    if (!rc) rc = project(&L->o, (int)M, att, h, BF);   /* h is free again: it takes o's rows */
    if (!rc) {
        add_rows(M * H, x, h, x1, BF);
        safespec_rms_norm((int)M, H, x1, BF, L->post_norm, BF, L->post_eps, h, BF);
        rc = project(&L->gate_up, (int)M, h, gu, BF);
    }
    if (!rc) {
        safespec_silu_mul((int)M, I, gu, BF, s);
        rc = project(&L->down, (int)M, s, h, BF);
    }
    if (!rc) add_rows(M * H, x1, h, out, BF);
    free(buf);
    return rc;
}
