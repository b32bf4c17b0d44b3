/* Scalar reference conversions between float64, float32, float16 and
 * bfloat16, on raw bit patterns.
 *
 * This header is the definition of shardplane's cast policy (cast.h): every
 * SIMD path and the CUDA kernels must produce exactly these bits, and the tests
 * compare them against it over all 2^32 float32 inputs. It is included by C
 * and by CUDA (.cu) code, so everything is `static inline` and marked
 * __host__ __device__ under nvcc.
 *
 * Only integer arithmetic is used. A float instruction would make the result
 * depend on the calling thread's MXCSR (FTZ, DAZ, rounding mode), which
 * numerical libraries are known to change behind the caller's back; integer
 * code cannot be affected.
 *
 * Policy, identical for every narrowing:
 *   - round to nearest, ties to even, in a single rounding step from the
 *     source value (float64 -> bfloat16 does not go through float32, which
 *     would round twice and can land one ulp off on a tie);
 *   - subnormal results are produced exactly (gradual underflow), never
 *     flushed; subnormal inputs are honoured;
 *   - values at or beyond the rounding boundary of the largest finite number
 *     go to infinity of the same sign;
 *   - NaN stays NaN with its sign and the top payload bits that fit, and the
 *     quiet bit set. For float32 -> bfloat16 that is (u >> 16) | 0x0040, the
 *     same bits x86 VCVTNEPS2BF16 gives; for float32 -> float16 it is what
 *     F16C VCVTPS2PH gives.
 * Widening is exact; a NaN keeps sign and payload and gets the quiet bit set
 * (an input signalling NaN comes out quiet, as every hardware widening does).
 *
 * The one bridge between float values and these bit patterns is here too
 * (sp_f32_to_bits and friends), so host and device code that computes in
 * float and rounds with these functions shares one definition of both.
 */
#ifndef SP_CAST_SCALAR_H
#define SP_CAST_SCALAR_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "dtype.h"

#ifdef __CUDACC__
#define SP_HD __host__ __device__
#else
#define SP_HD
#endif

#define SP_F32_ABS_MASK 0x7FFFFFFFu
#define SP_F32_INF 0x7F800000u
#define SP_F32_QUIET 0x00400000u
#define SP_F64_ABS_MASK 0x7FFFFFFFFFFFFFFFull
#define SP_F64_INF 0x7FF0000000000000ull
#define SP_F64_QUIET 0x0008000000000000ull

/* ---- float values <-> bit patterns -------------------------------------
 * A reinterpretation, no arithmetic. On the host memcpy is the defined way
 * in C (a pointer cast would break strict aliasing) and compiles to one
 * move; on the device the intrinsics say the same thing. */

SP_HD static inline uint32_t sp_f32_to_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u;
#endif
}

SP_HD static inline float sp_f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  memcpy(&v, &u, sizeof v);
  return v;
#endif
}

SP_HD static inline uint64_t sp_f64_to_bits(double v) {
#if defined(__CUDA_ARCH__)
  return (uint64_t)__double_as_longlong(v);
#else
  uint64_t u;
  memcpy(&u, &v, sizeof u);
  return u;
#endif
}

SP_HD static inline double sp_f64_from_bits(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double((long long)u);
#else
  double v;
  memcpy(&v, &u, sizeof v);
  return v;
#endif
}

/* Number of leading zero bits; x != 0. */
SP_HD static inline int sp_cast_clz32(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __clz((int)x);
#elif defined(__GNUC__) || defined(__clang__)
  return __builtin_clz(x);
#else
  int n = 0;
  while (!(x & 0x80000000u)) {
    x <<= 1;
    n++;
  }
  return n;
#endif
}

/* ---- float32 -> bfloat16 ------------------------------------------------ */

/* Adding 0x7FFF plus the lowest kept bit rounds to nearest-even on the
 * truncated 16 bits; a carry out of the mantissa bumps the exponent, which
 * is exactly right for binades and for overflow to infinity. It is wrong only
 * for NaN (0x7F800001 would become inf, 0x7FFFFFFF would wrap to -0), hence
 * the special case. The addition cannot overflow 32 bits: the largest
 * non-NaN pattern is 0xFF800000. */
