/* int8 weights times int8 activations: the products of quant/int8dot.py, in C.
 *
 * The math (int8dot.py states it with the plain torch reference beside it):
 *   activations, per row m and block b of 32 columns:  d = max|x| / 127,  q = round(x / d) in -127..127
 *     (x * (1 / d), rounded half away from zero: the float32 operations of reference.quantize_q8_0,
 *     so that both give the same bytes; an all-zero block has d = 0 and q = 0)
 *   weights: int8 (N, K) with one float32 scale s_n per row (Int8Linear's qweight and scales)
 *   y_mn = s_n * sum_b d_mb * isum_mnb,   isum_mnb = sum over the block's 32 columns of q_mk * w_nk (int32)
 * A block holding a NaN or an infinity gets d = NaN, so that the rows it touches come out NaN.
 *
 * Routes, chosen per call (isa argument; 0 takes the best this CPU has, found by CPUID):
 *   1 scalar: plain loops, any CPU;
 *   2 AVX2:   32 products a block with the sign trick: maddubs multiplies unsigned by signed bytes,
 *             so |w| (sign(w, w)) times x carrying w's sign (sign(x, w)) gives w * x; pairs summed
 *             to int16 (at most 2 * 127 * 127 = 32258, no saturation since neither side holds -128),
 *             madd by ones to eight int32, converted and multiplied by the block's scale in float32.
 * Both give the same int32 block sums (block_dots, tested exactly); the float sums may differ in
 * their last bits (order of the additions).
 *
 * int4 weights (Int4Linear): (N, K/2) bytes, column 2j in the low nibble and 2j+1 in the high one,
 * and per group of G columns a bf16 scale s and a uint8 zero point z, w = (q - z) * s:
 *   y_mn = sum_g s_ng * (sum_{b in g} d_mb * isum_mnb  -  z_ng * sum_{b in g} d_mb * sum_{k in b} qx_mk)
 * with isum the block sums of q (0..15) times qx. AVX2 multiplies the nibbles as they are, unsigned
 * by signed (maddubs, pairs at most 2 * 15 * 127: no saturation, no sign trick), against activations
 * reordered to line up with them (interleave): with groups of 32, each block as [its 16 even columns
 * | its 16 odd ones] beside the low and the high nibbles of its 16 bytes; with larger groups, two
 * blocks b, b + 1 at a time as [b's even | b+1's even][b's odd | b+1's odd], beside the low and the
 * high nibbles of their 32 bytes, one load for both.
 *
 * Threads: output rows split over `threads` OpenMP threads (torch's libgomp: the same soname, so
 * the same pool); the GIL is released during the work. Shapes: M rows of x, K columns (a multiple
 * of 32), N rows of w, B = K / 32 blocks a row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86 1
#include <immintrin.h>
#else
#define HAVE_X86 0
#endif

#define BLOCK 32
#define MR 4               /* at most MR rows of x and NR rows of w in a tile */
#define NR 4
#ifndef PREFETCH
#define PREFETCH 16384     /* bytes ahead of a tile's first row that it asks the cache for */
#endif
enum { ISA_BEST = 0, ISA_SCALAR = 1, ISA_AVX2 = 2 };
enum { DT_F32 = 0, DT_BF16 = 1 };

typedef struct {            /* M rows of activations, quantized */
    const int8_t *q;        /* (M, K); for int4 weights on AVX2 reordered (interleave) */
    const float *d;         /* (M, B) the blocks' scales */
    const float *sum;       /* (M, B) d times the block's sum of q (int4's zero points), else NULL */
    Py_ssize_t M, K;
} Act;

typedef struct {            /* a weight of N rows: int8 with a scale a row (w4 NULL), or int4 groups */
    const int8_t *w8;
    const float *s8;        /* (N,) */
    const uint8_t *w4;      /* (N, K/2) */
    const uint16_t *s4;     /* (N, K/G) bf16 */
    const uint8_t *z4;      /* (N, K/G) */
    Py_ssize_t N, G;
} Weight;

