/* Cast kernels: the scalar reference against known vectors and independent
 * oracles, and every path against the scalar reference on every pair,
 * length, alignment and store mode. The all-2^32 float32 proofs live in
 * test_cast_exhaustive_{bf16,f16}.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <fenv.h>
#include <math.h>

#include "cast/cast.h"
#include "cast/cast_scalar.h"
#include "cast/cast_simd.h"
#include "base/sp_error.h"
#include "support/testutil.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TEST_X86 1
#else
#define TEST_X86 0
#endif

static const sp_dtype k_float_types[] = {SP_FLOAT32, SP_FLOAT64, SP_FLOAT16,
                                         SP_BFLOAT16};
#define N_FLOAT_TYPES 4

/* ---- helpers --------------------------------------------------------------
 */

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint64_t f64_bits(double d) {
  uint64_t u;
  memcpy(&u, &d, 8);
  return u;
}
static double bits_f64(uint64_t u) {
  double d;
  memcpy(&d, &u, 8);
  return d;
}

/* One element through the scalar reference, straight from cast_scalar.h
 * (not through the dispatcher tables, which are under test). */
static uint64_t ref_one(uint64_t x, sp_dtype st, sp_dtype dt) {
  if (st == dt) return x;
  switch (st) {
    case SP_FLOAT32:
      if (dt == SP_FLOAT64) return sp_f32_to_f64_bits((uint32_t)x);
      if (dt == SP_FLOAT16) return sp_f32_to_f16_bits((uint32_t)x);
      if (dt == SP_BFLOAT16) return sp_f32_to_bf16_bits((uint32_t)x);
      break;
    case SP_FLOAT64:
      if (dt == SP_FLOAT32) return sp_f64_to_f32_bits(x);
      if (dt == SP_FLOAT16) return sp_f64_to_f16_bits(x);
      if (dt == SP_BFLOAT16) return sp_f64_to_bf16_bits(x);
      break;
    case SP_FLOAT16:
      if (dt == SP_FLOAT32) return sp_f16_to_f32_bits((uint16_t)x);
      if (dt == SP_FLOAT64) return sp_f16_to_f64_bits((uint16_t)x);
      if (dt == SP_BFLOAT16) return sp_f16_to_bf16_bits((uint16_t)x);
      break;
    case SP_BFLOAT16:
      if (dt == SP_FLOAT32) return sp_bf16_to_f32_bits((uint16_t)x);
      if (dt == SP_FLOAT64) return sp_bf16_to_f64_bits((uint16_t)x);
      if (dt == SP_FLOAT16) return sp_bf16_to_f16_bits((uint16_t)x);
      break;
    default: break;
  }
  fail_msg("no reference for %s -> %s", sp_dtype_name(st), sp_dtype_name(dt));
  return 0;
}

/* Little-endian element access at any byte offset. */
static uint64_t load_elem(const unsigned char *p, size_t size) {
  uint64_t v = 0;
  memcpy(&v, p, size);
  return v;
}
static void store_elem(unsigned char *p, size_t size, uint64_t v) {
  memcpy(p, &v, size);
}

static void ref_cast(void *dst, sp_dtype dt, const void *src, sp_dtype st,
                     size_t n) {
  size_t ss = sp_dtype_size(st), ds = sp_dtype_size(dt);
  for (size_t i = 0; i < n; i++)
    store_elem(
        (unsigned char *)dst + i * ds, ds,
        ref_one(load_elem((const unsigned char *)src + i * ss, ss), st, dt));
}

/* float32 bit patterns weighted toward the places where conversions go
 * wrong: ties, subnormals, binade and overflow edges, NaN payloads. */
static uint32_t gen_f32(sp_test_rng *r) {
  uint64_t k = sp_test_rng_next(r);
  uint32_t u = (uint32_t)(k >> 32);
  uint32_t sign = u & 0x80000000u;
  switch (k & 7) {
    case 0: return u;
    case 1: return sign | (u & 0x007FFFFFu);    /* zero / subnormal */
    case 2: return (u & 0xFFFF0000u) | 0x8000u; /* bfloat16 tie */
    case 3: return (u & 0xFFFFE000u) | 0x1000u; /* float16 tie */
    case 4: /* float16 subnormal..overflow range: exponents 100..145 */
      return sign | ((100u + (uint32_t)(k >> 8) % 46u) << 23) |
             (u & 0x007FFFFFu);
    case 5: return sign | 0x7F800000u | (u & 0x007FFFFFu); /* NaN / inf */
    case 6: /* near the top of the range */
      return sign | 0x7F000000u | (u & 0x00FFFFFFu);
    default: return u & 0x807FFFFFu ? u : u | 1u;
  }
}

/* float64 patterns: random bits, exact ties and near-ties of each narrower
 * format, and every exponent region that matters (subnormal and overflow
 * edges of float32, bfloat16 and float16). */
static uint64_t gen_f64(sp_test_rng *r) {
  uint64_t k = sp_test_rng_next(r), u = sp_test_rng_next(r);
  uint64_t sign = u & 0x8000000000000000ull;
  uint64_t man = u & 0x000FFFFFFFFFFFFFull;
  static const unsigned tie_bits[] = {28, 44, 41}; /* f32, bf16, f16 */
  switch (k & 7) {
    case 0: return u;
    case 1: { /* exact tie, or one ulp either side, for one of the formats */
      unsigned b = tie_bits[(k >> 8) % 3];
      uint64_t base = (u & ~((1ull << (b + 1)) - 1)) | (1ull << b);
      int delta = (int)((k >> 16) % 3) - 1;
      return base + (uint64_t)(int64_t)delta;
    }
    case 2: /* float32 range edges: exponents 860..900 and 1140..1160 */
      if (k & 0x100)
        return sign | ((uint64_t)(860 + (k >> 9) % 41) << 52) | man;
      return sign | ((uint64_t)(1140 + (k >> 9) % 21) << 52) | man;
    case 3: /* bfloat16 subnormal range: exponents 880..900 */
      return sign | ((uint64_t)(880 + (k >> 9) % 21) << 52) | man;
    case 4: /* float16 range: exponents 990..1040 */
      return sign | ((uint64_t)(990 + (k >> 9) % 51) << 52) | man;
    case 5: return sign | 0x7FF0000000000000ull | man; /* NaN / inf */
    case 6: return sign | (man >> (k >> 9) % 53);      /* subnormal / zero */
    default: return sign | (u & 0x7FFFFFFFFFFFFFFFull);
  }
}

