/* AVX2 + F16C cast kernels; this file alone is compiled with those flags,
 * and cast.c calls in only after checking the CPU.
 *
 * Same structure and same arithmetic as cast_avx512.c (see there for why
 * bfloat16 is integer emulation and why VCVTPS2PH with imm 0x08 matches the
 * policy), at 32 output bytes per vector; the body is unrolled so each
 * iteration writes one whole 64-byte line.
 */
#include <immintrin.h>

#include "cast_simd.h"

static inline __m256i sp_avx2_bf16_round(__m256i u) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i inf = _mm256_set1_epi32(0x7F800000);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bias = _mm256_set1_epi32(0x7FFF);
  const __m256i quiet = _mm256_set1_epi32(0x0040);
  __m256i hi = _mm256_srli_epi32(u, 16);
  __m256i r =
      _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(hi, one));
  r = _mm256_srli_epi32(r, 16);
  /* Both operands are non-negative as int32, so a signed compare works. */
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
  return _mm256_blendv_epi8(r, _mm256_or_si256(hi, quiet), nan);
}

/* 16 float32 -> 16 bfloat16 (32 bytes). */
static inline __m256i sp_avx2_vec_f32_to_bf16(const unsigned char *s) {
  __m256i r0 = sp_avx2_bf16_round(_mm256_loadu_si256((const __m256i *)s));
  __m256i r1 =
      sp_avx2_bf16_round(_mm256_loadu_si256((const __m256i *)(s + 32)));
  /* packus works within 128-bit lanes; the qword permute restores order.
   * Every value is <= 0xFFFF, so the unsigned saturation never clips. */
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
}

/* 8 bfloat16 -> 8 float32 (32 bytes). */
static inline __m256i sp_avx2_vec_bf16_to_f32(const unsigned char *s) {
  __m256i u = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)s)), 16);
  __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                         _mm256_set1_epi32(0x7F800000));
  return _mm256_or_si256(u,
                         _mm256_and_si256(nan, _mm256_set1_epi32(0x00400000)));
}

#define SP_F16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* 16 float32 -> 16 float16 (32 bytes). */
static inline __m256i sp_avx2_vec_f32_to_f16(const unsigned char *s) {
  __m128i lo = _mm256_cvtps_ph(_mm256_loadu_ps((const float *)s), SP_F16_RNE);
  __m128i hi =
      _mm256_cvtps_ph(_mm256_loadu_ps((const float *)(s + 32)), SP_F16_RNE);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* 8 float16 -> 8 float32 (32 bytes). */
static inline __m256i sp_avx2_vec_f16_to_f32(const unsigned char *s) {
  return _mm256_castps_si256(
      _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s)));
}

/* One iteration of the vector body: two vectors, one 64-byte line of
 * output. PF: prefetch the source; STORE: ordinary or streaming. */
#define SP_AVX2_STEP(name, SB, DB, PER, PF, STORE)            \
  do {                                                        \
    if (PF) sp_cast_prefetch(s + i * (SB), 2 * (PER) * (SB)); \
    __m256i v0 = sp_avx2_vec_##name(s + i * (SB));            \
    __m256i v1 = sp_avx2_vec_##name(s + (i + (PER)) * (SB));  \
    STORE(d + i * (DB), v0);                                  \
    STORE(d + (i + (PER)) * (DB), v1);                        \
  } while (0)
#define SP_AVX2_STREAM(p, v) _mm256_stream_si256((__m256i *)(p), (v))
#define SP_AVX2_STOREU(p, v) _mm256_storeu_si256((__m256i *)(p), (v))

/* Streaming body over SP_CAST_NT_STREAMS contiguous parts (cast_simd.h says
 * why), two vectors (one whole, aligned 64-byte output line) per part per
 * round. Each part is a whole number of lines, so every store stays aligned;
 * leaves i after the parts, for the single-stream loop to finish. */
#define SP_AVX2_NT_STREAMS(name, SB, DB, PER)                         \
  do {                                                                \
    size_t part = n / (SP_CAST_NT_STREAMS * 2 * (PER)) * (2 * (PER)); \
    for (size_t j = 0; j < part; j += 2 * (PER)) {                    \
      for (size_t k = 0; k < SP_CAST_NT_STREAMS; k++) {               \
        size_t e = k * part + j;                                      \
        sp_cast_prefetch_near(s + e * (SB), 2 * (PER) * (SB));        \
        __m256i v0 = sp_avx2_vec_##name(s + e * (SB));                \
        __m256i v1 = sp_avx2_vec_##name(s + (e + (PER)) * (SB));      \
        SP_AVX2_STREAM(d + e * (DB), v0);                             \
        SP_AVX2_STREAM(d + (e + (PER)) * (DB), v1);                   \
      }                                                               \
    }                                                                 \
    i = SP_CAST_NT_STREAMS * part;                                    \
  } while (0)

/* Scalar head up to a 64-byte aligned destination, vector body, scalar
 * tail. The body comes in three variants so the per-iteration choices are
 * made once: streaming stores (nt) for destinations beyond the cache;
 * software prefetch for sources beyond L2, where it keeps DRAM and L3
 * reads flowing; neither for cache-resident data, where the prefetch
 * instructions would only take load-port slots from a port-bound loop. */
#define SP_AVX2_KERNEL(name, SB, DB, PER)                                   \
  void sp_cast_avx2_##name(void *dst, const void *src, size_t n, bool nt) { \
    unsigned char *d = (unsigned char *)dst;                                \
    const unsigned char *s = (const unsigned char *)src;                    \
    size_t head = sp_cast_head(d, (DB), 64);                                \
    if (head == SIZE_MAX) {                                                 \
      head = 0;                                                             \
      nt = false;                                                           \
    }                                                                       \
    if (head > n) head = n;                                                 \
    sp_cast_loop_##name(d, s, head);                                        \
    d += head * (DB);                                                       \
    s += head * (SB);                                                       \
    n -= head;                                                              \
    size_t i = 0;                                                           \
    if (nt) {                                                               \
      SP_AVX2_NT_STREAMS(name, SB, DB, PER);                                \
      for (; i + 2 * (PER) <= n; i += 2 * (PER))                            \
        SP_AVX2_STEP(name, SB, DB, PER, 1, SP_AVX2_STREAM);                 \
      _mm_sfence();                                                         \
    } else if (n * (SB) >= SP_CAST_PF_MIN_SRC) {                            \
      for (; i + 2 * (PER) <= n; i += 2 * (PER))                            \
        SP_AVX2_STEP(name, SB, DB, PER, 1, SP_AVX2_STOREU);                 \
    } else {                                                                \
      for (; i + 2 * (PER) <= n; i += 2 * (PER))                            \
        SP_AVX2_STEP(name, SB, DB, PER, 0, SP_AVX2_STOREU);                 \
    }                                                                       \
    for (; i + (PER) <= n; i += (PER))                                      \
      SP_AVX2_STOREU(d + i * (DB), sp_avx2_vec_##name(s + i * (SB)));       \
    sp_cast_loop_##name(d + i * (DB), s + i * (SB), n - i);                 \
  }

SP_AVX2_KERNEL(f32_to_bf16, 4, 2, 16)
SP_AVX2_KERNEL(bf16_to_f32, 2, 4, 8)
SP_AVX2_KERNEL(f32_to_f16, 4, 2, 16)
SP_AVX2_KERNEL(f16_to_f32, 2, 4, 8)