SP_HD static inline uint16_t sp_f32_to_bf16_bits(uint32_t u) {
  if ((u & SP_F32_ABS_MASK) > SP_F32_INF)
    return (uint16_t)((u >> 16) | 0x0040u);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

SP_HD static inline uint32_t sp_bf16_to_f32_bits(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  if ((h & 0x7FFFu) > 0x7F80u) u |= SP_F32_QUIET;
  return u;
}

/* ---- float32 <-> float16 ------------------------------------------------ */

/* float16 has 5 exponent bits (bias 15) and 10 mantissa bits. Thresholds on
 * |u| as float32 bit patterns:
 *   0x477FF000 = 65520, halfway between 65504 (0x7BFF) and 2^16: ties to
 *                the even neighbour, which is infinity;
 *   0x38800000 = 2^-14, the smallest normal float16;
 *   0x33000000 = 2^-25, half the smallest subnormal: a tie that goes to the
 *                even neighbour 0, so everything up to it gives zero. */
SP_HD static inline uint16_t sp_f32_to_f16_bits(uint32_t u) {
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & SP_F32_ABS_MASK;
  if (a > SP_F32_INF) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x03FFu));
  if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);
  if (a >= 0x38800000u) {
    /* Rebias the exponent from 127 to 15 in place, then round off 13 bits
     * with the same carry trick as bfloat16; a carry out of the mantissa
     * moves to the next binade (at most 0x7BFF + 1 = 0x7C00 is excluded by
     * the overflow test above). */
    uint32_t v = a - (112u << 23);
    return (uint16_t)(sign | ((v + 0x0FFFu + ((v >> 13) & 1u)) >> 13));
  }
  if (a <= 0x33000000u) return (uint16_t)sign;
  /* Subnormal result: the value is m * 2^(e-150) with the implicit bit in
   * m; in units of the float16 subnormal step 2^-24 that is m >> (126 - e),
   * shift 14..24 here. Rounding up out of the subnormal range yields 0x0400,
   * the smallest normal, which is the right encoding. */
  uint32_t e = a >> 23;
  uint32_t m = (a & 0x007FFFFFu) | 0x00800000u;
  uint32_t s = 126u - e;
  uint32_t r = m >> s;
  uint32_t rem = m & ((1u << s) - 1u);
  uint32_t half = 1u << (s - 1u);
  if (rem > half || (rem == half && (r & 1u))) r++;
  return (uint16_t)(sign | r);
}

SP_HD static inline uint32_t sp_f16_to_f32_bits(uint16_t h) {
  uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
  uint32_t e = ((uint32_t)h >> 10) & 0x1Fu;
  uint32_t m = (uint32_t)h & 0x03FFu;
  if (e == 0x1Fu)
    return sign | SP_F32_INF | (m << 13) | (m ? SP_F32_QUIET : 0u);
  if (e != 0) return sign | ((e + 112u) << 23) | (m << 13);
  if (m == 0) return sign;
  /* Subnormal m * 2^-24 becomes a normal float32: move the leading one to
   * bit 10 (the implicit position) and lower the exponent to match. */
  int k = sp_cast_clz32(m) - 21; /* 1..10: shifts that bring m to bit 10 */
  return sign | ((uint32_t)(113 - k) << 23) | (((m << k) & 0x03FFu) << 13);
}

/* ---- float64 -> narrower ------------------------------------------------ */

/* Shifts v right by s (1..63) rounding to nearest-even. v < 2^63 so adding
 * just under half cannot overflow. */
SP_HD static inline uint64_t sp_cast_rne_shift64(uint64_t v, unsigned s) {
  return (v + ((1ull << (s - 1)) - 1u) + ((v >> s) & 1u)) >> s;
}

/* One rounding from float64 into a binary format with `ebits` exponent bits
 * and `mbits` explicit mantissa bits (float32: 8/23, bfloat16: 8/7,
 * float16: 5/10). Called with constants, so each use folds to straight-line
 * code. Returns the result bits in the low 1 + ebits + mbits bits. */
