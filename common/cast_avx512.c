/* AVX-512 (F + BW + VL) cast kernels; this file alone is compiled with the
 * AVX-512 flags, and cast.c calls in only after checking the CPU.
 *
 * Every kernel produces 64 output bytes (one cache line) per step, so a
 * destination aligned by the scalar head is written in whole lines, which is
 * what streaming stores need to avoid partial-line write combining.
 *
 * bfloat16 narrowing is the integer round-to-nearest-even of cast_scalar.h
 * in vector form. VCVTNEPS2BF16 is deliberately not used: it treats float32
 * subnormal inputs as zero (16.7M inputs would differ from the policy) and
 * streaming casts are memory-bound anyway, so it would buy nothing.
 * float16 uses VCVTPS2PH with imm 0x08 (round to nearest-even from the
 * immediate, not MXCSR.RC; exceptions suppressed): it produces exact
 * subnormals, never flushes, and quiets NaN keeping sign and the top 10
 * payload bits, i.e. the policy. float32 subnormal inputs underflow to a
 * signed zero in float16 whether or not MXCSR.DAZ is set, and VCVTPH2PS
 * ignores DAZ, so the result is the same under any MXCSR; the tests check
 * this bit for bit against the scalar reference over all inputs.
 */
#include <immintrin.h>

#include "cast_simd.h"

static inline __m512i sp_avx512_bf16_round(__m512i u) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i inf = _mm512_set1_epi32(0x7F800000);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i bias = _mm512_set1_epi32(0x7FFF);
  const __m512i quiet = _mm512_set1_epi32(0x0040);
  __m512i hi = _mm512_srli_epi32(u, 16);
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, bias),
                               _mm512_and_si512(hi, one));
  r = _mm512_srli_epi32(r, 16);
  __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
  return _mm512_mask_or_epi32(r, nan, hi, quiet);
}

/* 32 float32 -> 32 bfloat16 (64 bytes). */
static inline __m512i sp_avx512_vec_f32_to_bf16(const unsigned char *s) {
  __m512i r0 = sp_avx512_bf16_round(_mm512_loadu_si512((const void *)s));
  __m512i r1 =
      sp_avx512_bf16_round(_mm512_loadu_si512((const void *)(s + 64)));
  /* packus works within 128-bit lanes; the qword permute restores order. */
  __m512i p = _mm512_packus_epi32(r0, r1);
  return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                  p);
}

/* 16 bfloat16 -> 16 float32 (64 bytes). */
static inline __m512i sp_avx512_vec_bf16_to_f32(const unsigned char *s) {
  __m256i h = _mm256_loadu_si256((const __m256i *)s);
  __mmask16 nan = _mm256_cmpgt_epu16_mask(
      _mm256_and_si256(h, _mm256_set1_epi16(0x7FFF)),
      _mm256_set1_epi16(0x7F80));
  __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  return _mm512_mask_or_epi32(u, nan, u, _mm512_set1_epi32(0x00400000));
}

#define SP_F16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* 32 float32 -> 32 float16 (64 bytes). */
static inline __m512i sp_avx512_vec_f32_to_f16(const unsigned char *s) {
  __m256i lo = _mm512_cvtps_ph(_mm512_loadu_ps((const float *)s), SP_F16_RNE);
  __m256i hi =
      _mm512_cvtps_ph(_mm512_loadu_ps((const float *)(s + 64)), SP_F16_RNE);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* 16 float16 -> 16 float32 (64 bytes). */
static inline __m512i sp_avx512_vec_f16_to_f32(const unsigned char *s) {
  return _mm512_castps_si512(
      _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s)));
}

/* Scalar head up to a 64-byte aligned destination, vector body of PER
 * elements per 64-byte store (unrolled twice), scalar tail. */
#define SP_AVX512_KERNEL(name, SB, DB, PER)                                    \
  void sp_cast_avx512_##name(void *dst, const void *src, size_t n, bool nt) {  \
    unsigned char *d = (unsigned char *)dst;                                   \
    const unsigned char *s = (const unsigned char *)src;                       \
    size_t head = sp_cast_head(d, (DB), 64);                                   \
    if (head == SIZE_MAX) {                                                    \
      head = 0;                                                                \
      nt = false;                                                              \
    }                                                                          \
    if (head > n) head = n;                                                    \
    sp_cast_loop_##name(d, s, head);                                           \
    d += head * (DB);                                                          \
    s += head * (SB);                                                          \
    n -= head;                                                                 \
    size_t i = 0;                                                              \
    if (nt) {                                                                  \
      for (; i + 2 * (PER) <= n; i += 2 * (PER)) {                             \
        __m512i v0 = sp_avx512_vec_##name(s + i * (SB));                       \
        __m512i v1 = sp_avx512_vec_##name(s + (i + (PER)) * (SB));             \
        _mm512_stream_si512((__m512i *)(d + i * (DB)), v0);                    \
        _mm512_stream_si512((__m512i *)(d + (i + (PER)) * (DB)), v1);          \
      }                                                                        \
      _mm_sfence();                                                            \
    } else {                                                                   \
      for (; i + 2 * (PER) <= n; i += 2 * (PER)) {                             \
        __m512i v0 = sp_avx512_vec_##name(s + i * (SB));                       \
        __m512i v1 = sp_avx512_vec_##name(s + (i + (PER)) * (SB));             \
        _mm512_storeu_si512((void *)(d + i * (DB)), v0);                       \
        _mm512_storeu_si512((void *)(d + (i + (PER)) * (DB)), v1);             \
      }                                                                        \
    }                                                                          \
    for (; i + (PER) <= n; i += (PER))                                         \
      _mm512_storeu_si512((void *)(d + i * (DB)),                              \
                          sp_avx512_vec_##name(s + i * (SB)));                 \
    sp_cast_loop_##name(d + i * (DB), s + i * (SB), n - i);                    \
  }

SP_AVX512_KERNEL(f32_to_bf16, 4, 2, 32)
SP_AVX512_KERNEL(bf16_to_f32, 2, 4, 16)
SP_AVX512_KERNEL(f32_to_f16, 4, 2, 32)
SP_AVX512_KERNEL(f16_to_f32, 2, 4, 16)
