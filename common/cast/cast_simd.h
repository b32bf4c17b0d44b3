/* Private to the CPU cast implementation (cast.c, cast_avx2.c,
 * cast_avx512.c): the SIMD entry points and the scalar element loops they
 * share for heads and tails.
 *
 * Pointers are untyped and may have any alignment: callers hand us arbitrary
 * byte offsets into tensors, and dereferencing a misaligned uint32_t * is
 * undefined behaviour, so scalar code goes through memcpy (which compiles to
 * a plain load or store) and SIMD code through unaligned-load intrinsics.
 *
 * `nt` asks for non-temporal (streaming) stores in the vector body. The
 * dispatcher sets it for destinations larger than the cache, where ordinary
 * stores would first read every destination line from memory
 * (read-for-ownership): 1.33x the bytes for a narrowing cast, 1.67x for a
 * widening one. glibc's memcpy makes the same switch. Kernels fall back to
 * ordinary stores when the destination cannot be aligned for streaming.
 */
#ifndef SP_CAST_SIMD_H
#define SP_CAST_SIMD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cast_scalar.h"

typedef void (*sp_cast_kernel)(void *dst, const void *src, size_t n, bool nt);

/* AVX2 + F16C (cast_avx2.c). */
void sp_cast_avx2_f32_to_bf16(void *dst, const void *src, size_t n, bool nt);
void sp_cast_avx2_bf16_to_f32(void *dst, const void *src, size_t n, bool nt);
void sp_cast_avx2_f32_to_f16(void *dst, const void *src, size_t n, bool nt);
void sp_cast_avx2_f16_to_f32(void *dst, const void *src, size_t n, bool nt);

/* AVX-512 F + BW + VL (cast_avx512.c). */
void sp_cast_avx512_f32_to_bf16(void *dst, const void *src, size_t n, bool nt);
void sp_cast_avx512_bf16_to_f32(void *dst, const void *src, size_t n, bool nt);
void sp_cast_avx512_f32_to_f16(void *dst, const void *src, size_t n, bool nt);
void sp_cast_avx512_f16_to_f32(void *dst, const void *src, size_t n, bool nt);
/* Same bits as sp_cast_avx512_f32_to_bf16, using AVX512-BF16 where exact;
 * only on CPUs that also have avx512bf16. The AVX-512 path uses it when the
 * CPU has it; tests call both variants directly. */
void sp_cast_avx512_f32_to_bf16_native(void *dst, const void *src, size_t n,
                                       bool nt);

/* Tests only: makes sp_cast_path_available() report the paths whose bit
 * (1u << path) is set in `mask` as unavailable, so the SP_EUNSUPPORTED
 * branch can be exercised on a CPU that has every path. 0 restores. */
void sp_cast_test_hide_paths(unsigned mask);

/* ---- scalar element loops ----------------------------------------------- */