static int have_avx2(void) {
#if HAVE_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {       /* round to nearest even, NaN kept quiet (as torch) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ------------------------------------------------------------------------------------------ */
/* Activations: one row of K floats -> K int8 and K/32 scales                                  */
/* ------------------------------------------------------------------------------------------ */

static void load_block(const void *x, int dtype, Py_ssize_t k0, float *out) {
    if (dtype == DT_F32) {
        memcpy(out, (const float *)x + k0, BLOCK * sizeof(float));
    } else {
        const uint16_t *h = (const uint16_t *)x + k0;
        for (int i = 0; i < BLOCK; i++) out[i] = bf16_to_f32(h[i]);
    }
}

static void quantize_row(const void *x, int dtype, Py_ssize_t K, int8_t *q, float *d) {
    float v[BLOCK];
    for (Py_ssize_t b = 0; b < K / BLOCK; b++) {
        load_block(x, dtype, b * BLOCK, v);
        float amax = 0.0f;
        int bad = 0;
        for (int i = 0; i < BLOCK; i++) {
            float a = fabsf(v[i]);
            bad |= !(a <= 3.402823466e+38f);                /* NaN or infinity */
            amax = a > amax ? a : amax;
        }
        float db = amax / 127.0f;
        float inv = db != 0.0f ? 1.0f / db : 0.0f;
        for (int i = 0; i < BLOCK; i++) {
            float t = v[i] * inv;
            float r = floorf(fabsf(t) + 0.5f);               /* half away from zero */
            q[b * BLOCK + i] = bad ? 0 : (int8_t)(t < 0.0f ? -r : r);
        }
        d[b] = bad ? NAN : db;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Scalar route                                                                               */
/* ------------------------------------------------------------------------------------------ */

static inline int32_t dot32_scalar(const int8_t *a, const int8_t *w) {
    int32_t s = 0;
    for (int i = 0; i < BLOCK; i++) s += (int32_t)a[i] * (int32_t)w[i];
    return s;
}

static void rows_scalar(const Act *a, const Weight *w, Py_ssize_t n0, Py_ssize_t n1, float *y) {
    Py_ssize_t K = a->K, B = K / BLOCK;
    for (Py_ssize_t n = n0; n < n1; n++) {
        for (Py_ssize_t m = 0; m < a->M; m++) {
            float acc = 0.0f;
            for (Py_ssize_t b = 0; b < B; b++)
                acc += a->d[m * B + b] * (float)dot32_scalar(a->q + m * K + b * BLOCK, w->w8 + n * K + b * BLOCK);
            y[m * w->N + n] = w->s8[n] * acc;
        }
    }
}

/* int4: a is one block of x in its own order, w its 16 bytes (column 2j in byte j's low nibble). */
static inline int32_t dot4_scalar(const int8_t *a, const uint8_t *w) {
    int32_t s = 0;
    for (int j = 0; j < BLOCK / 2; j++) s += (int32_t)(w[j] & 15) * a[2 * j] + (int32_t)(w[j] >> 4) * a[2 * j + 1];
    return s;
}

static void rows4_scalar(const Act *a, const Weight *w, Py_ssize_t n0, Py_ssize_t n1, float *y) {
    Py_ssize_t K = a->K, B = K / BLOCK, per = w->G / BLOCK, groups = K / w->G;
    for (Py_ssize_t n = n0; n < n1; n++) {
        for (Py_ssize_t m = 0; m < a->M; m++) {
            float total = 0.0f;
            for (Py_ssize_t g = 0; g < groups; g++) {
                float acc = 0.0f, sum = 0.0f;
                for (Py_ssize_t b = g * per; b < (g + 1) * per; b++) {
                    acc += a->d[m * B + b] * (float)dot4_scalar(a->q + m * K + b * BLOCK, w->w4 + n * (K / 2) + b * 16);
                    sum += a->sum[m * B + b];
                }
                total += bf16_to_f32(w->s4[n * groups + g]) * (acc - (float)w->z4[n * groups + g] * sum);
            }
            y[m * w->N + n] = total;
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* AVX2 route                                                                                 */
/* ------------------------------------------------------------------------------------------ */
#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma")))

static inline AVX2 __m256i dot32_avx2(__m256i absw, __m256i w, __m256i a) {
    __m256i p16 = _mm256_maddubs_epi16(absw, _mm256_sign_epi8(a, w));   /* 16 x (two products) */
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));                 /* 8 x int32 */
}

static inline AVX2 float hsum_avx2(__m256 v) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}

/* `nr` rows of w (w[0..nr), a row repeated where fewer are left) against `mr` rows of x, summed
 * into acc[m][r]; inlined with mr and nr fixed, so that the accumulators stay in registers. Each
 * accumulator takes one fma a block, so nr * mr of them are what hides the fma's latency. */
static inline __attribute__((always_inline)) AVX2 void tile_avx2(
        const int8_t *qa, const float *da, int mr, int nr, Py_ssize_t K, const int8_t *const *w,
        float out[MR][NR]) {
    Py_ssize_t B = K / BLOCK;
    __m256 acc[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) acc[m][r] = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < B; b++) {
        __m256i v[NR], a[NR];
        _mm_prefetch((const char *)(w[0] + PREFETCH + b * nr * BLOCK), _MM_HINT_T0);   /* rows further on */
        _mm_prefetch((const char *)(w[0] + PREFETCH + b * nr * BLOCK + 64), _MM_HINT_T0);
        for (int r = 0; r < nr; r++) {
            v[r] = _mm256_loadu_si256((const __m256i *)(w[r] + b * BLOCK));
            a[r] = _mm256_sign_epi8(v[r], v[r]);
        }
        for (int m = 0; m < mr; m++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(qa + m * K + b * BLOCK));
            __m256 scale = _mm256_broadcast_ss(da + m * B + b);
            for (int r = 0; r < nr; r++)
                acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_avx2(a[r], v[r], x)), scale, acc[m][r]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) out[m][r] = hsum_avx2(acc[m][r]);
}

static AVX2 void rows_avx2(const Act *a, const Weight *w, Py_ssize_t n0, Py_ssize_t n1, float *y) {
    Py_ssize_t K = a->K, B = K / BLOCK;
    float out[MR][NR] = {{0.0f}};
    for (Py_ssize_t m0 = 0; m0 < a->M; m0 += MR) {
        int mr = a->M - m0 < MR ? (int)(a->M - m0) : MR;
        int nr = mr == 1 ? NR : 2;                          /* 4 or 8 accumulators */
        const int8_t *q = a->q + m0 * K;
        const float *d = a->d + m0 * B;
        for (Py_ssize_t n = n0; n < n1; n += nr) {
            const int8_t *rows[NR];
            for (int r = 0; r < NR; r++) rows[r] = w->w8 + (n + r < n1 ? n + r : n) * K;
            switch (mr) {                                   /* each case inlines tile_avx2 with mr fixed */
                case 1: tile_avx2(q, d, 1, NR, K, rows, out); break;
                case 2: tile_avx2(q, d, 2, 2, K, rows, out); break;
                case 3: tile_avx2(q, d, 3, 2, K, rows, out); break;
                default: tile_avx2(q, d, MR, 2, K, rows, out); break;
            }
            for (int m = 0; m < mr; m++)
                for (int r = 0; r < nr && n + r < n1; r++) y[(m0 + m) * w->N + n + r] = w->s8[n + r] * out[m][r];
        }
    }
}

/* 16 bytes of int4 -> 32 bytes 0..15: [low nibbles | high nibbles], the interleaved order. */
static inline AVX2 __m256i nibbles_avx2(const uint8_t *p) {
    const __m128i low = _mm_set1_epi8(0x0F);
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
}

/* 32 bytes of int4 (blocks b, b+1) -> their low nibbles and their high ones, 32 bytes each. */
static inline AVX2 void nibbles2_avx2(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_and_si256(raw, low);
    *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
}

/* Two blocks' products: 8 int32, lanes 0-3 summing block b, lanes 4-7 block b+1. */
static inline AVX2 __m256i pair_avx2(__m256i lo, __m256i hi, __m256i xl, __m256i xh) {
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));   /* |.| <= 4 * 1905 */
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* The end of int4 group g for a tile: each row's block sums (acc, times d) times the group's scale
 * s, less the zero point's part (z times the sum of x over the group's blocks), added to total. */