/* The CPU paths this machine can run, AUTO included. */
static int available_paths(sp_cast_path *out) {
  int n = 0;
  for (int p = 0; p < SP_CAST_PATH_COUNT; p++)
    if (sp_cast_path_available((sp_cast_path)p)) out[n++] = (sp_cast_path)p;
  return n;
}

/* ---- known vectors ------------------------------------------------------- */

typedef struct vec64 {
  uint64_t in, out;
} vec64;

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

static void check_vectors(const vec64 *v, size_t n, sp_dtype st, sp_dtype dt) {
  for (size_t i = 0; i < n; i++) {
    uint64_t got = ref_one(v[i].in, st, dt);
    if (got != v[i].out)
      fail_msg("%s -> %s: 0x%llx gave 0x%llx, want 0x%llx", sp_dtype_name(st),
               sp_dtype_name(dt), (unsigned long long)v[i].in,
               (unsigned long long)got, (unsigned long long)v[i].out);
    /* And through the public entry point on every path. */
    sp_cast_path paths[SP_CAST_PATH_COUNT];
    int np = available_paths(paths);
    for (int p = 0; p < np; p++) {
      uint64_t out = 0;
      assert_int_equal(sp_cast_with_path(&out, dt, &v[i].in, st, 1, paths[p]),
                       0);
      assert_true(out == v[i].out);
    }
  }
}

static void test_bf16_vectors(void **state) {
  (void)state;
  static const vec64 narrow[] = {
      {0x00000000, 0x0000},
      {0x80000000, 0x8000},
      {0x3F800000, 0x3F80},
      /* RNE ties: to the even neighbour either way */
      {0x3F808000, 0x3F80},
      {0x3F818000, 0x3F82},
      {0x3F808001, 0x3F81},
      {0x3F80FFFF, 0x3F81},
      /* overflow: 0x7F7F8000 is the tie between 0x7F7F (odd) and inf */
      {0x7F7F7FFF, 0x7F7F},
      {0x7F7F8000, 0x7F80},
      {0xFF7F8000, 0xFF80},
      {0x7F7FFFFF, 0x7F80},
      {0x7F800000, 0x7F80},
      {0xFF800000, 0xFF80},
      /* float32 subnormals are kept, not flushed */
      {0x00400000, 0x0040},
      {0x80400000, 0x8040},
      {0x00000001, 0x0000},
      {0x00008000, 0x0000},
      {0x00008001, 0x0001},
      {0x00018000, 0x0002},
      {0x007FFFFF, 0x0080},
      {0x00800000, 0x0080},
      /* NaN: sign and top payload kept, quiet bit set */
      {0x7FC00000, 0x7FC0},
      {0xFFC00000, 0xFFC0},
      {0x7F800001, 0x7FC0},
      {0xFF800001, 0xFFC0},
      {0x7FFFFFFF, 0x7FFF},
      {0xFFFFFFFF, 0xFFFF},
      {0x7FA00000, 0x7FE0},
      {0x7F810000, 0x7FC1},
      {0x7F80FFFF, 0x7FC0},
  };
  check_vectors(narrow, N_OF(narrow), SP_FLOAT32, SP_BFLOAT16);
  static const vec64 widen[] = {
      {0x0000, 0x00000000}, {0x8000, 0x80000000}, {0x3F80, 0x3F800000},
      {0x0001, 0x00010000}, {0x7F7F, 0x7F7F0000}, {0x7F80, 0x7F800000},
      {0xFF80, 0xFF800000}, {0x7F81, 0x7FC10000}, {0xFF81, 0xFFC10000},
      {0x7FC0, 0x7FC00000}, {0x7FFF, 0x7FFF0000}, {0xFFA0, 0xFFE00000},
  };
  check_vectors(widen, N_OF(widen), SP_BFLOAT16, SP_FLOAT32);
}

static void test_f16_vectors(void **state) {
  (void)state;
  /* Decimal vectors: >= 65520 overflows to infinity (docs/fsdp.md, "Cast
   * rules"), 2^-24 is the least subnormal; 0x477FEFFF, in the table below,
   * is the last float before 65520. */
  assert_int_equal(sp_f32_to_f16_bits(f32_bits(65519.99f)), 0x7BFF);
  assert_int_equal(sp_f32_to_f16_bits(f32_bits(65520.0f)), 0x7C00);
  assert_int_equal(sp_f32_to_f16_bits(f32_bits(0x1p-24f)), 0x0001);
  assert_int_equal(sp_f32_to_f16_bits(f32_bits(0x1p-25f)), 0x0000);
  assert_int_equal(sp_f32_to_f16_bits(f32_bits(0x3p-26f)), 0x0001);
  static const vec64 narrow[] = {
      {0x00000000, 0x0000},
      {0x80000000, 0x8000},
      {0x3F800000, 0x3C00},
      /* max finite and overflow: >= 65520 is infinity */
      {0x477FE000, 0x7BFF},
      {0x477FEFFF, 0x7BFF},
      {0x477FF000, 0x7C00},
      {0xC77FF000, 0xFC00},
      {0x47800000, 0x7C00},
      {0x7F7FFFFF, 0x7C00},
      {0x7F800000, 0x7C00},
      {0xFF800000, 0xFC00},
      /* gradual underflow: 2^-24, 2^-25 (tie to 0), 3*2^-26 */
      {0x33800000, 0x0001},
      {0x33000000, 0x0000},
      {0xB3000000, 0x8000},
      {0x33400000, 0x0001},
      {0x33000001, 0x0001},
      {0x33C00000, 0x0002},
      {0x34200000, 0x0002},
      /* subnormal / normal boundary */
      {0x38800000, 0x0400},
      {0x387FC000, 0x03FF},
      {0x387FE000, 0x0400},
      {0x387FDFFF, 0x03FF},
      /* ties in the normal range */
      {0x3F801000, 0x3C00},
      {0x3F803000, 0x3C02},
      {0x3F801001, 0x3C01},
      /* float32 subnormals underflow to signed zero */
      {0x00000001, 0x0000},
      {0x80000001, 0x8000},
      /* NaN: sign | 0x7C00 | 0x200 | top 10 payload bits */
      {0x7FC00000, 0x7E00},
      {0xFFC00000, 0xFE00},
      {0x7F800001, 0x7E00},
      {0x7FFFFFFF, 0x7FFF},
      {0xFFFFFFFF, 0xFFFF},
      {0x7FA02000, 0x7F01},
      {0x7F802000, 0x7E01},
  };
  check_vectors(narrow, N_OF(narrow), SP_FLOAT32, SP_FLOAT16);
  static const vec64 widen[] = {
      {0x0000, 0x00000000}, {0x8000, 0x80000000}, {0x0001, 0x33800000},
      {0x8001, 0xB3800000}, {0x03FF, 0x387FC000}, {0x0200, 0x38000000},
      {0x0400, 0x38800000}, {0x3C00, 0x3F800000}, {0x7BFF, 0x477FE000},
      {0x7C00, 0x7F800000}, {0xFC00, 0xFF800000}, {0x7C01, 0x7FC02000},
      {0x7E00, 0x7FC00000}, {0xFE00, 0xFFC00000}, {0x7FFF, 0x7FFFE000},
      {0x7D00, 0x7FE00000},
  };
  check_vectors(widen, N_OF(widen), SP_FLOAT16, SP_FLOAT32);
}

