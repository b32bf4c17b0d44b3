/* The deterministic host-side sums (comm_sum.h) behind every reduction on
 * host memory: a single-member communicator's (comm.c) and Gloo's
 * (comm_gloo.cc), so a group of one rounds exactly as a larger one. */
#include "comm_sum.h"

#include <string.h>

#include "base/sp_error.h"
#include "cast/cast_scalar.h"

int sp_comm_dtype_summable(sp_dtype dt) {
  switch (dt) {
    case SP_FLOAT32:
    case SP_FLOAT64:
    case SP_BFLOAT16:
    case SP_FLOAT16:
    case SP_INT64:
    case SP_INT32: return 1;
    default: return 0;
  }
}

/* Elements per chunk: the accumulators live on the stack (at most 4 KiB),
 * and a chunk is read from every block before it is written, which is what
 * lets dst alias a block. */
#define SP_SUM_CHUNK 512

/* Blocks need not be aligned (a bfloat16 buffer may start anywhere), so
 * elements are loaded and stored with memcpy, which compilers turn into
 * plain moves. LOAD(p) reads one element at p as acc_t; STORE(p, a) writes
 * one. Addition order is block 0, 1, ..., n-1 for every element: the whole
 * point of this function. */
#define SP_SUM_FN(name, acc_t, esz, LOAD, ADD, STORE)                          \
  static void name(unsigned char *dst, const void *const *blocks, uint32_t n,  \
                   size_t count) {                                             \
    acc_t acc[SP_SUM_CHUNK];                                                   \
    for (size_t k = 0; k < count; k += SP_SUM_CHUNK) {                         \
      size_t m = count - k < SP_SUM_CHUNK ? count - k : SP_SUM_CHUNK;          \
      const unsigned char *p0 = (const unsigned char *)blocks[0] + k * (esz);  \
      for (size_t j = 0; j < m; j++) acc[j] = LOAD(p0 + j * (esz));            \
      for (uint32_t i = 1; i < n; i++) {                                       \
        const unsigned char *p = (const unsigned char *)blocks[i] + k * (esz); \
        for (size_t j = 0; j < m; j++)                                         \
          acc[j] = ADD(acc[j], LOAD(p + j * (esz)));                           \
      }                                                                        \
      unsigned char *q = dst + k * (esz);                                      \
      for (size_t j = 0; j < m; j++) STORE(q + j * (esz), acc[j]);             \
    }                                                                          \
  }

static inline float load_f32(const unsigned char *p) {
  float v;
  memcpy(&v, p, sizeof v);
  return v;
}
/* A NaN sum is stored as the default quiet NaN. Which input's payload an
 * addition keeps depends on the operand order of the machine instruction,
 * and compilers swap the operands of an addition freely (it is commutative
 * for every value but NaN), so payloads would differ between builds and
 * between the vectorised and scalar parts of one loop. */
static inline void store_f32(unsigned char *p, float v) {
  if (v != v) {
    uint32_t q = SP_F32_INF | SP_F32_QUIET;
    memcpy(p, &q, sizeof q);
    return;
  }
  memcpy(p, &v, sizeof v);
}
static inline double load_f64(const unsigned char *p) {
  double v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void store_f64(unsigned char *p, double v) {
  if (v != v) {
    uint64_t q = SP_F64_INF | SP_F64_QUIET;
    memcpy(p, &q, sizeof q);
    return;
  }
  memcpy(p, &v, sizeof v);
}
/* Widening is exact, so the float32 sum sees the true values. */
static inline float load_bf16(const unsigned char *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
  return sp_f32_from_bits(sp_bf16_to_f32_bits(h));
}
/* One rounding, with the project's RNE policy (integer code, so the result
 * does not depend on this thread's MXCSR). */
static inline void store_bf16(unsigned char *p, float v) {
  uint16_t h =
      v != v ? (uint16_t)0x7FC0 : sp_f32_to_bf16_bits(sp_f32_to_bits(v));
  memcpy(p, &h, sizeof h);
}
static inline float load_f16(const unsigned char *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
  return sp_f32_from_bits(sp_f16_to_f32_bits(h));
}
static inline void store_f16(unsigned char *p, float v) {
  uint16_t h =
      v != v ? (uint16_t)0x7E00 : sp_f32_to_f16_bits(sp_f32_to_bits(v));
  memcpy(p, &h, sizeof h);
}
/* Integers add in unsigned arithmetic: wrap-around is defined there (signed
 * overflow is not), and two's complement makes the bits the same. */
static inline uint32_t load_u32(const unsigned char *p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void store_u32(unsigned char *p, uint32_t v) {
  memcpy(p, &v, sizeof v);
}
static inline uint64_t load_u64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void store_u64(unsigned char *p, uint64_t v) {
  memcpy(p, &v, sizeof v);
}

#define SP_ADD_F32(a, b) ((float)((a) + (b)))
#define SP_ADD_F64(a, b) ((double)((a) + (b)))
#define SP_ADD_U32(a, b) ((uint32_t)((a) + (b)))
#define SP_ADD_U64(a, b) ((uint64_t)((a) + (b)))

SP_SUM_FN(sum_f32, float, 4, load_f32, SP_ADD_F32, store_f32)
SP_SUM_FN(sum_f64, double, 8, load_f64, SP_ADD_F64, store_f64)
SP_SUM_FN(sum_bf16, float, 2, load_bf16, SP_ADD_F32, store_bf16)
SP_SUM_FN(sum_f16, float, 2, load_f16, SP_ADD_F32, store_f16)
SP_SUM_FN(sum_i32, uint32_t, 4, load_u32, SP_ADD_U32, store_u32)
SP_SUM_FN(sum_i64, uint64_t, 8, load_u64, SP_ADD_U64, store_u64)

int sp_comm_sum_blocks(void *dst, const void *const *blocks, uint32_t n,
                       size_t count, sp_dtype dt) {
  if (count == 0) return 0;
  if (dst == NULL || blocks == NULL || n == 0) return SP_EINVAL;
  unsigned char *out = dst;
  switch (dt) {
    case SP_FLOAT32: sum_f32(out, blocks, n, count); return 0;
    case SP_FLOAT64: sum_f64(out, blocks, n, count); return 0;
    case SP_BFLOAT16: sum_bf16(out, blocks, n, count); return 0;
    case SP_FLOAT16: sum_f16(out, blocks, n, count); return 0;
    case SP_INT32: sum_i32(out, blocks, n, count); return 0;
    case SP_INT64: sum_i64(out, blocks, n, count); return 0;
    default: return SP_EINVAL;
  }
}