static inline __attribute__((always_inline)) AVX2 void close_group4(
        const Act *a, Py_ssize_t m0, int mr, int nr, const Weight *w, const Py_ssize_t *n, Py_ssize_t g,
        __m256 acc[MR][NR], float total[MR][NR]) {
    Py_ssize_t B = a->K / BLOCK, per = w->G / BLOCK, groups = a->K / w->G;
    for (int m = 0; m < mr; m++) {
        float xs = 0.0f;
        for (Py_ssize_t b = g * per; b < (g + 1) * per; b++) xs += a->sum[(m0 + m) * B + b];
        for (int r = 0; r < nr; r++) {
            float sg = bf16_to_f32(w->s4[n[r] * groups + g]);
            total[m][r] += sg * (hsum_avx2(acc[m][r]) - (float)w->z4[n[r] * groups + g] * xs);
        }
    }
}

/* int4 with groups of 64 or more (whole pairs of blocks): as tile4_avx2, two blocks a step. */
static inline __attribute__((always_inline)) AVX2 void tile4_pairs_avx2(
        const Act *a, Py_ssize_t m0, int mr, int nr, const Weight *w, const Py_ssize_t *n, float out[MR][NR]) {
    Py_ssize_t K = a->K, B = K / BLOCK, per = w->G / BLOCK, groups = K / w->G;
    const __m256i lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    float total[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) total[m][r] = 0.0f;
    for (Py_ssize_t g = 0; g < groups; g++) {
        __m256 acc[MR][NR];
        for (int m = 0; m < mr; m++)
            for (int r = 0; r < nr; r++) acc[m][r] = _mm256_setzero_ps();
        for (Py_ssize_t b = g * per; b < (g + 1) * per; b += 2) {
            _mm_prefetch((const char *)(w->w4 + n[0] * (K / 2) + PREFETCH + b * nr * 16), _MM_HINT_T0);
            _mm_prefetch((const char *)(w->w4 + n[0] * (K / 2) + PREFETCH + b * nr * 16 + 64), _MM_HINT_T0);
            __m256i lo[NR], hi[NR];
            for (int r = 0; r < nr; r++) nibbles2_avx2(w->w4 + n[r] * (K / 2) + b * 16, &lo[r], &hi[r]);
            for (int m = 0; m < mr; m++) {
                const int8_t *x = a->q + (m0 + m) * K + b * BLOCK;
                __m256i xl = _mm256_loadu_si256((const __m256i *)x), xh = _mm256_loadu_si256((const __m256i *)(x + 32));
                __m256 two = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(a->d + (m0 + m) * B + b)));
                __m256 scale = _mm256_permutevar8x32_ps(two, lanes);          /* d_b x 4, d_b+1 x 4 */
                for (int r = 0; r < nr; r++)
                    acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_avx2(lo[r], hi[r], xl, xh)), scale, acc[m][r]);
            }
        }
        close_group4(a, m0, mr, nr, w, n, g, acc, total);
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) out[m][r] = total[m][r];
}