static void test_f64_vectors(void **state) {
  (void)state;
  static const vec64 to_f32[] = {
      {0x3FF0000010000000, 0x3F800000}, /* 1 + 2^-24: tie to even */
      {0x3FF0000010000001, 0x3F800001},
      {0x3FF0000030000000, 0x3F800002},
      {0x47EFFFFFE0000000, 0x7F7FFFFF}, /* FLT_MAX */
      {0x47EFFFFFF0000000, 0x7F800000}, /* tie with 2^128: inf */
      {0x47EFFFFFEFFFFFFF, 0x7F7FFFFF},
      {0xC7EFFFFFF0000000, 0xFF800000},
      {0x47F0000000000000, 0x7F800000},
      {0x7FF0000000000000, 0x7F800000},
      {0xFFF0000000000000, 0xFF800000},
      {0x36A0000000000000, 0x00000001}, /* 2^-149 */
      {0x3690000000000000, 0x00000000}, /* 2^-150: tie to 0 */
      {0x3690000000000001, 0x00000001},
      {0xB690000000000000, 0x80000000},
      {0x36A8000000000000, 0x00000002},
      {0x3810000000000000, 0x00800000},
      {0x380FFFFFF0000000, 0x00800000}, /* rounds up into the normals */
      {0x380FFFFFC0000000, 0x007FFFFF},
      {0x0000000000000001, 0x00000000},
      {0x8000000000000001, 0x80000000},
      {0x0000000000000000, 0x00000000},
      {0x8000000000000000, 0x80000000},
      {0x7FF8000000000000, 0x7FC00000},
      {0xFFF8000000000000, 0xFFC00000},
      {0x7FF0000000000001, 0x7FC00000},
      {0x7FF4000000000000, 0x7FE00000},
      {0x7FFFFFFFFFFFFFFF, 0x7FFFFFFF},
      {0x7FF0000020000000, 0x7FC00001},
  };
  check_vectors(to_f32, N_OF(to_f32), SP_FLOAT64, SP_FLOAT32);
  static const vec64 to_bf16[] = {
      {0x3FF0100000000000, 0x3F80}, {0x3FF0100000400000, 0x3F81},
      {0x3FF0300000000000, 0x3F82}, {0x47EFF00000000000, 0x7F80},
      {0x47EFEFFFFFFFFFFF, 0x7F7F}, {0x37A0000000000000, 0x0001},
      {0x3790000000000000, 0x0000}, {0x3790000000000001, 0x0001},
      {0x7FF8000000000000, 0x7FC0}, {0xFFF0000000000001, 0xFFC0},
      {0x7FF4000000000000, 0x7FE0}, {0x7FF0000000000000, 0x7F80},
      {0x8000000000000000, 0x8000},
  };
  check_vectors(to_bf16, N_OF(to_bf16), SP_FLOAT64, SP_BFLOAT16);
  static const vec64 to_f16[] = {
      {0x3FF0020000000000, 0x3C00}, {0x3FF0020000001000, 0x3C01},
      {0x40EFFC0000000000, 0x7BFF}, {0x40EFFE0000000000, 0x7C00},
      {0x40EFFDFFFFFFFFFF, 0x7BFF}, {0x3E70000000000000, 0x0001},
      {0x3E60000000000000, 0x0000}, {0x3E60000000000001, 0x0001},
      {0x7FF8000000000000, 0x7E00}, {0xFFF8000000000000, 0xFE00},
      {0x7FF0000000000001, 0x7E00}, {0x7FF0040000000000, 0x7E01},
      {0xFFF0000000000000, 0xFC00}, {0x8000000000000000, 0x8000},
  };
  check_vectors(to_f16, N_OF(to_f16), SP_FLOAT64, SP_FLOAT16);
  static const vec64 from_f32[] = {
      {0x00000001, 0x36A0000000000000}, {0x007FFFFF, 0x380FFFFFC0000000},
      {0x00400000, 0x3800000000000000}, {0x3F800000, 0x3FF0000000000000},
      {0x7F800000, 0x7FF0000000000000}, {0xFF800000, 0xFFF0000000000000},
      {0x7FC00000, 0x7FF8000000000000}, {0x7F800001, 0x7FF8000020000000},
      {0xFFFFFFFF, 0xFFFFFFFFE0000000}, {0x80000000, 0x8000000000000000},
  };
  check_vectors(from_f32, N_OF(from_f32), SP_FLOAT32, SP_FLOAT64);
  static const vec64 from_f16[] = {
      {0x0001, 0x3E70000000000000},
      {0x7C01, 0x7FF8040000000000},
      {0xFBFF, 0xC0EFFC0000000000},
  };
  check_vectors(from_f16, N_OF(from_f16), SP_FLOAT16, SP_FLOAT64);
  static const vec64 from_bf16[] = {
      {0x0001, 0x37A0000000000000},
      {0xFF81, 0xFFF8200000000000},
  };
  check_vectors(from_bf16, N_OF(from_bf16), SP_BFLOAT16, SP_FLOAT64);
}

