/* CPU cast dispatcher: validates arguments, picks the kernel for the
 * (source, destination) pair on the requested path, and decides between
 * ordinary and streaming stores.
 *
 * Every path can convert every floating pair: a path without a SIMD kernel
 * for a pair runs the scalar loop, which is also the definition of the bits
 * (cast_scalar.h). Only the four pairs that move most data in training
 * (float32 <-> bfloat16 / float16: shards cast to param_dtype, gradients to
 * reduce_dtype) have vector kernels; float64 appears in buffers and
 * checkpoints, where volume is small.
 */
#include "cast.h"

#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "cast_simd.h"
#include "base/sp_error.h"

#if defined(__x86_64__) || defined(__i386__)
#define SP_CAST_X86 1
#else
#define SP_CAST_X86 0
#endif

/* Row/column index of a floating dtype in the kernel tables. */
enum { SP_CI_F32, SP_CI_F64, SP_CI_F16, SP_CI_BF16, SP_CI_COUNT };

static int sp_cast_index(sp_dtype t) {
  switch (t) {
    case SP_FLOAT32: return SP_CI_F32;
    case SP_FLOAT64: return SP_CI_F64;
    case SP_FLOAT16: return SP_CI_F16;
    case SP_BFLOAT16: return SP_CI_BF16;
    default: return -1;
  }
}

typedef void (*sp_cast_loop_fn)(void *dst, const void *src, size_t n);

/* [source][destination]; the diagonal is a copy and never looked up. */
static const sp_cast_loop_fn k_scalar[SP_CI_COUNT][SP_CI_COUNT] = {
    [SP_CI_F32] = {[SP_CI_F64] = sp_cast_loop_f32_to_f64,
                   [SP_CI_F16] = sp_cast_loop_f32_to_f16,
                   [SP_CI_BF16] = sp_cast_loop_f32_to_bf16},
    [SP_CI_F64] = {[SP_CI_F32] = sp_cast_loop_f64_to_f32,
                   [SP_CI_F16] = sp_cast_loop_f64_to_f16,
                   [SP_CI_BF16] = sp_cast_loop_f64_to_bf16},
    [SP_CI_F16] = {[SP_CI_F32] = sp_cast_loop_f16_to_f32,
                   [SP_CI_F64] = sp_cast_loop_f16_to_f64,
                   [SP_CI_BF16] = sp_cast_loop_f16_to_bf16},
    [SP_CI_BF16] = {[SP_CI_F32] = sp_cast_loop_bf16_to_f32,
                    [SP_CI_F64] = sp_cast_loop_bf16_to_f64,
                    [SP_CI_F16] = sp_cast_loop_bf16_to_f16},
};

#if SP_CAST_X86
static const sp_cast_kernel k_avx2[SP_CI_COUNT][SP_CI_COUNT] = {
    [SP_CI_F32] = {[SP_CI_F16] = sp_cast_avx2_f32_to_f16,
                   [SP_CI_BF16] = sp_cast_avx2_f32_to_bf16},
    [SP_CI_F16] = {[SP_CI_F32] = sp_cast_avx2_f16_to_f32},
    [SP_CI_BF16] = {[SP_CI_F32] = sp_cast_avx2_bf16_to_f32},
};

static const sp_cast_kernel k_avx512[SP_CI_COUNT][SP_CI_COUNT] = {
    [SP_CI_F32] = {[SP_CI_F16] = sp_cast_avx512_f32_to_f16,
                   [SP_CI_BF16] = sp_cast_avx512_f32_to_bf16},
    [SP_CI_F16] = {[SP_CI_F32] = sp_cast_avx512_f16_to_f32},
    [SP_CI_BF16] = {[SP_CI_F32] = sp_cast_avx512_bf16_to_f32},
};
#endif

/* Filled once by sp_cast_init(). */
static struct {
  bool avx2;
  bool avx512;
  bool avx512bf16;     /* AVX-512 path may use VCVTNE2PS2BF16 (with fix-up) */
  size_t nt_threshold; /* destination bytes from which streaming pays */
} g_cast;
static pthread_once_t g_cast_once = PTHREAD_ONCE_INIT;
/* Written only by tests, before the calls they check. */
static unsigned g_cast_hidden;

void sp_cast_test_hide_paths(unsigned mask) { g_cast_hidden = mask; }

