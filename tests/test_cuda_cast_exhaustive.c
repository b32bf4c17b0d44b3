/* GPU casts over every input, bit for bit against the CPU scalar reference
 * (cast_scalar.h):
 *   - all 2^32 float32 inputs to bfloat16 and to float16 (sp_cuda_cast);
 *   - all 2^32 float32 inputs through sp_cuda_cast_div(float32 -> float32,
 *     div 3), against what client/lib/fsdp/fsdp_mem_host.c computes
 *     ((float)((double)x / 3));
 *   - all 2^16 inputs of each 16-bit format through sp_cuda_cast_div (div 3)
 *     to every floating dtype.
 * The plain 16-bit widenings and narrowings over all 2^16 inputs are in
 * test_cuda_cast.c. The host side of the comparison is split over threads so
 * the whole file takes well under a minute on a GPU machine. Labelled
 * "exhaustive" (ctest -LE exhaustive leaves it out). Skips, with the reason,
 * when CUDA was not built or no device is present. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "cast/cast_scalar.h"
#include "base/clock.h"
#include "cast/dtype.h"
#include "base/sp_error.h"
#include "support/testutil.h"

#if SHARDPLANE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cast/cast_cuda.h"

#define SP_OK(call)                                            \
  do {                                                         \
    int rc_ = (call);                                          \
    if (rc_ != 0) fail_msg("%s: %s", #call, sp_strerror(rc_)); \
  } while (0)

/* fsdp_mem_host.c's float32 post-divide (hardware double division, one
 * rounding to float). */
static uint32_t ref_div3_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  f = (float)((double)f / 3.0);
  memcpy(&u, &f, sizeof u);
  return u;
}

/* One thread's share of a chunk's comparison. */
typedef struct check_job {
  uint32_t base; /* input of element 0 is base + 0 */
  size_t lo, hi;
  const uint16_t *bf16, *f16;
  const uint32_t *div3;
  unsigned long long bad[3];
  uint32_t first[3];
} check_job;

static void *check_range(void *arg) {
  check_job *j = arg;
  for (size_t i = j->lo; i < j->hi; i++) {
    uint32_t x = j->base + (uint32_t)i;
    if (j->bf16[i] != sp_f32_to_bf16_bits(x) && j->bad[0]++ == 0)
      j->first[0] = x;
    if (j->f16[i] != sp_f32_to_f16_bits(x) && j->bad[1]++ == 0) j->first[1] = x;
    if (j->div3[i] != ref_div3_f32(x) && j->bad[2]++ == 0) j->first[2] = x;
  }
  return NULL;
}

enum { MAX_THREADS = 64 };

static void test_all_f32_inputs(void **state) {
  (void)state;
  const size_t chunk = (size_t)1 << 26;
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  int nth = ncpu < 1 ? 1 : (ncpu > MAX_THREADS ? MAX_THREADS : (int)ncpu);
  uint32_t *in = NULL, *div3 = NULL;
  uint16_t *bf16 = NULL, *f16 = NULL;
  void *dsrc = NULL, *dbf = NULL, *dh = NULL, *dq = NULL;
  /* pinned host buffers: the copies run at full bus speed */
  SP_TEST_CU(cudaMallocHost((void **)&in, chunk * 4));
  SP_TEST_CU(cudaMallocHost((void **)&div3, chunk * 4));
  SP_TEST_CU(cudaMallocHost((void **)&bf16, chunk * 2));
  SP_TEST_CU(cudaMallocHost((void **)&f16, chunk * 2));
  SP_TEST_CU(cudaMalloc(&dsrc, chunk * 4));
  SP_TEST_CU(cudaMalloc(&dbf, chunk * 2));
  SP_TEST_CU(cudaMalloc(&dh, chunk * 2));
  SP_TEST_CU(cudaMalloc(&dq, chunk * 4));
  unsigned long long bad[3] = {0, 0, 0};
  uint32_t first[3] = {0, 0, 0};
  double t0 = sp_clock_s();
  for (uint64_t base = 0; base < (1ull << 32); base += chunk) {
    for (size_t i = 0; i < chunk; i++) in[i] = (uint32_t)(base + i);
    SP_TEST_CU(cudaMemcpy(dsrc, in, chunk * 4, cudaMemcpyHostToDevice));
    SP_OK(sp_cuda_cast(dbf, SP_BFLOAT16, dsrc, SP_FLOAT32, chunk, NULL));
    SP_OK(sp_cuda_cast(dh, SP_FLOAT16, dsrc, SP_FLOAT32, chunk, NULL));
    SP_OK(sp_cuda_cast_div(dq, SP_FLOAT32, dsrc, SP_FLOAT32, chunk, 3.0, NULL));
    SP_TEST_CU(cudaDeviceSynchronize());
    SP_TEST_CU(cudaMemcpy(bf16, dbf, chunk * 2, cudaMemcpyDeviceToHost));
    SP_TEST_CU(cudaMemcpy(f16, dh, chunk * 2, cudaMemcpyDeviceToHost));
    SP_TEST_CU(cudaMemcpy(div3, dq, chunk * 4, cudaMemcpyDeviceToHost));
    check_job jobs[MAX_THREADS];
    pthread_t th[MAX_THREADS];
    for (int t = 0; t < nth; t++) {
      jobs[t] = (check_job){.base = (uint32_t)base,
                            .lo = chunk * (size_t)t / (size_t)nth,
                            .hi = chunk * (size_t)(t + 1) / (size_t)nth,
                            .bf16 = bf16,
                            .f16 = f16,
                            .div3 = div3};
      if (pthread_create(&th[t], NULL, check_range, &jobs[t]) != 0)
        fail_msg("pthread_create failed");
    }
    for (int t = 0; t < nth; t++) {
      pthread_join(th[t], NULL);
      for (int k = 0; k < 3; k++) {
        if (jobs[t].bad[k] != 0 && bad[k] == 0) first[k] = jobs[t].first[k];
        bad[k] += jobs[t].bad[k];
      }
    }
  }
  printf("GPU float32 -> bfloat16:          4294967296 inputs, %llu differ\n",
         bad[0]);
  printf("GPU float32 -> float16:           4294967296 inputs, %llu differ\n",
         bad[1]);
  printf("GPU float32 / 3 -> float32 (div): 4294967296 inputs, %llu differ\n",
         bad[2]);
  printf("(%.1f s, %d host threads comparing)\n", sp_clock_s() - t0, nth);
  if (bad[0] != 0)
    fail_msg("bfloat16: first mismatch at input 0x%08x", first[0]);
  if (bad[1] != 0)
    fail_msg("float16: first mismatch at input 0x%08x", first[1]);
  if (bad[2] != 0)
    fail_msg("float32 / 3: first mismatch at input 0x%08x", first[2]);
  SP_TEST_CU(cudaFree(dsrc));
  SP_TEST_CU(cudaFree(dbf));
  SP_TEST_CU(cudaFree(dh));
  SP_TEST_CU(cudaFree(dq));
  SP_TEST_CU(cudaFreeHost(in));
  SP_TEST_CU(cudaFreeHost(div3));
  SP_TEST_CU(cudaFreeHost(bf16));
  SP_TEST_CU(cudaFreeHost(f16));
}