/* float64 -> bfloat16 / float16 round once, from the double. Going through
 * float32 rounds twice and lands on a tie that then goes the wrong way;
 * these inputs are the proof that the direct path differs. */
static void test_f64_no_double_rounding(void **state) {
  (void)state;
  static const struct {
    uint64_t in;
    sp_dtype dt;
    uint16_t direct, via_f32;
  } cases[] = {
      {0x3FF0100000400000, SP_BFLOAT16, 0x3F81, 0x3F80}, /* 1+2^-8+2^-30 */
      {0x47EFEFFFFFFFFFFF, SP_BFLOAT16, 0x7F7F, 0x7F80}, /* below overflow */
      {0x3790000000000001, SP_BFLOAT16, 0x0001, 0x0000}, /* 2^-134 + ulp */
      {0x3FF0020000001000, SP_FLOAT16, 0x3C01, 0x3C00},  /* 1+2^-11+2^-40 */
      {0x40EFFDFFFFFFFFFF, SP_FLOAT16, 0x7BFF, 0x7C00},  /* below 65520 */
      {0x3E60000000000001, SP_FLOAT16, 0x0001, 0x0000},  /* 2^-25 + ulp */
  };
  for (size_t i = 0; i < N_OF(cases); i++) {
    uint16_t direct = (uint16_t)ref_one(cases[i].in, SP_FLOAT64, cases[i].dt);
    uint32_t f = sp_f64_to_f32_bits(cases[i].in);
    uint16_t via = (uint16_t)ref_one(f, SP_FLOAT32, cases[i].dt);
    assert_int_equal(direct, cases[i].direct);
    assert_int_equal(via, cases[i].via_f32);
    assert_int_not_equal(direct, via);
  }
}

/* ---- independent oracles ------------------------------------------------- */

/* float64 -> bfloat16 by a different method: round to float32 toward zero
 * with the hardware, make it round-to-odd (set the last bit if inexact),
 * then round to nearest-even. Round-to-odd into a format with at least two
 * more bits is free of double-rounding errors, and float32 has 16 more bits
 * than bfloat16, in the subnormal range too. */
static uint16_t oracle_f64_to_bf16(uint64_t bits) {
  volatile double d = bits_f64(bits);
  int old = fegetround();
  fesetround(FE_TOWARDZERO);
  volatile float f = (float)d;
  fesetround(old);
  uint32_t u = f32_bits(f);
  if ((double)f != d) u |= 1;
  return sp_f32_to_bf16_bits(u);
}

static void test_f64_oracles(void **state) {
  (void)state;
  sp_test_rng rng = {0xF64F64};
  size_t n_hw = 0, n_bf16 = 0, n_f16 = 0;
  for (int i = 0; i < 300000; i++) {
    uint64_t x = gen_f64(&rng);
    volatile double d = bits_f64(x);
    /* Hardware double -> float (SSE cvtsd2ss, default MXCSR) is exact RNE
     * and keeps NaN sign and top payload with the quiet bit: same bits. */
    volatile float f = (float)d;
    uint32_t want32 = f32_bits(f);
    uint32_t got32 = sp_f64_to_f32_bits(x);
    if (got32 != want32)
      fail_msg("f64->f32 0x%016llx: got 0x%08x, hardware 0x%08x",
               (unsigned long long)x, got32, want32);
    n_hw++;
    uint16_t got_bf = sp_f64_to_bf16_bits(x);
    if (isnan(d)) {
      assert_true((got_bf & 0x7FFF) > 0x7F80);
    } else {
      uint16_t want_bf = oracle_f64_to_bf16(x);
      if (got_bf != want_bf)
        fail_msg("f64->bf16 0x%016llx: got 0x%04x, oracle 0x%04x",
                 (unsigned long long)x, got_bf, want_bf);
      n_bf16++;
    }
#ifdef __FLT16_MAX__
    /* gcc's _Float16 conversion (libgcc soft-float, one rounding from
     * double). NaN payload rules differ between implementations: NaN only
     * has to stay NaN there. */
    uint16_t got16 = sp_f64_to_f16_bits(x);
    _Float16 h = (_Float16)d;
    uint16_t want16;
    memcpy(&want16, &h, 2);
    if (isnan(d)) {
      assert_true((got16 & 0x7FFF) > 0x7C00);
    } else if (got16 != want16) {
      fail_msg("f64->f16 0x%016llx: got 0x%04x, _Float16 0x%04x",
               (unsigned long long)x, got16, want16);
    }
    n_f16++;
#endif
  }
  /* float32 -> float64 is exact; hardware cvtss2sd agrees bit for bit,
   * including NaN (quieted, payload moved up). */
  for (int i = 0; i < 300000; i++) {
    uint32_t u = gen_f32(&rng);
    volatile float f = bits_f32(u);
    volatile double d = (double)f;
    assert_true(sp_f32_to_f64_bits(u) == f64_bits(d));
  }
  printf(
      "f64 oracles: %zu vs hardware, %zu vs round-to-odd, %zu vs "
      "_Float16\n",
      n_hw, n_bf16, n_f16);
}

/* ---- 16-bit inputs: all of them, every path -------------------------------
 */