/* int4: `nr` rows of w against `mr` rows of x, group by group: acc sums a group's blocks (times d),
 * total the groups (times s, less the zero point's part). */
static inline __attribute__((always_inline)) AVX2 void tile4_avx2(
        const Act *a, Py_ssize_t m0, int mr, int nr, const Weight *w, const Py_ssize_t *n, float out[MR][NR]) {
    Py_ssize_t K = a->K, B = K / BLOCK, per = w->G / BLOCK, groups = K / w->G;
    const __m256i ones = _mm256_set1_epi16(1);
    float total[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) total[m][r] = 0.0f;
    for (Py_ssize_t g = 0; g < groups; g++) {
        __m256 acc[MR][NR];
        for (int m = 0; m < mr; m++)
            for (int r = 0; r < nr; r++) acc[m][r] = _mm256_setzero_ps();
        for (Py_ssize_t b = g * per; b < (g + 1) * per; b++) {
            const uint8_t *first = w->w4 + n[0] * (K / 2);
            _mm_prefetch((const char *)(first + PREFETCH + b * nr * 16), _MM_HINT_T0);   /* rows further on */
            __m256i v[NR];
            for (int r = 0; r < nr; r++) v[r] = nibbles_avx2(w->w4 + n[r] * (K / 2) + b * 16);
            for (int m = 0; m < mr; m++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + m) * K + b * BLOCK));
                __m256 scale = _mm256_broadcast_ss(a->d + (m0 + m) * B + b);
                for (int r = 0; r < nr; r++) {
                    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(v[r], x), ones);
                    acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[m][r]);
                }
            }
        }
        close_group4(a, m0, mr, nr, w, n, g, acc, total);
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) out[m][r] = total[m][r];
}