SP_HD static inline uint32_t sp_f64_narrow_bits(uint64_t d, unsigned ebits,
                                                unsigned mbits) {
  const uint32_t bias = (1u << (ebits - 1)) - 1u;
  const uint32_t emax = (1u << ebits) - 1u; /* inf/NaN exponent field */
  const uint32_t inf = emax << mbits;
  uint32_t sign = (uint32_t)(d >> 63) << (ebits + mbits);
  uint64_t a = d & SP_F64_ABS_MASK;
  if (a > SP_F64_INF) {
    uint32_t payload = (uint32_t)(a >> (52 - mbits)) & ((1u << mbits) - 1u);
    return sign | inf | (1u << (mbits - 1)) | payload;
  }
  int32_t e = (int32_t)(a >> 52);        /* float64 biased exponent, 0..2047 */
  int32_t eo = e - 1023 + (int32_t)bias; /* target biased exponent */
  if (eo >= (int32_t)emax) return sign | inf; /* >= 2^(emax-bias) */
  if (eo >= 1) {
    /* Normal target: rebias in place so the exponent field lines up, then
     * round away the extra mantissa bits. A carry ripples into the exponent
     * and, from the top binade, exactly onto infinity. */
    uint64_t v = a - ((uint64_t)(1023u - bias) << 52);
    return sign | (uint32_t)sp_cast_rne_shift64(v, 52u - mbits);
  }
  /* Subnormal (or zero) target, step 2^(1-bias-mbits). The value is
   * m * 2^(e-1075) with the implicit bit in m, so the result is m shifted
   * right by (1 - bias - mbits) - (e - 1075). m < 2^53, so from a shift of
   * 54 on the value is below half a step and rounds to zero; float64
   * subnormal inputs (e == 0) always land there. */
  int32_t s = 1076 - (int32_t)bias - (int32_t)mbits - e;
  if (s > 53) return sign;
  uint64_t m = (a & 0x000FFFFFFFFFFFFFull) | (1ull << 52);
  return sign | (uint32_t)sp_cast_rne_shift64(m, (unsigned)s);
}

SP_HD static inline uint32_t sp_f64_to_f32_bits(uint64_t d) {
  return sp_f64_narrow_bits(d, 8, 23);
}

SP_HD static inline uint16_t sp_f64_to_bf16_bits(uint64_t d) {
  return (uint16_t)sp_f64_narrow_bits(d, 8, 7);
}

SP_HD static inline uint16_t sp_f64_to_f16_bits(uint64_t d) {
  return (uint16_t)sp_f64_narrow_bits(d, 5, 10);
}

/* ---- widening to float64 (exact) ---------------------------------------- */

SP_HD static inline uint64_t sp_f32_to_f64_bits(uint32_t u) {
  uint64_t sign = (uint64_t)(u >> 31) << 63;
  uint32_t e = (u >> 23) & 0xFFu;
  uint64_t m = u & 0x007FFFFFu;
  if (e == 0xFFu)
    return sign | SP_F64_INF | (m << 29) | (m ? SP_F64_QUIET : 0u);
  if (e != 0) return sign | ((uint64_t)(e + 896u) << 52) | (m << 29);
  if (m == 0) return sign;
  /* Subnormal m * 2^-149: normalise so the leading one sits at bit 23. */
  int k = sp_cast_clz32((uint32_t)m) - 8; /* 1..23 */
  return sign | ((uint64_t)(897 - k) << 52) | (((m << k) & 0x007FFFFFu) << 29);
}

SP_HD static inline uint64_t sp_f16_to_f64_bits(uint16_t h) {
  return sp_f32_to_f64_bits(sp_f16_to_f32_bits(h));
}

SP_HD static inline uint64_t sp_bf16_to_f64_bits(uint16_t h) {
  return sp_f32_to_f64_bits(sp_bf16_to_f32_bits(h));
}

/* ---- between the two 16-bit formats ------------------------------------- */