static void test_all_16bit_inputs_every_path(void **state) {
  (void)state;
  uint16_t *in = malloc(65536 * 2);
  uint64_t *want = malloc(65536 * 8), *got = malloc(65536 * 8);
  assert_non_null(in);
  assert_non_null(want);
  assert_non_null(got);
  for (uint32_t i = 0; i < 65536; i++) in[i] = (uint16_t)i;
  sp_cast_path paths[SP_CAST_PATH_COUNT];
  int np = available_paths(paths);
  const sp_dtype srcs[] = {SP_FLOAT16, SP_BFLOAT16};
  for (int s = 0; s < 2; s++) {
    for (int t = 0; t < N_FLOAT_TYPES; t++) {
      sp_dtype dt = k_float_types[t];
      size_t bytes = 65536 * sp_dtype_size(dt);
      ref_cast(want, dt, in, srcs[s], 65536);
      for (int p = 0; p < np; p++) {
        memset(got, 0xA5, 65536 * 8);
        assert_int_equal(
            sp_cast_with_path(got, dt, in, srcs[s], 65536, paths[p]), 0);
        if (memcmp(got, want, bytes) != 0)
          fail_msg("%s -> %s differs from scalar on path %s",
                   sp_dtype_name(srcs[s]), sp_dtype_name(dt),
                   sp_cast_path_name(paths[p]));
      }
    }
  }
#ifdef __FLT16_MAX__
  /* Independent oracle for float16 -> float32/float64: gcc's _Float16. */
  for (uint32_t i = 0; i < 65536; i++) {
    _Float16 h;
    uint16_t b = (uint16_t)i;
    memcpy(&h, &b, 2);
    float f = (float)h;
    double d = (double)h;
    if (isnan(f)) {
      assert_true((sp_f16_to_f32_bits(b) & 0x7FFFFFFF) > 0x7F800000);
      continue;
    }
    assert_true(sp_f16_to_f32_bits(b) == f32_bits(f));
    assert_true(sp_f16_to_f64_bits(b) == f64_bits(d));
  }
#endif
  /* bfloat16 -> float32 is a shift: no oracle needed beyond the vectors,
   * but check the NaN rule over every NaN. */
  for (uint32_t i = 0; i < 65536; i++) {
    uint32_t f = sp_bf16_to_f32_bits((uint16_t)i);
    if ((i & 0x7FFF) > 0x7F80)
      assert_true(f == ((i << 16) | 0x00400000u));
    else
      assert_true(f == i << 16);
  }
  free(in);
  free(want);
  free(got);
}

/* ---- float32 / float64 samples, every path and kernel variant ------------ */

typedef struct kernel_variant {
  const char *name;
  sp_cast_kernel fn; /* NULL: go through sp_cast_with_path(path) */
  sp_cast_path path;
  sp_dtype st, dt;
} kernel_variant;

/* Every way this machine can convert st -> dt: each available path through
 * the public API, plus each internal kernel that a path might not pick here
 * (the AVX-512 bfloat16 kernel has a native and an emulated variant). */
static int variants_for(sp_dtype st, sp_dtype dt, kernel_variant *out) {
  int n = 0;
  for (int p = SP_CAST_PATH_SCALAR; p < SP_CAST_PATH_COUNT; p++)
    if (sp_cast_path_available((sp_cast_path)p))
      out[n++] = (kernel_variant){sp_cast_path_name((sp_cast_path)p), NULL,
                                  (sp_cast_path)p, st, dt};
#if TEST_X86
  if (st == SP_FLOAT32 && dt == SP_BFLOAT16 &&
      sp_cast_path_available(SP_CAST_PATH_AVX512)) {
    out[n++] = (kernel_variant){"avx512-emulated", sp_cast_avx512_f32_to_bf16,
                                SP_CAST_PATH_AVX512, st, dt};
    if (__builtin_cpu_supports("avx512bf16"))
      out[n++] =
          (kernel_variant){"avx512-native", sp_cast_avx512_f32_to_bf16_native,
                           SP_CAST_PATH_AVX512, st, dt};
  }
#endif
  return n;
}

static void run_variant(const kernel_variant *v, void *dst, const void *src,
                        size_t n, bool nt) {
  if (v->fn != NULL)
    v->fn(dst, src, n, nt);
  else
    assert_int_equal(sp_cast_with_path(dst, v->dt, src, v->st, n, v->path), 0);
}

static void check_sample(sp_dtype st, sp_dtype dt, const void *in, size_t n) {
  size_t ds = sp_dtype_size(dt);
  unsigned char *want = malloc(n * ds), *got = malloc(n * ds);
  assert_non_null(want);
  assert_non_null(got);
  ref_cast(want, dt, in, st, n);
  kernel_variant v[8];
  int nv = variants_for(st, dt, v);
  for (int k = 0; k < nv; k++) {
    /* Direct kernel calls also run their streaming-store loop here; the
     * public API only streams past its size threshold. */
    for (int nt = 0; nt < (v[k].fn != NULL ? 2 : 1); nt++) {
      memset(got, 0x5A, n * ds);
      run_variant(&v[k], got, in, n, nt != 0);
      for (size_t i = 0; i < n; i++) {
        if (memcmp(got + i * ds, want + i * ds, ds) != 0)
          fail_msg(
              "%s -> %s on %s%s, element %zu: input 0x%llx gave 0x%llx, "
              "scalar 0x%llx",
              sp_dtype_name(st), sp_dtype_name(dt), v[k].name,
              nt ? " (streaming)" : "", i,
              (unsigned long long)load_elem(
                  (const unsigned char *)in + i * sp_dtype_size(st),
                  sp_dtype_size(st)),
              (unsigned long long)load_elem(got + i * ds, ds),
              (unsigned long long)load_elem(want + i * ds, ds));
      }
    }
  }
  free(want);
  free(got);
}

static void test_f32_sample_every_path(void **state) {
  (void)state;
  enum { N = 1 << 18 };
  uint32_t *in = malloc(N * 4);
  assert_non_null(in);
  sp_test_rng rng = {0xF32};
  for (size_t i = 0; i < N; i++) in[i] = gen_f32(&rng);
  /* A stretch of whole vectors that mix subnormal lanes with normal ones
   * (the native bfloat16 kernel must fall back for exactly these). */
  for (size_t i = 0; i < 4096; i++)
    in[i] = (i % 5 == 0) ? (uint32_t)(i * 2654435761u) & 0x807FFFFFu
                         : 0x3F800000u + (uint32_t)i;
  for (int t = 0; t < N_FLOAT_TYPES; t++)
    if (k_float_types[t] != SP_FLOAT32)
      check_sample(SP_FLOAT32, k_float_types[t], in, N);
  free(in);
}

