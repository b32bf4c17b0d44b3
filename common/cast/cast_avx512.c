/* AVX-512 (F + BW + VL) cast kernels; this file alone is compiled with the
 * AVX-512 flags, and cast.c calls in only after checking the CPU.
 *
 * Every kernel produces 64 output bytes (one cache line) per step, so a
 * destination aligned by the scalar head is written in whole lines, which is
 * what streaming stores need to avoid partial-line write combining.
 *
 * bfloat16 narrowing is the integer round-to-nearest-even of cast_scalar.h
 * in vector form. Where the CPU also has AVX512-BF16, VCVTNE2PS2BF16 is used
 * for vectors without float32 subnormal inputs (it would flush those: 16.7M
 * inputs would differ from the policy); see the _native kernel below.
 * float16 uses VCVTPS2PH with imm 0x08 (round to nearest-even taken from the
 * immediate, not from MXCSR.RC): it produces exact subnormals, never
 * flushes (MXCSR.FTZ does not apply to it), and quiets NaN keeping sign and
 * the top 10 payload bits, i.e. the policy. float32 subnormal inputs
 * underflow to a signed zero in float16 whether or not MXCSR.DAZ is set, and
 * VCVTPH2PS ignores DAZ, so the bits are the same under any MXCSR (it may
 * set exception flags, which no result depends on). The tests check all of
 * this bit for bit against the scalar reference over all inputs, and under
 * FTZ + DAZ with each rounding mode.
 */
#include <immintrin.h>

#include "cast_simd.h"

/* Rounds 16 float32 to bfloat16 and leaves each result in the high half of
 * its 32-bit lane (the caller picks the high halves). NaN lanes skip the
 * rounding and just get the quiet bit: their high half is then
 * (u >> 16) | 0x0040. The NaN test is a float compare with exceptions
 * suppressed ({sae}); whether a lane is NaN does not depend on MXCSR, and
 * it is one op where the integer |u| > 0x7F800000 test takes two in this
 * port-bound loop. */
static inline __m512i sp_avx512_bf16_round(__m512i u) {
  __m512i lsb =
      _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  __m512 f = _mm512_castsi512_ps(u);
  __mmask16 nan =
      _mm512_cmp_round_ps_mask(f, f, _CMP_UNORD_Q, _MM_FROUND_NO_EXC);
  return _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
}

/* 32 float32 -> 32 bfloat16 (64 bytes). */
static inline __m512i sp_avx512_vec_f32_to_bf16(const unsigned char *s) {
  /* Odd 16-bit words of the two rounded vectors, in order: one two-source
   * permute instead of two shifts, a pack and a fix-up permute. */
  const __m512i hi_halves = _mm512_set_epi16(
      63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
      27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  __m512i r0 = sp_avx512_bf16_round(_mm512_loadu_si512((const void *)s));
  __m512i r1 = sp_avx512_bf16_round(_mm512_loadu_si512((const void *)(s + 64)));
  return _mm512_permutex2var_epi16(r0, hi_halves, r1);
}

/* The same 32 conversions with AVX512-BF16 VCVTNE2PS2BF16 where it is exact.
 * The instruction rounds to nearest-even regardless of MXCSR and produces
 * (u >> 16) | 0x0040 for NaN, i.e. the policy, except that it treats float32
 * subnormal inputs as zero. So a vector with any subnormal lane takes the
 * integer route; real data almost never has one, and then the conversion is
 * one instruction for 32 elements instead of a port-bound integer sequence
 * (it matters only while the data is in cache; from DRAM both run at memory
 * speed). Compiled for AVX512-BF16 only here and called only after the CPU
 * check in cast.c. */
__attribute__((target("avx512bf16"))) static inline __m512i
sp_avx512_vec_f32_to_bf16_native(const unsigned char *s) {
  const __m512i exp_mask = _mm512_set1_epi32(0x7F800000);
  const __m512i man_mask = _mm512_set1_epi32(0x007FFFFF);
  __m512i a = _mm512_loadu_si512((const void *)s);
  __m512i b = _mm512_loadu_si512((const void *)(s + 64));
  __mmask16 sa = _mm512_mask_test_epi32_mask(
      _mm512_testn_epi32_mask(a, exp_mask), a, man_mask);
  __mmask16 sb = _mm512_mask_test_epi32_mask(
      _mm512_testn_epi32_mask(b, exp_mask), b, man_mask);
  if (__builtin_expect((sa | sb) != 0, 0)) return sp_avx512_vec_f32_to_bf16(s);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(b),
                                      _mm512_castsi512_ps(a));
}

/* 16 bfloat16 -> 16 float32 (64 bytes). */
static inline __m512i sp_avx512_vec_bf16_to_f32(const unsigned char *s) {
  __m256i h = _mm256_loadu_si256((const __m256i *)s);
  __mmask16 nan =
      _mm256_cmpgt_epu16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7FFF)),
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

/* 16 float16 -> 16 float32 (64 bytes). Two 256-bit conversions rather than
 * one 512-bit VCVTPH2PS: same bits, the same speed from DRAM, and ~8% faster
 * with the data in L2 on the Xeon this was tuned on. */
