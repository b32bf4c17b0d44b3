/* float32 -> float16 over all 2^32 inputs: every SIMD path this CPU can run
 * must give the scalar reference's bits on every input, NaN included.
 *
 * Independent oracle: gcc's _Float16 conversion. Non-NaN results must match
 * bit for bit; for NaN inputs the oracle only has to agree that the result is
 * a NaN (implementations disagree on NaN payloads, the policy fixes ours).
 *   - compiled for AVX512-FP16 (VCVTSS2SH, a different instruction from the
 *     F16C one the SIMD paths use) over all 2^32 inputs when the CPU has it;
 *   - through libgcc's soft-float routine on a fixed 1/64 of the inputs
 *     (every block, a different residue), 1/16 when there is no AVX512-FP16.
 *     It is ~60 ns an element, too slow for all of them in a unit test.
 *
 * The 4096 blocks of 2^20 inputs are shared among one thread per core;
 * results are collected and asserted on the main thread. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
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
#include "support/testutil.h"

#define BLOCK ((size_t)1 << 20)
#define NBLOCKS ((uint32_t)1 << 12)
#define MAX_THREADS 16

#if defined(__FLT16_MAX__)
#define HAVE_FLOAT16 1
#else
#define HAVE_FLOAT16 0
#endif
#if HAVE_FLOAT16 && defined(__x86_64__) && \
    ((defined(__GNUC__) && __GNUC__ >= 12) || defined(__clang__))
#define HAVE_FP16_HW 1
#else
#define HAVE_FP16_HW 0
#endif

typedef struct run {
  sp_cast_path paths[SP_CAST_PATH_COUNT];
  int np;
  bool hw_oracle;
  uint32_t soft_stride; /* soft-float oracle on 1/soft_stride of inputs */
  atomic_uint next;
  atomic_ullong checked[SP_CAST_PATH_COUNT], bad[SP_CAST_PATH_COUNT];
  atomic_uint first_bad[SP_CAST_PATH_COUNT];
  atomic_ullong hw_checked, hw_bad, soft_checked, soft_bad;
  atomic_uint hw_first_bad, soft_first_bad;
  atomic_int alloc_failed;
} run;

static bool f16_is_nan(uint16_t h) { return (h & 0x7FFFu) > 0x7C00u; }
static bool f32_is_nan(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

/* Does an oracle result agree with the reference? */
static bool oracle_agrees(uint32_t in, uint16_t ref, uint16_t oracle) {
  if (f32_is_nan(in)) return f16_is_nan(ref) && f16_is_nan(oracle);
  return ref == oracle;
}

#if HAVE_FP16_HW
__attribute__((target("avx512fp16,avx512vl,avx512bw,avx512f"))) static void
hw_f32_to_f16(uint16_t *dst, const uint32_t *src, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float f;
    memcpy(&f, &src[i], 4);
    _Float16 h = (_Float16)f;
    memcpy(&dst[i], &h, 2);
  }
}
#endif

#if HAVE_FLOAT16
static uint16_t soft_f32_to_f16(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  _Float16 h = (_Float16)f; /* no FP16 ISA in this function: libgcc */
  uint16_t b;
  memcpy(&b, &h, 2);
  return b;
}
#endif

static void record(atomic_ullong *bad, atomic_uint *first, uint32_t in) {
  if (atomic_fetch_add(bad, 1) == 0) atomic_store(first, in);
}

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
    for (size_t i = 0; i < BLOCK; i++) ref[i] = sp_f32_to_f16_bits(in[i]);
    for (int p = 0; p < r->np; p++) {
      memset(out, 0, BLOCK * 2);
      if (sp_cast_with_path(out, SP_FLOAT16, in, SP_FLOAT32, BLOCK,
                            r->paths[p]) != 0)
        memset(out, 0xFF, BLOCK * 2);
      atomic_fetch_add(&r->checked[p], BLOCK);
      if (memcmp(out, ref, BLOCK * 2) == 0) continue;
      for (size_t i = 0; i < BLOCK; i++)
        if (out[i] != ref[i]) record(&r->bad[p], &r->first_bad[p], in[i]);
    }