static void test_f64_sample_every_path(void **state) {
  (void)state;
  enum { N = 1 << 17 };
  uint64_t *in = malloc(N * 8);
  assert_non_null(in);
  sp_test_rng rng = {0xD0B1E};
  for (size_t i = 0; i < N; i++) in[i] = gen_f64(&rng);
  for (int t = 0; t < N_FLOAT_TYPES; t++)
    if (k_float_types[t] != SP_FLOAT64)
      check_sample(SP_FLOAT64, k_float_types[t], in, N);
  free(in);
}

/* ---- every pair, length, alignment --------------------------------------- */

static void test_pairs_lengths_alignment(void **state) {
  (void)state;
  enum { MAXN = 67, GUARD = 16 };
  unsigned char src[MAXN * 8 + 8], want[MAXN * 8 + 8];
  unsigned char dst[MAXN * 8 + 8 + GUARD];
  sp_test_rng rng = {0xA11};
  sp_cast_path paths[SP_CAST_PATH_COUNT];
  int np = available_paths(paths);
  size_t checked = 0;
  for (int a = 0; a < N_FLOAT_TYPES; a++) {
    for (int b = 0; b < N_FLOAT_TYPES; b++) {
      sp_dtype st = k_float_types[a], dt = k_float_types[b];
      size_t ss = sp_dtype_size(st), ds = sp_dtype_size(dt);
      for (int p = 0; p < np; p++) {
        for (size_t n = 0; n <= MAXN; n++) {
          for (size_t so = 0; so < 4; so++) {
            for (size_t dof = 0; dof < 4; dof++) {
              /* Random contents, with special values sprinkled in. */
              for (size_t i = 0; i < n; i++) {
                uint64_t x = ss == 8   ? gen_f64(&rng)
                             : ss == 4 ? gen_f32(&rng)
                                       : (uint16_t)gen_f32(&rng);
                store_elem(src + so + i * ss, ss, x);
              }
              ref_cast(want, dt, src + so, st, n);
              memset(dst, 0xCC, sizeof dst);
              assert_int_equal(
                  sp_cast_with_path(dst + dof, dt, src + so, st, n, paths[p]),
                  0);
              if (memcmp(dst + dof, want, n * ds) != 0)
                fail_msg("%s -> %s on %s: n=%zu src+%zu dst+%zu differs",
                         sp_dtype_name(st), sp_dtype_name(dt),
                         sp_cast_path_name(paths[p]), n, so, dof);
              for (size_t g = 0; g < dof; g++) assert_int_equal(dst[g], 0xCC);
              for (size_t g = dof + n * ds; g < sizeof dst; g++)
                assert_int_equal(dst[g], 0xCC);
              checked++;
            }
          }
        }
      }
    }
  }
  printf("pairs x paths x lengths 0..%d x offsets: %zu casts checked\n", MAXN,
         checked);
}

/* Destinations past the streaming threshold (at most 16 MiB) take the
 * non-temporal store loop; an odd element offset exercises the head that
 * aligns it. */
static void test_large_streaming(void **state) {
  (void)state;
  static const struct {
    sp_dtype st, dt;
    size_t n;
  } cases[] = {
      {SP_FLOAT32, SP_BFLOAT16, (size_t)9 << 20},
      {SP_FLOAT32, SP_FLOAT16, (size_t)9 << 20},
      {SP_BFLOAT16, SP_FLOAT32, (size_t)5 << 20},
      {SP_FLOAT16, SP_FLOAT32, (size_t)5 << 20},
  };
  sp_test_rng rng = {0x5EED};
  for (size_t c = 0; c < N_OF(cases); c++) {
    size_t n = cases[c].n + 3;
    size_t ss = sp_dtype_size(cases[c].st), ds = sp_dtype_size(cases[c].dt);
    unsigned char *src = malloc(n * ss + 8), *want = malloc(n * ds);
    unsigned char *dst = malloc(n * ds + 8);
    assert_non_null(src);
    assert_non_null(want);
    assert_non_null(dst);
    for (size_t i = 0; i < n; i++)
      store_elem(src + i * ss, ss,
                 ss == 4 ? gen_f32(&rng) : sp_test_rng_next(&rng));
    ref_cast(want, cases[c].dt, src, cases[c].st, n);
    for (int p = SP_CAST_PATH_AVX2; p < SP_CAST_PATH_COUNT; p++) {
      if (!sp_cast_path_available((sp_cast_path)p)) continue;
      for (size_t off = 0; off <= ds; off += ds) {
        memset(dst, 0, n * ds + 8);
        assert_int_equal(sp_cast_with_path(dst + off, cases[c].dt, src,
                                           cases[c].st, n, (sp_cast_path)p),
                         0);
        if (memcmp(dst + off, want, n * ds) != 0)
          fail_msg("%s -> %s on %s, n=%zu, dst+%zu differs",
                   sp_dtype_name(cases[c].st), sp_dtype_name(cases[c].dt),
                   sp_cast_path_name((sp_cast_path)p), n, off);
      }
    }
    free(src);
    free(want);
    free(dst);
  }
}

/* The streaming body splits the vector range into SP_CAST_NT_STREAMS parts
 * of whole output lines and finishes the rest with the single-stream loop,
 * vector loop and scalar tail. The public API streams only past its size
 * threshold, so call every SIMD kernel directly with nt set, at lengths
 * around the multiples of the partition (each part empty, one line, a few
 * lines, plus every remainder) and at aligned, element-misaligned and
 * byte-misaligned destinations (the last one cannot stream at all). */
#if TEST_X86
typedef struct nt_kernel {
  const char *name;
  sp_cast_kernel fn;
  sp_dtype st, dt;
} nt_kernel;

