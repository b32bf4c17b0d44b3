/* float32 -> bfloat16 over all 2^32 inputs: every SIMD kernel this CPU can
 * run must give the scalar reference's bits on every input, NaN included.
 *
 * Independent check where the CPU has AVX512-BF16: the hardware
 * VCVTNEPS2BF16 must agree with the reference everywhere except on float32
 * subnormal inputs, which it flushes. Those are exactly the subnormals the
 * policy rounds to a non-zero bfloat16, |u| in [0x8001, 0x7FFFFF] for each
 * sign: 2 * (0x7FFFFF - 0x8000) = 16,711,678 inputs.
 *
 * The 4096 blocks of 2^20 inputs are shared among one thread per core;
 * results are collected and asserted on the main thread (cmocka's asserts
 * are not thread-safe). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "cast/cast.h"
#include "cast/cast_scalar.h"
#include "cast/cast_simd.h"
#include "support/testutil.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_NATIVE_ORACLE 1
#else
#define HAVE_NATIVE_ORACLE 0
#endif

#define BLOCK ((size_t)1 << 20)
#define NBLOCKS ((uint32_t)1 << 12)
#define MAX_KERNELS 4
#define MAX_THREADS 16

typedef struct kernel {
  char name[64];
  sp_cast_kernel fn; /* NULL: sp_cast_with_path(path) */
  sp_cast_path path;
} kernel;

typedef struct run {
  kernel k[MAX_KERNELS];
  int nk;
  bool native;
  atomic_uint next;
  atomic_ullong checked[MAX_KERNELS], bad[MAX_KERNELS];
  atomic_uint first_bad[MAX_KERNELS];
  atomic_ullong native_checked, native_sub, native_other;
  atomic_uint native_first_other;
  atomic_int alloc_failed;
} run;

#if HAVE_NATIVE_ORACLE
__attribute__((target("avx512bf16,avx512f"))) static void native_f32_to_bf16(
    uint16_t *dst, const uint32_t *src, size_t n) {
  for (size_t i = 0; i < n; i += 16) {
    __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps((const float *)(src + i)));
    _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)h);
  }
}
#endif

static void *worker(void *arg) {
  run *r = arg;
  uint32_t *in = malloc(BLOCK * 4);
  uint16_t *ref = malloc(BLOCK * 2), *out = malloc(BLOCK * 2);
  if (in == NULL || ref == NULL || out == NULL) {
    atomic_store(&r->alloc_failed, 1);
    goto done;
  }
  for (;;) {
    uint32_t b = atomic_fetch_add(&r->next, 1);
    if (b >= NBLOCKS) break;
    uint32_t base = b << 20;
    for (size_t i = 0; i < BLOCK; i++) in[i] = base + (uint32_t)i;
    for (size_t i = 0; i < BLOCK; i++) ref[i] = sp_f32_to_bf16_bits(in[i]);
    for (int k = 0; k < r->nk; k++) {
      memset(out, 0, BLOCK * 2);
      if (r->k[k].fn != NULL)
        r->k[k].fn(out, in, BLOCK, false);
      else if (sp_cast_with_path(out, SP_BFLOAT16, in, SP_FLOAT32, BLOCK,
                                 r->k[k].path) != 0)
        memset(out, 0xFF, BLOCK * 2); /* counted as mismatches below */
      atomic_fetch_add(&r->checked[k], BLOCK);
      if (memcmp(out, ref, BLOCK * 2) == 0) continue;
      for (size_t i = 0; i < BLOCK; i++) {
        if (out[i] == ref[i]) continue;
        if (atomic_fetch_add(&r->bad[k], 1) == 0)
          atomic_store(&r->first_bad[k], in[i]);
      }
    }
#if HAVE_NATIVE_ORACLE
    if (r->native) {
      native_f32_to_bf16(out, in, BLOCK);
      atomic_fetch_add(&r->native_checked, BLOCK);
      unsigned long long sub = 0;
      for (size_t i = 0; i < BLOCK; i++) {
        if (out[i] == ref[i]) continue;
        uint32_t a = in[i] & 0x7FFFFFFFu;
        if (a != 0 && a < 0x00800000u) {
          sub++;
        } else if (atomic_fetch_add(&r->native_other, 1) == 0) {
          atomic_store(&r->native_first_other, in[i]);
        }
      }
      atomic_fetch_add(&r->native_sub, sub);
    }
#endif
  }
done:
  free(in);
  free(ref);
  free(out);
  return NULL;
}