static AVX2 void rows4_avx2(const Act *a, const Weight *w, Py_ssize_t n0, Py_ssize_t n1, float *y) {
    float out[MR][NR] = {{0.0f}};
    for (Py_ssize_t m0 = 0; m0 < a->M; m0 += MR) {
        int mr = a->M - m0 < MR ? (int)(a->M - m0) : MR;
        int nr = mr == 1 ? NR : 2;                          /* 4 or 8 accumulators */
        for (Py_ssize_t n = n0; n < n1; n += nr) {
            Py_ssize_t rows[NR];
            for (int r = 0; r < NR; r++) rows[r] = n + r < n1 ? n + r : n;
            if (w->G > BLOCK) {
                switch (mr) {                               /* each case inlines the tile with mr fixed */
                    case 1: tile4_pairs_avx2(a, m0, 1, NR, w, rows, out); break;
                    case 2: tile4_pairs_avx2(a, m0, 2, 2, w, rows, out); break;
                    case 3: tile4_pairs_avx2(a, m0, 3, 2, w, rows, out); break;
                    default: tile4_pairs_avx2(a, m0, MR, 2, w, rows, out); break;
                }
            } else {
                switch (mr) {
                    case 1: tile4_avx2(a, m0, 1, NR, w, rows, out); break;
                    case 2: tile4_avx2(a, m0, 2, 2, w, rows, out); break;
                    case 3: tile4_avx2(a, m0, 3, 2, w, rows, out); break;
                    default: tile4_avx2(a, m0, MR, 2, w, rows, out); break;
                }
            }
            for (int m = 0; m < mr; m++)
                for (int r = 0; r < nr && n + r < n1; r++) y[(m0 + m) * w->N + n + r] = out[m][r];
        }
    }
}

/* quantize_row's numbers with 8 floats at a time: the same float32 operations (|x|, max, x * inv,
 * |t| + 0.5, floor, the sign put back), so the same bytes. */
static inline AVX2 __m256 load8_avx2(const void *x, int dtype, Py_ssize_t k) {
    if (dtype == DT_F32) return _mm256_loadu_ps((const float *)x + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static AVX2 void quantize_row_avx2(const void *x, int dtype, Py_ssize_t K, int8_t *q, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.402823466e+38f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (Py_ssize_t b = 0; b < K / BLOCK; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        int bad = 0;
        for (int i = 0; i < 4; i++) {
            v[i] = load8_avx2(x, dtype, b * BLOCK + 8 * i);
            __m256 a = _mm256_andnot_ps(sign, v[i]);
            bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_NLE_UQ));     /* NaN or infinity */
            m = _mm256_max_ps(m, a);
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float db = _mm_cvtss_f32(h) / 127.0f;
        float inv = db != 0.0f ? 1.0f / db : 0.0f;
        __m256i n[4];
        for (int i = 0; i < 4; i++) {
            __m256 t = _mm256_mul_ps(v[i], _mm256_set1_ps(inv));
            __m256 r = _mm256_floor_ps(_mm256_add_ps(_mm256_andnot_ps(sign, t), _mm256_set1_ps(0.5f)));
            n[i] = _mm256_cvttps_epi32(_mm256_or_ps(r, _mm256_and_ps(sign, t)));
        }
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
        p = _mm256_permutevar8x32_epi32(p, order);
        _mm256_storeu_si256((__m256i *)(q + b * BLOCK), bad ? _mm256_setzero_si256() : p);
        d[b] = bad ? NAN : db;
    }
}

static AVX2 void block_dots_avx2(const int8_t *qa, Py_ssize_t M, Py_ssize_t K, const int8_t *w, Py_ssize_t N,
                                 int32_t *out) {
    Py_ssize_t B = K / BLOCK;
    for (Py_ssize_t m = 0; m < M; m++)
        for (Py_ssize_t n = 0; n < N; n++)
            for (Py_ssize_t b = 0; b < B; b++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w + n * K + b * BLOCK));
                __m256i x = _mm256_loadu_si256((const __m256i *)(qa + m * K + b * BLOCK));
                __m256i p = dot32_avx2(_mm256_sign_epi8(v, v), v, x);
                __m128i t = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
                out[(m * N + n) * B + b] = _mm_cvtsi128_si32(t);
            }
}