/* Streaming stores skip the read-for-ownership of every destination line
 * (a third more traffic for a narrowing cast) but leave the result out of
 * the cache, where the next step (a collective, a checkpoint write) would
 * have found it. So they are used only when source plus destination could
 * not have stayed cached anyway: from half the last-level cache, capped at
 * 16 MiB of destination because a VM reports the whole socket's L3 while
 * sharing it with other tenants (measured on such a VM: a 48 MiB working
 * set already streams from DRAM, and from there streaming stores win). */
static size_t sp_cast_nt_threshold(void) {
  const size_t lo = (size_t)1 << 20, hi = (size_t)16 << 20;
  long l3 = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
  l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
  if (l3 <= 0) return hi;
  size_t t = (size_t)l3 / 2;
  if (t < lo) t = lo;
  if (t > hi) t = hi;
  return t;
}

static void sp_cast_init(void) {
#if SP_CAST_X86
  __builtin_cpu_init();
  g_cast.avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  g_cast.avx512 = __builtin_cpu_supports("avx512f") &&
                  __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl");
  g_cast.avx512bf16 = g_cast.avx512 && __builtin_cpu_supports("avx512bf16");
#endif
  g_cast.nt_threshold = sp_cast_nt_threshold();
}

bool sp_cast_path_available(sp_cast_path path) {
  pthread_once(&g_cast_once, sp_cast_init);
  if ((unsigned)path < SP_CAST_PATH_COUNT && (g_cast_hidden >> path) & 1u)
    return false;
  switch (path) {
    case SP_CAST_PATH_AUTO:
    case SP_CAST_PATH_SCALAR: return true;
    case SP_CAST_PATH_AVX2: return g_cast.avx2;
    case SP_CAST_PATH_AVX512: return g_cast.avx512;
    default: return false;
  }
}

const char *sp_cast_path_name(sp_cast_path path) {
  switch (path) {
    case SP_CAST_PATH_AUTO: return "auto";
    case SP_CAST_PATH_SCALAR: return "scalar";
    case SP_CAST_PATH_AVX2: return "avx2";
    case SP_CAST_PATH_AVX512: return "avx512";
    default: return "invalid";
  }
}

sp_cast_path sp_cast_path_best(void) {
  if (sp_cast_path_available(SP_CAST_PATH_AVX512)) return SP_CAST_PATH_AVX512;
  if (sp_cast_path_available(SP_CAST_PATH_AVX2)) return SP_CAST_PATH_AVX2;
  return SP_CAST_PATH_SCALAR;
}

int sp_cast_with_path(void *dst, sp_dtype dst_t, const void *src,
                      sp_dtype src_t, size_t n, sp_cast_path path) {
  int si = sp_cast_index(src_t), di = sp_cast_index(dst_t);
  if (si < 0 || di < 0) return SP_EINVAL;
  if ((int)path < 0 || path >= SP_CAST_PATH_COUNT) return SP_EINVAL;
  if (!sp_cast_path_available(path)) return SP_EUNSUPPORTED;
  if (n == 0) return 0;
  if (dst == NULL || src == NULL) return SP_EINVAL;

  if (si == di) {
    /* The same pointer is allowed and needs nothing; memmove rather than
     * memcpy so that a caller's overlapping buffers still copy correctly. */
    if (dst != src) memmove(dst, src, n * sp_dtype_size(src_t));
    return 0;
  }
  if (path == SP_CAST_PATH_AUTO) path = sp_cast_path_best();

#if SP_CAST_X86
  sp_cast_kernel k = NULL;
  if (path == SP_CAST_PATH_AVX512) {
    k = k_avx512[si][di];
    if (k == sp_cast_avx512_f32_to_bf16 && g_cast.avx512bf16)
      k = sp_cast_avx512_f32_to_bf16_native;
  } else if (path == SP_CAST_PATH_AVX2) {
    k = k_avx2[si][di];
  }
  if (k != NULL) {
    k(dst, src, n, n * sp_dtype_size(dst_t) >= g_cast.nt_threshold);
    return 0;
  }
#endif
  k_scalar[si][di](dst, src, n);
  return 0;
}

int sp_cast(void *dst, sp_dtype dst_t, const void *src, sp_dtype src_t,
            size_t n) {
  return sp_cast_with_path(dst, dst_t, src, src_t, n, SP_CAST_PATH_AUTO);
}