static inline __m512i sp_avx512_vec_f16_to_f32(const unsigned char *s) {
  __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
  __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16)));
  return _mm512_castpd_si512(_mm512_insertf64x4(
      _mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* One iteration of the vector body: two vectors, one 64-byte line of
 * output. PF: prefetch the source; STORE: ordinary or streaming. */
#define SP_AVX512_STEP(name, SB, DB, PER, PF, STORE)           \
  do {                                                         \
    if (PF) sp_cast_prefetch(s + i * (SB), 2 * (PER) * (SB));  \
    __m512i v0 = sp_avx512_vec_##name(s + i * (SB));           \
    __m512i v1 = sp_avx512_vec_##name(s + (i + (PER)) * (SB)); \
    STORE(d + i * (DB), v0);                                   \
    STORE(d + (i + (PER)) * (DB), v1);                         \
  } while (0)
#define SP_AVX512_STREAM(p, v) _mm512_stream_si512((__m512i *)(p), (v))
#define SP_AVX512_STOREU(p, v) _mm512_storeu_si512((void *)(p), (v))

/* Streaming body over SP_CAST_NT_STREAMS contiguous parts (cast_simd.h says
 * why), one vector (one whole, aligned 64-byte output line) per part per
 * round. Each part is a whole number of lines, so every store stays aligned;
 * leaves i after the parts, for the single-stream loop to finish. */
#define SP_AVX512_NT_STREAMS(name, SB, DB, PER)                             \
  do {                                                                      \
    size_t part = n / (SP_CAST_NT_STREAMS * (PER)) * (PER);                 \
    for (size_t j = 0; j < part; j += (PER)) {                              \
      for (size_t k = 0; k < SP_CAST_NT_STREAMS; k++) {                     \
        size_t e = k * part + j;                                            \
        sp_cast_prefetch_near(s + e * (SB), (PER) * (SB));                  \
        SP_AVX512_STREAM(d + e * (DB), sp_avx512_vec_##name(s + e * (SB))); \
      }                                                                     \
    }                                                                       \
    i = SP_CAST_NT_STREAMS * part;                                          \
  } while (0)

/* Scalar head up to a 64-byte aligned destination, vector body, scalar
 * tail. The body comes in three variants so the per-iteration choices are
 * made once: streaming stores (nt) for destinations beyond the cache;
 * software prefetch for sources beyond L2, where it keeps DRAM and L3
 * reads flowing; neither for cache-resident data, where the prefetch
 * instructions would only take load-port slots from a port-bound loop. */
#define SP_AVX512_KERNEL(name, loop, SB, DB, PER, ATTR)                   \
  ATTR void sp_cast_avx512_##name(void *dst, const void *src, size_t n,   \
                                  bool nt) {                              \
    unsigned char *d = (unsigned char *)dst;                              \
    const unsigned char *s = (const unsigned char *)src;                  \
    size_t head = sp_cast_head(d, (DB), 64);                              \
    if (head == SIZE_MAX) {                                               \
      head = 0;                                                           \
      nt = false;                                                         \
    }                                                                     \
    if (head > n) head = n;                                               \
    sp_cast_loop_##loop(d, s, head);                                      \
    d += head * (DB);                                                     \
    s += head * (SB);                                                     \
    n -= head;                                                            \
    size_t i = 0;                                                         \
    if (nt) {                                                             \
      SP_AVX512_NT_STREAMS(name, SB, DB, PER);                            \
      for (; i + 2 * (PER) <= n; i += 2 * (PER))                          \
        SP_AVX512_STEP(name, SB, DB, PER, 1, SP_AVX512_STREAM);           \
      _mm_sfence();                                                       \
    } else if (n * (SB) >= SP_CAST_PF_MIN_SRC) {                          \
      for (; i + 2 * (PER) <= n; i += 2 * (PER))                          \
        SP_AVX512_STEP(name, SB, DB, PER, 1, SP_AVX512_STOREU);           \
    } else {                                                              \
      for (; i + 2 * (PER) <= n; i += 2 * (PER))                          \
        SP_AVX512_STEP(name, SB, DB, PER, 0, SP_AVX512_STOREU);           \
    }                                                                     \
    for (; i + (PER) <= n; i += (PER))                                    \
      SP_AVX512_STOREU(d + i * (DB), sp_avx512_vec_##name(s + i * (SB))); \
    sp_cast_loop_##loop(d + i * (DB), s + i * (SB), n - i);               \
  }

#define SP_NO_ATTR

SP_AVX512_KERNEL(f32_to_bf16, f32_to_bf16, 4, 2, 32, SP_NO_ATTR)
SP_AVX512_KERNEL(f32_to_bf16_native, f32_to_bf16, 4, 2, 32,
                 __attribute__((target("avx512bf16"))))
SP_AVX512_KERNEL(bf16_to_f32, bf16_to_f32, 2, 4, 16, SP_NO_ATTR)
SP_AVX512_KERNEL(f32_to_f16, f32_to_f16, 4, 2, 32, SP_NO_ATTR)
SP_AVX512_KERNEL(f16_to_f32, f16_to_f32, 2, 4, 16, SP_NO_ATTR)