static inline AVX2 int32_t hsum4_epi32(__m128i t) {
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

/* block_dots4 on AVX2: the block sums of interleaved x (`pairs` as tile4_pairs_avx2 reads them). */
static AVX2 void block_dots4_avx2(const int8_t *q, Py_ssize_t M, Py_ssize_t K, const uint8_t *w, Py_ssize_t N,
                                  int pairs, int32_t *out) {
    Py_ssize_t B = K / BLOCK;
    for (Py_ssize_t m = 0; m < M; m++)
        for (Py_ssize_t n = 0; n < N; n++)
            for (Py_ssize_t b = 0; b < B; b += pairs ? 2 : 1) {
                const int8_t *x = q + m * K + b * BLOCK;
                const uint8_t *v = w + n * (K / 2) + b * 16;
                int32_t *o = out + (m * N + n) * B + b;
                if (pairs) {
                    __m256i lo, hi;
                    nibbles2_avx2(v, &lo, &hi);
                    __m256i p = pair_avx2(lo, hi, _mm256_loadu_si256((const __m256i *)x),
                                          _mm256_loadu_si256((const __m256i *)(x + 32)));
                    o[0] = hsum4_epi32(_mm256_castsi256_si128(p));
                    o[1] = hsum4_epi32(_mm256_extracti128_si256(p, 1));
                } else {
                    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles_avx2(v), _mm256_loadu_si256((const __m256i *)x)),
                                                  _mm256_set1_epi16(1));
                    o[0] = hsum4_epi32(_mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
                }
            }
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* Dispatch                                                                                   */
/* ------------------------------------------------------------------------------------------ */

static int resolve_isa(int isa) {
    if (isa == ISA_BEST) return have_avx2() ? ISA_AVX2 : ISA_SCALAR;
    if (isa == ISA_SCALAR || (isa == ISA_AVX2 && have_avx2())) return isa;
    return -1;
}

static void quantize_rows(const void *x, int dtype, Py_ssize_t M, Py_ssize_t K, int8_t *q, float *d, int isa) {
    size_t row_bytes = (size_t)K * (dtype == DT_F32 ? 4 : 2);
    for (Py_ssize_t m = 0; m < M; m++) {
        const char *row = (const char *)x + m * row_bytes;
#if HAVE_X86
        if (isa == ISA_AVX2) {
            quantize_row_avx2(row, dtype, K, q + m * K, d + m * (K / BLOCK));
            continue;
        }
#endif
        quantize_row(row, dtype, K, q + m * K, d + m * (K / BLOCK));
    }
}

/* int4's activations: each block's d * its sum of q, and on AVX2 the blocks reordered in place as
 * the tiles read them (the header: one block at a time, or two with `pairs`). */
static void interleave(int8_t *q, const float *d, Py_ssize_t M, Py_ssize_t K, float *sum, int isa, int pairs) {
    Py_ssize_t B = K / BLOCK, step = pairs ? 2 : 1;
    int8_t t[2 * BLOCK];
    for (Py_ssize_t i = 0; i < M * B; i++) {
        int32_t total = 0;
        for (int j = 0; j < BLOCK; j++) total += q[i * BLOCK + j];
        sum[i] = d[i] * (float)total;
    }
    if (isa != ISA_AVX2) return;                            /* the scalar route reads x in its order */
    for (Py_ssize_t m = 0; m < M; m++)
        for (Py_ssize_t b = 0; b < B; b += step) {
            int8_t *x = q + m * K + b * BLOCK;
            int half = (int)step * BLOCK / 2;               /* even columns first, then odd ones */
            for (int u = 0; u < step; u++)
                for (int j = 0; j < BLOCK / 2; j++) {
                    t[u * BLOCK / 2 + j] = x[u * BLOCK + 2 * j];
                    t[half + u * BLOCK / 2 + j] = x[u * BLOCK + 2 * j + 1];
                }
            memcpy(x, t, (size_t)step * BLOCK);
        }
}

typedef void (*rows_fn)(const Act *, const Weight *, Py_ssize_t, Py_ssize_t, float *);

/* y (M, N) float32 = the product; rows of w split between threads in runs of a multiple of NR. */
static void gemm(const Act *a, const Weight *w, float *y, int threads, int isa) {
    rows_fn rows = w->w4 ? rows4_scalar : rows_scalar;
#if HAVE_X86
    if (isa == ISA_AVX2) rows = w->w4 ? rows4_avx2 : rows_avx2;
#endif
    Py_ssize_t N = w->N, chunks = threads > 1 ? threads : 1;
    Py_ssize_t per = ((N + chunks - 1) / chunks + NR - 1) / NR * NR;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
    for (Py_ssize_t c = 0; c < chunks; c++) {
        Py_ssize_t n0 = c * per, n1 = n0 + per < N ? n0 + per : N;
        if (n0 < n1) rows(a, w, n0, n1, y);
    }
}

static void store(const float *y, Py_ssize_t count, int dtype, void *out) {
    if (dtype == DT_F32) {
        if ((const void *)y != out) memcpy(out, y, (size_t)count * sizeof(float));
    } else {
        uint16_t *h = (uint16_t *)out;
        for (Py_ssize_t i = 0; i < count; i++) h[i] = f32_to_bf16(y[i]);
    }
}

static int check(Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, int dtype, int isa) {
    if (M < 0 || N < 0 || K <= 0 || K % BLOCK) {
        PyErr_Format(PyExc_ValueError, "int8dot needs K a positive multiple of %d, got M=%zd K=%zd N=%zd", BLOCK, M, K, N);
        return -1;
    }
    if (dtype != DT_F32 && dtype != DT_BF16) {
        PyErr_Format(PyExc_ValueError, "int8dot dtype code must be 0 (float32) or 1 (bfloat16), got %d", dtype);
        return -1;
    }
    if (isa < 0) {
        PyErr_SetString(PyExc_ValueError, "int8dot: this CPU does not have the instruction set asked for");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Python entry points: addresses (tensor.data_ptr()) and sizes; int8dot.py checks the tensors */
/* ------------------------------------------------------------------------------------------ */

/* x (M, K) quantized, times `w` -> out (M, N) in x's dtype; the GIL released meanwhile. */
static PyObject *run(Py_ssize_t x, int dtype, Py_ssize_t M, Py_ssize_t K, Weight *w, Py_ssize_t out, int threads,
                     int isa) {
    isa = resolve_isa(isa);
    if (check(M, K, w->N, dtype, isa)) return NULL;
    Py_ssize_t B = K / BLOCK, N = w->N;
    int8_t *q = (int8_t *)malloc((size_t)(M * K) + 1);
    float *d = (float *)malloc(sizeof(float) * (size_t)(2 * M * B) + 1);
    float *y = dtype == DT_F32 ? (float *)out : (float *)malloc(sizeof(float) * (size_t)(M * N) + 1);
    if (!q || !d || !y) {
        free(q); free(d);
        if (dtype != DT_F32) free(y);
        return PyErr_NoMemory();
    }
    Act a = {q, d, w->w4 ? d + M * B : NULL, M, K};
    Py_BEGIN_ALLOW_THREADS
    quantize_rows((const void *)x, dtype, M, K, q, d, isa);
    if (w->w4) interleave(q, d, M, K, d + M * B, isa, w->G > BLOCK);
    gemm(&a, w, y, threads < 1 ? 1 : threads, isa);
    store(y, M * N, dtype, (void *)out);
    Py_END_ALLOW_THREADS
    free(q); free(d);
    if (dtype != DT_F32) free(y);
    Py_RETURN_NONE;
}

static PyObject *py_linear(PyObject *self, PyObject *args) {
    Py_ssize_t x, w, s, out, M, K, N;
    int dtype, threads, isa;
    if (!PyArg_ParseTuple(args, "nnnnnnniii", &x, &w, &s, &out, &M, &K, &N, &dtype, &threads, &isa)) return NULL;
    Weight weight = {(const int8_t *)w, (const float *)s, NULL, NULL, NULL, N, 0};
    return run(x, dtype, M, K, &weight, out, threads, isa);
}

static PyObject *py_linear4(PyObject *self, PyObject *args) {
    Py_ssize_t x, w, s, z, out, M, K, N, G;
    int dtype, threads, isa;
    if (!PyArg_ParseTuple(args, "nnnnnnnnniii", &x, &w, &s, &z, &out, &M, &K, &N, &G, &dtype, &threads, &isa))
        return NULL;
    if (G <= 0 || G % BLOCK || K % G) {
        PyErr_Format(PyExc_ValueError, "int8dot: the group size %zd must be a multiple of %d dividing K=%zd", G, BLOCK, K);
        return NULL;
    }
    Weight weight = {NULL, NULL, (const uint8_t *)w, (const uint16_t *)s, (const uint8_t *)z, N, G};
    return run(x, dtype, M, K, &weight, out, threads, isa);
}

static PyObject *py_quantize(PyObject *self, PyObject *args) {
    Py_ssize_t x, q, d, M, K;
    int dtype, isa;
    if (!PyArg_ParseTuple(args, "nnnnnii", &x, &q, &d, &M, &K, &dtype, &isa)) return NULL;
    isa = resolve_isa(isa);
    if (check(M, K, 0, dtype, isa)) return NULL;
    quantize_rows((const void *)x, dtype, M, K, (int8_t *)q, (float *)d, isa);
    Py_RETURN_NONE;
}

static PyObject *py_block_dots(PyObject *self, PyObject *args) {
    Py_ssize_t qa, w, out, M, K, N;
    int isa;
    if (!PyArg_ParseTuple(args, "nnnnnni", &qa, &w, &out, &M, &K, &N, &isa)) return NULL;
    isa = resolve_isa(isa);
    if (check(M, K, N, DT_F32, isa)) return NULL;
    Py_ssize_t B = K / BLOCK;
    const int8_t *a = (const int8_t *)qa, *v = (const int8_t *)w;
    int32_t *o = (int32_t *)out;
#if HAVE_X86
    if (isa == ISA_AVX2) {
        block_dots_avx2(a, M, K, v, N, o);
        Py_RETURN_NONE;
    }
#endif
    for (Py_ssize_t m = 0; m < M; m++)
        for (Py_ssize_t n = 0; n < N; n++)
            for (Py_ssize_t b = 0; b < B; b++)
                o[(m * N + n) * B + b] = dot32_scalar(a + m * K + b * BLOCK, v + n * K + b * BLOCK);
    Py_RETURN_NONE;
}

static PyObject *py_block_dots4(PyObject *self, PyObject *args) {
    Py_ssize_t qa, w, out, M, K, N, G;
    int isa;
    if (!PyArg_ParseTuple(args, "nnnnnnni", &qa, &w, &out, &M, &K, &N, &G, &isa)) return NULL;
    isa = resolve_isa(isa);
    if (check(M, K, N, DT_F32, isa)) return NULL;
    if (G <= 0 || G % BLOCK || K % G) {
        PyErr_Format(PyExc_ValueError, "int8dot: the group size %zd must be a multiple of %d dividing K=%zd", G, BLOCK, K);
        return NULL;
    }
    Py_ssize_t B = K / BLOCK;
    int8_t *q = (int8_t *)malloc((size_t)(M * K) + 1);
    float *d = (float *)calloc((size_t)(2 * M * B) + 1, sizeof(float));
    if (!q || !d) { free(q); free(d); return PyErr_NoMemory(); }
    memcpy(q, (const void *)qa, (size_t)(M * K));
    interleave(q, d, M, K, d + M * B, isa, G > BLOCK);
    int32_t *o = (int32_t *)out;
#if HAVE_X86
    if (isa == ISA_AVX2) block_dots4_avx2(q, M, K, (const uint8_t *)w, N, G > BLOCK, o);
#endif
    if (isa != ISA_AVX2)
        for (Py_ssize_t m = 0; m < M; m++)
            for (Py_ssize_t n = 0; n < N; n++)
                for (Py_ssize_t b = 0; b < B; b++)
                    o[(m * N + n) * B + b] = dot4_scalar(q + m * K + b * BLOCK, (const uint8_t *)w + n * (K / 2) + b * 16);
    free(q); free(d);
    Py_RETURN_NONE;
}

static PyObject *py_isas(PyObject *self, PyObject *unused) {
    return have_avx2() ? Py_BuildValue("(ss)", "scalar", "avx2") : Py_BuildValue("(s)", "scalar");
}

static PyMethodDef methods[] = {
    {"linear", py_linear, METH_VARARGS,
     "linear(x, w, s, out, M, K, N, dtype, threads, isa): out (M, N) = the product of x quantized and w"},
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(x, q, d, M, K, dtype, isa): x (M, K) -> q (M, K) int8, d (M, K/32)"},
    {"block_dots", py_block_dots, METH_VARARGS,
     "block_dots(q, w, out, M, K, N, isa): out (M, N, K/32) int32 = the sums of q_mk * w_nk a block"},
    {"linear4", py_linear4, METH_VARARGS,
     "linear4(x, w, s, z, out, M, K, N, G, dtype, threads, isa): the same with an int4 weight in groups of G"},
    {"block_dots4", py_block_dots4, METH_VARARGS,
     "block_dots4(q, w, out, M, K, N, G, isa): out (M, N, K/32) int32 = the sums of q_mk * w_nk a block, w int4 (N, K/2)"},
    {"isas", py_isas, METH_NOARGS, "isas() -> the instruction sets this CPU runs, as names"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int8dot", "int8 x int8 products over blocks of 32.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__int8dot(void) { return PyModule_Create(&module); }
