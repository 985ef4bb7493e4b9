/* specd: y = x @ W.T (+ bias) for a few rows of x, reading W once.
 *
 * A CPU forward over a few tokens (a verify of K+1, a draft tree's step) is bound by reading
 * the weights, as a one-token step is; this kernel streams each weight row once and keeps
 * every input row's running sum in a register, so a few rows cost about what one costs.
 * Each output is the same sum in the same order whatever the row count: a row's result does
 * not depend on the rows beside it. No -ffast-math: the order below is the order computed.
 *
 * A weight may also come in bfloat16 (a draft's halved products, specd/prepacked_linear.py):
 * each 8-wide load is widened to float32 in registers (exactly: a bfloat16 is a float32's upper
 * half), then summed in the same order, so the product equals the float32 kernel's on the
 * widened weight, bit for bit, while reading half the bytes.
 */

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define SPECD_AVX2 __attribute__((target("avx2,fma")))

/* How far ahead of the weight being summed a product of PREFETCH_FROM_ROWS or more rows asks
 * for the weights it will read next. From 3 rows on, the sums take long enough that the CPU's
 * own prefetcher falls behind and the product waits on memory; asking 16 KB ahead (into L2)
 * keeps the weight streaming at the rate a one-row product reads it (benchmarks/measure_prepack.py).
 * A one- or two-row product streams as fast without it, and a one-row product read slower with
 * it. Asking past a weight's end is harmless: a prefetch never faults. */
#define PREFETCH_BYTES 16384
#define PREFETCH_FROM_ROWS 3

/* 1 when this CPU has the AVX2 and FMA instructions the product needs. */
int specd_small_rows_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

SPECD_AVX2 static inline float sum_lanes(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_hadd_ps(sum, sum);
    sum = _mm_hadd_ps(sum, sum);
    return _mm_cvtss_f32(sum);
}

/* Eight weights from row w at k, as float32: loaded, or widened from bfloat16 (shifted into a
 * float32's upper half). */
SPECD_AVX2 static inline __attribute__((always_inline)) __m256 load_weights(const void *w, long k, int bf16) {
    if (bf16) {
        __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    }
    return _mm256_loadu_ps((const float *)w + k);
}

/* acc[r] += weights wk * x[r, k:k+8], for each of the rows. */
SPECD_AVX2 static inline __attribute__((always_inline)) void add_eight(__m256 *acc, const float *x, int rows, long in,
                                                                      __m256 wk, long k) {
    for (int r = 0; r < rows; r++) acc[r] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + r * in + k), acc[r]);
}

/* x [rows, in], weight [out, in] (float32, or bfloat16 with bf16 set), bias [out] or NULL,
 * y [rows, out]; x, bias and y contiguous float32; 1 <= rows <= 8, in % 8 == 0. Inlined with
 * rows a constant (product_of_rows), so that the sums stay in registers; each row's sum runs
 * over k in order, eight lanes at a time, however the loop is cut into cache lines. */
SPECD_AVX2 static inline __attribute__((always_inline)) void rows_product(const float *x, int rows, const void *weight,
                                                                         int bf16, long out, long in, const float *bias,
                                                                         float *y) {
    const long width = bf16 ? (long)sizeof(uint16_t) : (long)sizeof(float);
    const long line = 64 / width; /* weights per 64-byte cache line: 16 or 32, whole 8-wide loads */
    const int prefetch = rows >= PREFETCH_FROM_ROWS;
    for (long j = 0; j < out; j++) {
        const char *w = (const char *)weight + j * in * width;
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        long k = 0;
        for (; k + line <= in; k += line) {
            if (prefetch) _mm_prefetch(w + k * width + PREFETCH_BYTES, _MM_HINT_T1);
            for (long lane = 0; lane < line; lane += 8) add_eight(acc, x, rows, in, load_weights(w, k + lane, bf16), k + lane);
        }
        for (; k < in; k += 8) add_eight(acc, x, rows, in, load_weights(w, k, bf16), k);
        float b = bias ? bias[j] : 0.0f;
        for (int r = 0; r < rows; r++) y[r * out + j] = sum_lanes(acc[r]) + b;
    }
}

/* The product for rows 1..8, each count its own inlined copy (any other count: nothing; the
 * caller keeps to 1..8); bf16 is a constant at both call sites below. */
SPECD_AVX2 static inline __attribute__((always_inline)) void product_of_rows(const float *x, long rows, const void *weight,
                                                                            int bf16, long out, long in,
                                                                            const float *bias, float *y) {
    switch (rows) {
    case 1: rows_product(x, 1, weight, bf16, out, in, bias, y); break;
    case 2: rows_product(x, 2, weight, bf16, out, in, bias, y); break;
    case 3: rows_product(x, 3, weight, bf16, out, in, bias, y); break;
    case 4: rows_product(x, 4, weight, bf16, out, in, bias, y); break;
    case 5: rows_product(x, 5, weight, bf16, out, in, bias, y); break;
    case 6: rows_product(x, 6, weight, bf16, out, in, bias, y); break;
    case 7: rows_product(x, 7, weight, bf16, out, in, bias, y); break;
    case 8: rows_product(x, 8, weight, bf16, out, in, bias, y); break;
    default: break;
    }
}

SPECD_AVX2 void specd_small_rows_linear(const float *x, long rows, const float *weight, long out, long in,
                                        const float *bias, float *y) {
    product_of_rows(x, rows, weight, 0, out, in, bias, y);
}

/* The same product on a bfloat16 weight [out, in] (uint16 bit patterns). */
SPECD_AVX2 void specd_small_rows_linear_bf16(const float *x, long rows, const uint16_t *weight, long out, long in,
                                             const float *bias, float *y) {
    product_of_rows(x, rows, weight, 1, out, in, bias, y);
}

#else

int specd_small_rows_supported(void) { return 0; }

void specd_small_rows_linear(const float *x, long rows, const float *weight, long out, long in, const float *bias,
                             float *y) {
    (void)x; (void)rows; (void)weight; (void)out; (void)in; (void)bias; (void)y;
}

void specd_small_rows_linear_bf16(const float *x, long rows, const uint16_t *weight, long out, long in,
                                  const float *bias, float *y) {
    (void)x; (void)rows; (void)weight; (void)out; (void)in; (void)bias; (void)y;
}

#endif