/* fsdp_mem_host.c's 16-bit post-divide: widen, divide in double, round to
 * float32, round to the 16-bit dtype, then cast to dt. */
static uint64_t ref_div3_16(uint16_t x, sp_dtype st, sp_dtype dt) {
  uint32_t w =
      st == SP_FLOAT16 ? sp_f16_to_f32_bits(x) : sp_bf16_to_f32_bits(x);
  float f;
  memcpy(&f, &w, sizeof f);
  f = (float)((double)f / 3.0);
  memcpy(&w, &f, sizeof w);
  uint16_t q =
      st == SP_FLOAT16 ? sp_f32_to_f16_bits(w) : sp_f32_to_bf16_bits(w);
  uint32_t q32 =
      st == SP_FLOAT16 ? sp_f16_to_f32_bits(q) : sp_bf16_to_f32_bits(q);
  switch (dt) {
    case SP_FLOAT32: return q32;
    case SP_FLOAT64:
      return sp_f32_to_f64_bits(q32); /* widening is exact either way */
    case SP_FLOAT16: return st == SP_FLOAT16 ? q : sp_bf16_to_f16_bits(q);
    default: return st == SP_BFLOAT16 ? q : sp_f16_to_bf16_bits(q);
  }
}

static void test_all_16bit_div(void **state) {
  (void)state;
  enum { N = 65536 };
  static const sp_dtype dts[] = {SP_FLOAT32, SP_FLOAT64, SP_FLOAT16,
                                 SP_BFLOAT16};
  static const sp_dtype sts[] = {SP_FLOAT16, SP_BFLOAT16};
  uint16_t *in = malloc(N * 2);
  unsigned char *got = malloc(N * 8);
  void *dsrc = NULL, *ddst = NULL;
  assert_non_null(in);
  assert_non_null(got);
  SP_TEST_CU(cudaMalloc(&dsrc, N * 2));
  SP_TEST_CU(cudaMalloc(&ddst, N * 8));
  for (uint32_t i = 0; i < N; i++) in[i] = (uint16_t)i;
  SP_TEST_CU(cudaMemcpy(dsrc, in, N * 2, cudaMemcpyHostToDevice));
  for (int s = 0; s < 2; s++) {
    for (int t = 0; t < 4; t++) {
      sp_dtype st = sts[s], dt = dts[t];
      size_t ds = sp_dtype_size(dt);
      SP_OK(sp_cuda_cast_div(ddst, dt, dsrc, st, N, 3.0, NULL));
      SP_TEST_CU(cudaDeviceSynchronize());
      SP_TEST_CU(cudaMemcpy(got, ddst, N * ds, cudaMemcpyDeviceToHost));
      for (uint32_t i = 0; i < N; i++) {
        uint64_t g = 0, w = ref_div3_16(in[i], st, dt);
        memcpy(&g, got + i * ds, ds);
        if (g != w)
          fail_msg("%s / 3 -> %s: input 0x%04x: got 0x%llx, want 0x%llx",
                   sp_dtype_name(st), sp_dtype_name(dt), in[i],
                   (unsigned long long)g, (unsigned long long)w);
      }
    }
  }
  printf("GPU 16-bit / 3 -> every dtype: all 65536 inputs of each agree\n");
  SP_TEST_CU(cudaFree(dsrc));
  SP_TEST_CU(cudaFree(ddst));
  free(in);
  free(got);
}
#endif

int main(void) {
  int rc = sp_test_need_cuda_device();
#if SHARDPLANE_HAVE_CUDA
  if (rc == 0) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_all_16bit_div),
        cmocka_unit_test(test_all_f32_inputs),
    };
    rc = cmocka_run_group_tests(tests, NULL, NULL);
  }
#endif
  return rc;
}