static int nt_kernels(nt_kernel *out) {
  int n = 0;
  if (sp_cast_path_available(SP_CAST_PATH_AVX2)) {
    out[n++] = (nt_kernel){"avx2 f32->bf16", sp_cast_avx2_f32_to_bf16,
                           SP_FLOAT32, SP_BFLOAT16};
    out[n++] = (nt_kernel){"avx2 bf16->f32", sp_cast_avx2_bf16_to_f32,
                           SP_BFLOAT16, SP_FLOAT32};
    out[n++] = (nt_kernel){"avx2 f32->f16", sp_cast_avx2_f32_to_f16, SP_FLOAT32,
                           SP_FLOAT16};
    out[n++] = (nt_kernel){"avx2 f16->f32", sp_cast_avx2_f16_to_f32, SP_FLOAT16,
                           SP_FLOAT32};
  }
  if (sp_cast_path_available(SP_CAST_PATH_AVX512)) {
    out[n++] = (nt_kernel){"avx512 f32->bf16", sp_cast_avx512_f32_to_bf16,
                           SP_FLOAT32, SP_BFLOAT16};
    out[n++] = (nt_kernel){"avx512 bf16->f32", sp_cast_avx512_bf16_to_f32,
                           SP_BFLOAT16, SP_FLOAT32};
    out[n++] = (nt_kernel){"avx512 f32->f16", sp_cast_avx512_f32_to_f16,
                           SP_FLOAT32, SP_FLOAT16};
    out[n++] = (nt_kernel){"avx512 f16->f32", sp_cast_avx512_f16_to_f32,
                           SP_FLOAT16, SP_FLOAT32};
    if (__builtin_cpu_supports("avx512bf16"))
      out[n++] = (nt_kernel){"avx512-native f32->bf16",
                             sp_cast_avx512_f32_to_bf16_native, SP_FLOAT32,
                             SP_BFLOAT16};
  }
  return n;
}
#endif

static void test_streaming_partition(void **state) {
  (void)state;
#if TEST_X86
  /* Elements per 64-byte output line: 32 narrowing, 16 widening; the
   * lengths below cover both (and the AVX2 two-vector line). */
  enum { MAXLINES = 4 * SP_CAST_NT_STREAMS + 3, GUARD = 64 };
  const size_t maxn = (size_t)MAXLINES * 32 + 31 + 64;
  /* aligned_alloc wants a multiple of the alignment. */
  const size_t dbytes = (maxn * 4 + 64 + GUARD + 63) / 64 * 64;
  nt_kernel k[9];
  int nk = nt_kernels(k);
  unsigned char *src = malloc(maxn * 4 + 8);
  unsigned char *want = malloc(maxn * 4);
  unsigned char *dst = aligned_alloc(64, dbytes);
  assert_non_null(src);
  assert_non_null(want);
  assert_non_null(dst);
  sp_test_rng rng = {0x57AEA};
  size_t checked = 0;
  for (int c = 0; c < nk; c++) {
    size_t ss = sp_dtype_size(k[c].st), ds = sp_dtype_size(k[c].dt);
    size_t line = 64 / ds;
    for (size_t i = 0; i < maxn; i++)
      store_elem(src + i * ss, ss,
                 ss == 4 ? gen_f32(&rng) : sp_test_rng_next(&rng));
    for (size_t lines = 0; lines <= MAXLINES; lines++) {
      for (size_t extra = 0; extra < line; extra += (extra < 3 ? 1 : 7)) {
        size_t n = lines * line + extra;
        ref_cast(want, k[c].dt, src, k[c].st, n);
        static const size_t offs[] = {0, 2, 4, 62, 1};
        for (size_t o = 0; o < N_OF(offs); o++) {
          size_t off = offs[o];
          if (off % ds != 0 && off != 1) continue;
          memset(dst, 0xCC, dbytes);
          k[c].fn(dst + off, src, n, true);
          if (memcmp(dst + off, want, n * ds) != 0)
            fail_msg("%s (streaming), n=%zu, dst+%zu differs", k[c].name, n,
                     off);
          for (size_t g = 0; g < off; g++) assert_int_equal(dst[g], 0xCC);
          for (size_t g = off + n * ds; g < dbytes; g++)
            assert_int_equal(dst[g], 0xCC);
          checked++;
        }
      }
    }
  }
  printf("streaming partition: %zu kernel calls checked\n", checked);
  free(src);
  free(want);
  free(dst);
#endif
}

/* Same pointer, equal element sizes: allowed by the contract. */
static void test_in_place(void **state) {
  (void)state;
  enum { N = 1000 };
  uint16_t buf[N], orig[N], want[N];
  sp_cast_path paths[SP_CAST_PATH_COUNT];
  int np = available_paths(paths);
  for (int dir = 0; dir < 2; dir++) {
    sp_dtype st = dir ? SP_FLOAT16 : SP_BFLOAT16;
    sp_dtype dt = dir ? SP_BFLOAT16 : SP_FLOAT16;
    for (int i = 0; i < N; i++) orig[i] = (uint16_t)(i * 65.537);
    ref_cast(want, dt, orig, st, N);
    for (int p = 0; p < np; p++) {
      memcpy(buf, orig, sizeof buf);
      assert_int_equal(sp_cast_with_path(buf, dt, buf, st, N, paths[p]), 0);
      assert_memory_equal(buf, want, sizeof buf);
    }
    /* Equal dtypes: a copy, in place a no-op. */
    memcpy(buf, orig, sizeof buf);
    assert_int_equal(sp_cast(buf, st, buf, st, N), 0);
    assert_memory_equal(buf, orig, sizeof buf);
  }
  float f[5] = {1, 2, 3, 4, 5}, g[5] = {0};
  assert_int_equal(sp_cast(g, SP_FLOAT32, f, SP_FLOAT32, 5), 0);
  assert_memory_equal(f, g, sizeof f);
}

/* The SIMD paths use hardware conversions for float16; their results must
 * not depend on the caller's MXCSR (flush-to-zero, denormals-are-zero,
 * rounding mode), just as the integer scalar code cannot. */