/* Widening to float32 is exact, so going through it rounds only once. */
SP_HD static inline uint16_t sp_bf16_to_f16_bits(uint16_t h) {
  return sp_f32_to_f16_bits(sp_bf16_to_f32_bits(h));
}

SP_HD static inline uint16_t sp_f16_to_bf16_bits(uint16_t h) {
  return sp_f32_to_bf16_bits(sp_f16_to_f32_bits(h));
}

/* ---- a float32 value through a 16-bit format ---------------------------- */

/* What a bfloat16 (float16) element holds for v, as a float32 value: code
 * that computes in float32 and keeps a tensor in a 16-bit dtype rounds
 * with these, and the widening back is exact. */
SP_HD static inline float sp_f32_round_bf16(float v) {
  return sp_f32_from_bits(
      sp_bf16_to_f32_bits(sp_f32_to_bf16_bits(sp_f32_to_bits(v))));
}

SP_HD static inline float sp_f32_round_f16(float v) {
  return sp_f32_from_bits(
      sp_f16_to_f32_bits(sp_f32_to_f16_bits(sp_f32_to_bits(v))));
}

/* ---- one element of a floating array, through float64 ------------------
 * Element i of an array of dtype dt (SP_FLOAT64, SP_FLOAT32, SP_BFLOAT16,
 * SP_FLOAT16; anything else reads 0 and writes nothing) widened exactly
 * to double, and a double rounded once (RNE) to dt and stored there: the
 * element access of every kernel that computes in double (the optimizer's,
 * SGD's, the reduction's accumulation) and of its CPU reference, so both
 * read and round the same way. On the host the element is copied
 * (memcpy), so p needs no alignment; device code loads it directly and
 * needs element-aligned arrays (the launchers check). */

#if defined(__CUDA_ARCH__)
#define SP_ELEM_GET(T, p, i, out) ((out) = ((const T *)(p))[i])
#define SP_ELEM_PUT(T, p, i, v) (((T *)(p))[i] = (v))
#else
#define SP_ELEM_GET(T, p, i, out) \
  memcpy(&(out), (const unsigned char *)(p) + (i) * sizeof(T), sizeof(T))
#define SP_ELEM_PUT(T, p, i, v)                                             \
  do {                                                                      \
    T sp_elem_v_ = (v);                                                     \
    memcpy((unsigned char *)(p) + (i) * sizeof(T), &sp_elem_v_, sizeof(T)); \
  } while (0)
#endif

SP_HD static inline double sp_elem_load_f64(const void *p, int dt, size_t i) {
  uint64_t u64;
  uint32_t u32;
  uint16_t u16;
  switch (dt) {
    case SP_FLOAT64:
      SP_ELEM_GET(uint64_t, p, i, u64);
      return sp_f64_from_bits(u64);
    case SP_FLOAT32:
      SP_ELEM_GET(uint32_t, p, i, u32);
      return sp_f64_from_bits(sp_f32_to_f64_bits(u32));
    case SP_BFLOAT16:
      SP_ELEM_GET(uint16_t, p, i, u16);
      return sp_f64_from_bits(sp_bf16_to_f64_bits(u16));
    case SP_FLOAT16:
      SP_ELEM_GET(uint16_t, p, i, u16);
      return sp_f64_from_bits(sp_f16_to_f64_bits(u16));
    default: return 0.0;
  }
}

SP_HD static inline void sp_elem_store_f64(void *p, int dt, size_t i,
                                           double v) {
  uint64_t u = sp_f64_to_bits(v);
  switch (dt) {
    case SP_FLOAT64: SP_ELEM_PUT(uint64_t, p, i, u); break;
    case SP_FLOAT32: SP_ELEM_PUT(uint32_t, p, i, sp_f64_to_f32_bits(u)); break;
    case SP_BFLOAT16:
      SP_ELEM_PUT(uint16_t, p, i, sp_f64_to_bf16_bits(u));
      break;
    case SP_FLOAT16: SP_ELEM_PUT(uint16_t, p, i, sp_f64_to_f16_bits(u)); break;
    default: break;
  }
}

#undef SP_ELEM_GET
#undef SP_ELEM_PUT

#endif