static inline uint16_t sp_cast_ld16(const unsigned char *p) {
  uint16_t v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline uint32_t sp_cast_ld32(const unsigned char *p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline uint64_t sp_cast_ld64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void sp_cast_st16(unsigned char *p, uint16_t v) {
  memcpy(p, &v, sizeof v);
}
static inline void sp_cast_st32(unsigned char *p, uint32_t v) {
  memcpy(p, &v, sizeof v);
}
static inline void sp_cast_st64(unsigned char *p, uint64_t v) {
  memcpy(p, &v, sizeof v);
}

/* Defines sp_cast_loop_<name>(dst, src, n). Each element is loaded before it
 * is stored, which keeps the in-place bfloat16 <-> float16 case (same
 * pointer, same element size) correct. */
#define SP_CAST_DEFINE_LOOP(name, SBYTES, DBYTES, LD, ST, FN)        \
  static inline void sp_cast_loop_##name(void *dst, const void *src, \
                                         size_t n) {                 \
    unsigned char *d = (unsigned char *)dst;                         \
    const unsigned char *s = (const unsigned char *)src;             \
    for (size_t i = 0; i < n; i++)                                   \
      ST(d + i * (DBYTES), FN(LD(s + i * (SBYTES))));                \
  }

SP_CAST_DEFINE_LOOP(f32_to_bf16, 4, 2, sp_cast_ld32, sp_cast_st16,
                    sp_f32_to_bf16_bits)
SP_CAST_DEFINE_LOOP(bf16_to_f32, 2, 4, sp_cast_ld16, sp_cast_st32,
                    sp_bf16_to_f32_bits)
SP_CAST_DEFINE_LOOP(f32_to_f16, 4, 2, sp_cast_ld32, sp_cast_st16,
                    sp_f32_to_f16_bits)
SP_CAST_DEFINE_LOOP(f16_to_f32, 2, 4, sp_cast_ld16, sp_cast_st32,
                    sp_f16_to_f32_bits)
SP_CAST_DEFINE_LOOP(f64_to_f32, 8, 4, sp_cast_ld64, sp_cast_st32,
                    sp_f64_to_f32_bits)
SP_CAST_DEFINE_LOOP(f64_to_bf16, 8, 2, sp_cast_ld64, sp_cast_st16,
                    sp_f64_to_bf16_bits)
SP_CAST_DEFINE_LOOP(f64_to_f16, 8, 2, sp_cast_ld64, sp_cast_st16,
                    sp_f64_to_f16_bits)
SP_CAST_DEFINE_LOOP(f32_to_f64, 4, 8, sp_cast_ld32, sp_cast_st64,
                    sp_f32_to_f64_bits)
SP_CAST_DEFINE_LOOP(bf16_to_f64, 2, 8, sp_cast_ld16, sp_cast_st64,
                    sp_bf16_to_f64_bits)
SP_CAST_DEFINE_LOOP(f16_to_f64, 2, 8, sp_cast_ld16, sp_cast_st64,
                    sp_f16_to_f64_bits)
SP_CAST_DEFINE_LOOP(bf16_to_f16, 2, 2, sp_cast_ld16, sp_cast_st16,
                    sp_bf16_to_f16_bits)
SP_CAST_DEFINE_LOOP(f16_to_bf16, 2, 2, sp_cast_ld16, sp_cast_st16,
                    sp_f16_to_bf16_bits)

/* Source prefetch for the vector loops, called once per iteration with the
 * bytes that iteration reads. A single core's read bandwidth is bounded by
 * how many lines it keeps in flight, and the hardware prefetchers stop at
 * every 4 KiB page, so on ordinary (non-huge) pages a narrowing cast, which
 * reads twice what it writes, fell to ~0.7 of memcpy's bandwidth; prefetching
 * one page ahead into L2 and 1 KiB ahead into L1 keeps the stream going
 * across page boundaries (~0.85). The distances were tuned on large casts;
 * a neighbourhood of them performs the same. Sources under
 * SP_CAST_PF_MIN_SRC skip it: they are in L2 already and the prefetches
 * would only take load-port slots from a port-bound loop. Addresses are
 * formed as integers because they may lie past the end of the buffer: a
 * prefetch never faults, but pointer arithmetic out of the object would be
 * undefined. */
#define SP_CAST_PF_NEAR 1024u
#define SP_CAST_PF_FAR 4096u
/* Below this many source bytes the data is taken to be in L2 already. */
#define SP_CAST_PF_MIN_SRC ((size_t)1 << 20)
static inline void sp_cast_prefetch(const unsigned char *s, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64) {
    uintptr_t a = (uintptr_t)s + off;
    __builtin_prefetch((const void *)(a + SP_CAST_PF_FAR), 0, 2);
    __builtin_prefetch((const void *)(a + SP_CAST_PF_NEAR), 0, 3);
  }
}

/* The streaming-store (nt) body splits the vector range into this many
 * equal contiguous parts and converts one 64-byte output line from each in
 * turn. A single sequential stream stalls at every 4 KiB page, where the
 * hardware prefetchers stop, and software prefetch only partly covers that
 * (~0.85 of memcpy for a narrowing cast, which reads 2 bytes per byte it
 * writes). With several streams far apart their page crossings fall at
 * different times, so DRAM always has misses from some stream in flight:
 * glibc's large memcpy interleaves 4 pages for the same reason. Measured on
 * a Sapphire Rapids VM, 64Mi elements, against memcpy of the same bytes:
 * narrowing 0.84 with one stream, 0.89-0.92 with 4, 0.93-0.96 with 6, 0.89
 * with 8 (more streams than the L2 streamer tracks well next to the write
 * streams); widening 0.97 -> 1.15. Each stream also prefetches
 * SP_CAST_PF_NEAR ahead into L1; the far (next page) prefetch of the
 * single-stream loop made this body slower (0.88 instead of 0.91 with 4),
 * as the streams already keep L2 busy. */
#define SP_CAST_NT_STREAMS 6u

static inline void sp_cast_prefetch_near(const unsigned char *s, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64)
    __builtin_prefetch((const void *)((uintptr_t)s + off + SP_CAST_PF_NEAR), 0,
                       3);
}

/* Elements to convert one by one before dst is `align`-byte aligned, or
 * SIZE_MAX when it never will be (dst not even element-aligned). */
static inline size_t sp_cast_head(const void *dst, size_t dbytes,
                                  size_t align) {
  uintptr_t mis = (uintptr_t)dst & (align - 1);
  if (mis == 0) return 0;
  if (mis % dbytes != 0) return SIZE_MAX;
  return (align - mis) / dbytes;
}

#endif