static void test_mxcsr_independent(void **state) {
  (void)state;
#if TEST_X86
  enum { N = 1 << 16 };
  uint32_t *in32 = malloc(N * 4);
  uint16_t *in16 = malloc(N * 2);
  assert_non_null(in32);
  assert_non_null(in16);
  sp_test_rng rng = {0xC5};
  for (size_t i = 0; i < N; i++) {
    in32[i] = gen_f32(&rng);
    in16[i] = (uint16_t)i;
  }
  /* Plus every float32 that rounds to a float16 subnormal or to zero. */
  for (size_t i = 0; i < 4096; i++) in32[i] = 0x33000000u + (uint32_t)i * 1031u;
  const unsigned modes[] = {
      0x8040 | (1u << 13), /* FTZ + DAZ + round down */
      0x8040 | (3u << 13), /* FTZ + DAZ + toward zero */
      0x8040 | (2u << 13), /* FTZ + DAZ + round up */
  };
  unsigned saved = _mm_getcsr();
  for (size_t m = 0; m < N_OF(modes); m++) {
    _mm_setcsr((saved & ~(0x8040u | (3u << 13))) | modes[m]);
    check_sample(SP_FLOAT32, SP_FLOAT16, in32, N);
    check_sample(SP_FLOAT32, SP_BFLOAT16, in32, N);
    check_sample(SP_FLOAT16, SP_FLOAT32, in16, N);
    check_sample(SP_BFLOAT16, SP_FLOAT32, in16, N);
    _mm_setcsr(saved);
  }
  free(in32);
  free(in16);
#else
  skip();
#endif
}

/* ---- API contract -------------------------------------------------------- */

static void test_errors(void **state) {
  (void)state;
  float f[4] = {0};
  uint16_t h[4] = {0};
  assert_int_equal(sp_cast(h, SP_INT32, f, SP_FLOAT32, 4), SP_EINVAL);
  assert_int_equal(sp_cast(h, SP_FLOAT16, f, SP_INT64, 4), SP_EINVAL);
  assert_int_equal(sp_cast(h, SP_BOOL, f, SP_BOOL, 4), SP_EINVAL);
  assert_int_equal(sp_cast(h, SP_DTYPE_INVALID, f, SP_FLOAT32, 4), SP_EINVAL);
  assert_int_equal(sp_cast(h, (sp_dtype)99, f, SP_FLOAT32, 4), SP_EINVAL);
  assert_int_equal(sp_cast(h, SP_FLOAT16, f, (sp_dtype)-1, 4), SP_EINVAL);
  assert_int_equal(sp_cast(NULL, SP_FLOAT16, f, SP_FLOAT32, 4), SP_EINVAL);
  assert_int_equal(sp_cast(h, SP_FLOAT16, NULL, SP_FLOAT32, 4), SP_EINVAL);
  assert_int_equal(sp_cast(NULL, SP_FLOAT16, NULL, SP_FLOAT32, 0), 0);
  assert_int_equal(sp_cast(NULL, SP_FLOAT16, NULL, SP_INT8, 0), SP_EINVAL);
  assert_int_equal(
      sp_cast_with_path(h, SP_FLOAT16, f, SP_FLOAT32, 4, SP_CAST_PATH_COUNT),
      SP_EINVAL);
  assert_int_equal(
      sp_cast_with_path(h, SP_FLOAT16, f, SP_FLOAT32, 4, (sp_cast_path)-3),
      SP_EINVAL);

  assert_true(sp_cast_path_available(SP_CAST_PATH_AUTO));
  assert_true(sp_cast_path_available(SP_CAST_PATH_SCALAR));
  assert_false(sp_cast_path_available(SP_CAST_PATH_COUNT));
  assert_string_equal(sp_cast_path_name(SP_CAST_PATH_AUTO), "auto");
  assert_string_equal(sp_cast_path_name(SP_CAST_PATH_SCALAR), "scalar");
  assert_string_equal(sp_cast_path_name(SP_CAST_PATH_AVX2), "avx2");
  assert_string_equal(sp_cast_path_name(SP_CAST_PATH_AVX512), "avx512");
  assert_non_null(sp_cast_path_name(SP_CAST_PATH_COUNT));
  sp_cast_path best = sp_cast_path_best();
  assert_true(sp_cast_path_available(best));
  assert_true(best != SP_CAST_PATH_AUTO);

  /* Unavailable paths: real ones on this CPU, and the SIMD paths hidden
   * through the test hook so the branch runs on any machine. */
  for (int p = SP_CAST_PATH_AVX2; p < SP_CAST_PATH_COUNT; p++) {
    if (!sp_cast_path_available((sp_cast_path)p))
      assert_int_equal(
          sp_cast_with_path(h, SP_FLOAT16, f, SP_FLOAT32, 4, (sp_cast_path)p),
          SP_EUNSUPPORTED);
  }
  sp_cast_test_hide_paths((1u << SP_CAST_PATH_AVX2) |
                          (1u << SP_CAST_PATH_AVX512));
  assert_false(sp_cast_path_available(SP_CAST_PATH_AVX2));
  assert_false(sp_cast_path_available(SP_CAST_PATH_AVX512));
  assert_int_equal(sp_cast_path_best(), SP_CAST_PATH_SCALAR);
  for (int p = SP_CAST_PATH_AVX2; p < SP_CAST_PATH_COUNT; p++)
    assert_int_equal(
        sp_cast_with_path(h, SP_FLOAT16, f, SP_FLOAT32, 4, (sp_cast_path)p),
        SP_EUNSUPPORTED);
  /* AUTO still works and falls back to scalar. */
  f[0] = 1.0f;
  assert_int_equal(sp_cast(h, SP_FLOAT16, f, SP_FLOAT32, 4), 0);
  assert_int_equal(h[0], 0x3C00);
  sp_cast_test_hide_paths(0);
  assert_int_equal(sp_cast_path_best(), best);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bf16_vectors),
      cmocka_unit_test(test_f16_vectors),
      cmocka_unit_test(test_f64_vectors),
      cmocka_unit_test(test_f64_no_double_rounding),
      cmocka_unit_test(test_f64_oracles),
      cmocka_unit_test(test_all_16bit_inputs_every_path),
      cmocka_unit_test(test_f32_sample_every_path),
      cmocka_unit_test(test_f64_sample_every_path),
      cmocka_unit_test(test_pairs_lengths_alignment),
      cmocka_unit_test(test_large_streaming),
      cmocka_unit_test(test_streaming_partition),
      cmocka_unit_test(test_in_place),
      cmocka_unit_test(test_mxcsr_independent),
      cmocka_unit_test(test_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