static void test_all_f32_to_bf16(void **state) {
  (void)state;
  static run r; /* zero-initialised, atomics included */
  for (int p = SP_CAST_PATH_AVX2; p < SP_CAST_PATH_COUNT; p++) {
    if (!sp_cast_path_available((sp_cast_path)p)) continue;
    kernel *k = &r.k[r.nk++];
    snprintf(k->name, sizeof k->name, "%s", sp_cast_path_name((sp_cast_path)p));
    k->path = (sp_cast_path)p;
  }
#if HAVE_NATIVE_ORACLE
  /* With AVX512-BF16 the avx512 path runs its native kernel; the emulated
   * one it would use elsewhere gets its own full run. */
  if (sp_cast_path_available(SP_CAST_PATH_AVX512) &&
      __builtin_cpu_supports("avx512bf16")) {
    snprintf(r.k[r.nk - 1].name, sizeof r.k[0].name,
             "avx512 (native bf16 + subnormal fix-up)");
    kernel *k = &r.k[r.nk++];
    snprintf(k->name, sizeof k->name, "avx512 (integer emulation)");
    k->fn = sp_cast_avx512_f32_to_bf16;
    k->path = SP_CAST_PATH_AVX512;
    r.native = true;
  }
#endif
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int nt = cpus < 1 ? 1 : cpus > MAX_THREADS ? MAX_THREADS : (int)cpus;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  pthread_t th[MAX_THREADS];
  for (int i = 0; i < nt; i++)
    assert_int_equal(pthread_create(&th[i], NULL, worker, &r), 0);
  for (int i = 0; i < nt; i++) pthread_join(th[i], NULL);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  assert_int_equal(atomic_load(&r.alloc_failed), 0);

  printf("float32 -> bfloat16, all 2^32 inputs, %d threads, %.1f s\n", nt,
         (double)(t1.tv_sec - t0.tv_sec) +
             (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9);
  for (int k = 0; k < r.nk; k++)
    printf("  %-40s %llu inputs checked, %llu differ from scalar\n",
           r.k[k].name, (unsigned long long)atomic_load(&r.checked[k]),
           (unsigned long long)atomic_load(&r.bad[k]));
  if (r.native)
    printf(
        "  %-40s %llu inputs checked, differs on %llu float32 subnormals "
        "(flushed) and %llu others\n",
        "hardware VCVTNEPS2BF16 oracle",
        (unsigned long long)atomic_load(&r.native_checked),
        (unsigned long long)atomic_load(&r.native_sub),
        (unsigned long long)atomic_load(&r.native_other));
  fflush(stdout);

  for (int k = 0; k < r.nk; k++) {
    assert_true(atomic_load(&r.checked[k]) == (1ull << 32));
    if (atomic_load(&r.bad[k]) != 0) {
      uint32_t u = atomic_load(&r.first_bad[k]);
      fail_msg("%s: %llu mismatches, first at input 0x%08x (scalar 0x%04x)",
               r.k[k].name, (unsigned long long)atomic_load(&r.bad[k]), u,
               sp_f32_to_bf16_bits(u));
    }
  }
  if (r.native) {
    assert_true(atomic_load(&r.native_checked) == (1ull << 32));
    if (atomic_load(&r.native_other) != 0)
      fail_msg(
          "VCVTNEPS2BF16 disagrees with the policy on a non-subnormal "
          "input, first 0x%08x",
          atomic_load(&r.native_first_other));
    assert_true(atomic_load(&r.native_sub) == 16711678ull);
  }
}

int main(void) {
  if (!sp_cast_path_available(SP_CAST_PATH_AVX2) &&
      !sp_cast_path_available(SP_CAST_PATH_AVX512))
    return sp_test_skip(
        "no SIMD cast path on this CPU; the scalar "
        "reference is covered by test_cast");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_all_f32_to_bf16),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