#if HAVE_FP16_HW
    if (r->hw_oracle) {
      hw_f32_to_f16(out, in, BLOCK);
      atomic_fetch_add(&r->hw_checked, BLOCK);
      for (size_t i = 0; i < BLOCK; i++)
        if (!oracle_agrees(in[i], ref[i], out[i]))
          record(&r->hw_bad, &r->hw_first_bad, in[i]);
    }
#endif
#if HAVE_FLOAT16
    unsigned long long n = 0;
    for (size_t i = b % r->soft_stride; i < BLOCK; i += r->soft_stride) {
      if (!oracle_agrees(in[i], ref[i], soft_f32_to_f16(in[i])))
        record(&r->soft_bad, &r->soft_first_bad, in[i]);
      n++;
    }
    atomic_fetch_add(&r->soft_checked, n);
#endif
  }
done:
  free(in);
  free(ref);
  free(out);
  return NULL;
}

static void test_all_f32_to_f16(void **state) {
  (void)state;
  static run r; /* zero-initialised, atomics included */
  for (int p = SP_CAST_PATH_AVX2; p < SP_CAST_PATH_COUNT; p++)
    if (sp_cast_path_available((sp_cast_path)p))
      r.paths[r.np++] = (sp_cast_path)p;
#if HAVE_FP16_HW
  r.hw_oracle = __builtin_cpu_supports("avx512fp16");
#endif
  r.soft_stride = r.hw_oracle ? 64 : 16;

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

  printf("float32 -> float16, all 2^32 inputs, %d threads, %.1f s\n", nt,
         (double)(t1.tv_sec - t0.tv_sec) +
             (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9);
  for (int p = 0; p < r.np; p++)
    printf("  %-36s %llu inputs checked, %llu differ from scalar\n",
           sp_cast_path_name(r.paths[p]),
           (unsigned long long)atomic_load(&r.checked[p]),
           (unsigned long long)atomic_load(&r.bad[p]));
  printf("  %-36s %llu inputs checked, %llu disagree\n",
         "_Float16 oracle (AVX512-FP16)",
         (unsigned long long)atomic_load(&r.hw_checked),
         (unsigned long long)atomic_load(&r.hw_bad));
  printf("  %-36s %llu inputs checked, %llu disagree\n",
         "_Float16 oracle (libgcc soft-float)",
         (unsigned long long)atomic_load(&r.soft_checked),
         (unsigned long long)atomic_load(&r.soft_bad));
  fflush(stdout);

  for (int p = 0; p < r.np; p++) {
    assert_true(atomic_load(&r.checked[p]) == (1ull << 32));
    if (atomic_load(&r.bad[p]) != 0) {
      uint32_t u = atomic_load(&r.first_bad[p]);
      fail_msg("%s: %llu mismatches, first at input 0x%08x (scalar 0x%04x)",
               sp_cast_path_name(r.paths[p]),
               (unsigned long long)atomic_load(&r.bad[p]), u,
               sp_f32_to_f16_bits(u));
    }
  }
  if (r.hw_oracle) {
    assert_true(atomic_load(&r.hw_checked) == (1ull << 32));
    if (atomic_load(&r.hw_bad) != 0)
      fail_msg("AVX512-FP16 _Float16 disagrees, first at input 0x%08x",
               atomic_load(&r.hw_first_bad));
  }
#if HAVE_FLOAT16
  assert_true(atomic_load(&r.soft_checked) == (1ull << 32) / r.soft_stride);
  if (atomic_load(&r.soft_bad) != 0)
    fail_msg("soft-float _Float16 disagrees, first at input 0x%08x",
             atomic_load(&r.soft_first_bad));
#endif
}

int main(void) {
  if (!sp_cast_path_available(SP_CAST_PATH_AVX2) &&
      !sp_cast_path_available(SP_CAST_PATH_AVX512) && !HAVE_FLOAT16)
    return sp_test_skip(
        "no SIMD cast path and no _Float16 oracle: nothing "
        "to compare the scalar reference with");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_all_f32_to_f16),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
