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

/* x [rows, in], weight [out, in] (float32, or bfloat16 with bf16 set), bias [out] or NULL,
 * y [rows, out]; x, bias and y contiguous float32; 1 <= rows <= 8, in % 8 == 0. */
SPECD_AVX2 static inline __attribute__((always_inline)) void rows_product(const float *x, long rows, const void *weight,
                                                                         int bf16, long out, long in, const float *bias,
                                                                         float *y) {
    if (rows < 1 || rows > 8) return; /* one register of sums per row: the caller keeps to 8 */
    size_t width = bf16 ? sizeof(uint16_t) : sizeof(float);
    for (long j = 0; j < out; j++) {
        const void *w = (const char *)weight + (size_t)j * (size_t)in * width;
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (long k = 0; k < in; k += 8) {
            __m256 wk = load_weights(w, k, bf16);
            switch (rows) { /* falls through: rows-1 .. 0 */
            case 8: acc[7] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + 7 * in + k), acc[7]); /* fall through */
            case 7: acc[6] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + 6 * in + k), acc[6]); /* fall through */
            case 6: acc[5] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + 5 * in + k), acc[5]); /* fall through */
            case 5: acc[4] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + 4 * in + k), acc[4]); /* fall through */
            case 4: acc[3] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + 3 * in + k), acc[3]); /* fall through */
            case 3: acc[2] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + 2 * in + k), acc[2]); /* fall through */
            case 2: acc[1] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + 1 * in + k), acc[1]); /* fall through */
            default: acc[0] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + k), acc[0]);
            }
        }
        float b = bias ? bias[j] : 0.0f;
        for (long r = 0; r < rows; r++) y[r * out + j] = sum_lanes(acc[r]) + b;
    }
}

SPECD_AVX2 void specd_small_rows_linear(const float *x, long rows, const float *weight, long out, long in,
                                        const float *bias, float *y) {
    rows_product(x, rows, weight, 0, out, in, bias, y);
}

/* The same product on a bfloat16 weight [out, in] (uint16 bit patterns). */
SPECD_AVX2 void specd_small_rows_linear_bf16(const float *x, long rows, const uint16_t *weight, long out, long in,
                                             const float *bias, float *y) {
    rows_product(x, rows, weight, 1, out, in, bias, y);
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
