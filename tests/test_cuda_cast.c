/* GPU casts against the CPU scalar reference: all 2^32 float32 inputs to
 * bfloat16 and float16, all 65536 inputs of each 16-bit format widened, and
 * every dtype pair at odd lengths and misaligned offsets (which select the
 * vector, element and byte kernels). Skips, with the reason, when CUDA was
 * not built or no device is present. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cast_scalar.h"
#include "dtype.h"
#include "sp_error.h"
#include "testutil.h"

#ifdef SHARDPLANE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cast_cuda.h"

#define CU(call)                                                               \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) fail_msg("%s: %s", #call, cudaGetErrorString(e_));  \
  } while (0)

static const sp_dtype k_float_types[] = {SP_FLOAT32, SP_FLOAT64, SP_FLOAT16,
                                         SP_BFLOAT16};

static uint64_t ref_one(uint64_t x, sp_dtype st, sp_dtype dt) {
  if (st == dt) return x;
  switch (st) {
  case SP_FLOAT32:
    if (dt == SP_FLOAT64) return sp_f32_to_f64_bits((uint32_t)x);
    if (dt == SP_FLOAT16) return sp_f32_to_f16_bits((uint32_t)x);
    return sp_f32_to_bf16_bits((uint32_t)x);
  case SP_FLOAT64:
    if (dt == SP_FLOAT32) return sp_f64_to_f32_bits(x);
    if (dt == SP_FLOAT16) return sp_f64_to_f16_bits(x);
    return sp_f64_to_bf16_bits(x);
  case SP_FLOAT16:
    if (dt == SP_FLOAT32) return sp_f16_to_f32_bits((uint16_t)x);
    if (dt == SP_FLOAT64) return sp_f16_to_f64_bits((uint16_t)x);
    return sp_f16_to_bf16_bits((uint16_t)x);
  default:
    if (dt == SP_FLOAT32) return sp_bf16_to_f32_bits((uint16_t)x);
    if (dt == SP_FLOAT64) return sp_bf16_to_f64_bits((uint16_t)x);
    return sp_bf16_to_f16_bits((uint16_t)x);
  }
}

static void ref_cast(void *dst, sp_dtype dt, const void *src, sp_dtype st,
                     size_t n) {
  size_t ss = sp_dtype_size(st), ds = sp_dtype_size(dt);
  for (size_t i = 0; i < n; i++) {
    uint64_t x = 0;
    memcpy(&x, (const unsigned char *)src + i * ss, ss);
    uint64_t y = ref_one(x, st, dt);
    memcpy((unsigned char *)dst + i * ds, &y, ds);
  }
}

/* Host -> device, cast on the default stream, device -> host. */
static void gpu_cast(void *host_dst, sp_dtype dt, const void *host_src,
                     sp_dtype st, size_t n, size_t src_off, size_t dst_off,
                     void *dsrc, void *ddst) {
  size_t ss = sp_dtype_size(st), ds = sp_dtype_size(dt);
  unsigned char *s = (unsigned char *)dsrc + src_off;
  unsigned char *d = (unsigned char *)ddst + dst_off;
  if (n > 0) CU(cudaMemcpy(s, host_src, n * ss, cudaMemcpyHostToDevice));
  int rc = sp_cuda_cast(d, dt, s, st, n, NULL);
  if (rc != 0) fail_msg("sp_cuda_cast: %s", sp_strerror(rc));
  CU(cudaDeviceSynchronize());
  if (n > 0) CU(cudaMemcpy(host_dst, d, n * ds, cudaMemcpyDeviceToHost));
}

static void test_all_f32_inputs(void **state) {
  (void)state;
  const size_t chunk = (size_t)1 << 26;
  uint32_t *in = malloc(chunk * 4);
  uint16_t *got = malloc(chunk * 2);
  void *dsrc = NULL, *dbf = NULL, *dh = NULL;
  assert_non_null(in);
  assert_non_null(got);
  CU(cudaMalloc(&dsrc, chunk * 4));
  CU(cudaMalloc(&dbf, chunk * 2));
  CU(cudaMalloc(&dh, chunk * 2));
  unsigned long long bad_bf = 0, bad_h = 0;
  uint32_t first_bf = 0, first_h = 0;
  for (uint64_t base = 0; base < (1ull << 32); base += chunk) {
    for (size_t i = 0; i < chunk; i++) in[i] = (uint32_t)(base + i);
    CU(cudaMemcpy(dsrc, in, chunk * 4, cudaMemcpyHostToDevice));
    assert_int_equal(
        sp_cuda_cast(dbf, SP_BFLOAT16, dsrc, SP_FLOAT32, chunk, NULL), 0);
    assert_int_equal(
        sp_cuda_cast(dh, SP_FLOAT16, dsrc, SP_FLOAT32, chunk, NULL), 0);
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(got, dbf, chunk * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < chunk; i++)
      if (got[i] != sp_f32_to_bf16_bits(in[i]) && bad_bf++ == 0)
        first_bf = in[i];
    CU(cudaMemcpy(got, dh, chunk * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < chunk; i++)
      if (got[i] != sp_f32_to_f16_bits(in[i]) && bad_h++ == 0) first_h = in[i];
  }
  printf("GPU float32 -> bfloat16: 4294967296 inputs checked, %llu differ\n",
         bad_bf);
  printf("GPU float32 -> float16:  4294967296 inputs checked, %llu differ\n",
         bad_h);
  if (bad_bf != 0)
    fail_msg("bfloat16: first mismatch at input 0x%08x", first_bf);
  if (bad_h != 0) fail_msg("float16: first mismatch at input 0x%08x", first_h);
  cudaFree(dsrc);
  cudaFree(dbf);
  cudaFree(dh);
  free(in);
  free(got);
}

static void test_all_16bit_inputs(void **state) {
  (void)state;
  enum { N = 65536 };
  uint16_t *in = malloc(N * 2);
  unsigned char *want = malloc(N * 8), *got = malloc(N * 8);
  void *dsrc = NULL, *ddst = NULL;
  assert_non_null(in);
  assert_non_null(want);
  assert_non_null(got);
  CU(cudaMalloc(&dsrc, N * 8));
  CU(cudaMalloc(&ddst, N * 8));
  for (uint32_t i = 0; i < N; i++) in[i] = (uint16_t)i;
  const sp_dtype srcs[] = {SP_FLOAT16, SP_BFLOAT16};
  for (int s = 0; s < 2; s++) {
    for (int t = 0; t < 4; t++) {
      sp_dtype dt = k_float_types[t];
      ref_cast(want, dt, in, srcs[s], N);
      gpu_cast(got, dt, in, srcs[s], N, 0, 0, dsrc, ddst);
      if (memcmp(got, want, N * sp_dtype_size(dt)) != 0)
        fail_msg("GPU %s -> %s differs from scalar", sp_dtype_name(srcs[s]),
                 sp_dtype_name(dt));
    }
  }
  cudaFree(dsrc);
  cudaFree(ddst);
  free(in);
  free(want);
  free(got);
}

static void test_pairs_lengths_offsets(void **state) {
  (void)state;
  static const size_t lengths[] = {0, 1, 7, 8, 9, 15, 1000, 4097, 100003};
  static const size_t offsets[] = {0, 1, 2, 4, 8, 16};
  const size_t maxn = 100003;
  unsigned char *in = malloc(maxn * 8), *want = malloc(maxn * 8),
                *got = malloc(maxn * 8);
  void *dsrc = NULL, *ddst = NULL;
  assert_non_null(in);
  assert_non_null(want);
  assert_non_null(got);
  CU(cudaMalloc(&dsrc, maxn * 8 + 64));
  CU(cudaMalloc(&ddst, maxn * 8 + 64));
  sp_test_rng rng = {0xC0DA};
  for (size_t i = 0; i < maxn; i++) {
    uint64_t x = sp_test_rng_next(&rng);
    memcpy(in + i * 8, &x, 8);
  }
  size_t checked = 0;
  for (int a = 0; a < 4; a++) {
    for (int b = 0; b < 4; b++) {
      sp_dtype st = k_float_types[a], dt = k_float_types[b];
      for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
        for (size_t so = 0; so < sizeof offsets / sizeof offsets[0]; so++) {
          for (size_t dof = 0; dof < sizeof offsets / sizeof offsets[0];
               dof++) {
            size_t n = lengths[li];
            ref_cast(want, dt, in, st, n);
            gpu_cast(got, dt, in, st, n, offsets[so], offsets[dof], dsrc, ddst);
            if (memcmp(got, want, n * sp_dtype_size(dt)) != 0)
              fail_msg("GPU %s -> %s n=%zu src+%zu dst+%zu differs",
                       sp_dtype_name(st), sp_dtype_name(dt), n, offsets[so],
                       offsets[dof]);
            checked++;
          }
        }
      }
    }
  }
  printf("GPU pairs x lengths x offsets: %zu casts checked\n", checked);
  cudaFree(dsrc);
  cudaFree(ddst);
  free(in);
  free(want);
  free(got);
}

static void test_in_place_and_errors(void **state) {
  (void)state;
  enum { N = 4099 };
  uint16_t in[N], want[N], got[N];
  void *d = NULL;
  CU(cudaMalloc(&d, N * 2));
  for (int i = 0; i < N; i++) in[i] = (uint16_t)(i * 16.001);
  ref_cast(want, SP_FLOAT16, in, SP_BFLOAT16, N);
  CU(cudaMemcpy(d, in, sizeof in, cudaMemcpyHostToDevice));
  assert_int_equal(sp_cuda_cast(d, SP_FLOAT16, d, SP_BFLOAT16, N, NULL), 0);
  CU(cudaDeviceSynchronize());
  CU(cudaMemcpy(got, d, sizeof got, cudaMemcpyDeviceToHost));
  assert_memory_equal(got, want, sizeof got);

  assert_int_equal(sp_cuda_cast(d, SP_INT32, d, SP_FLOAT32, 4, NULL),
                   SP_EINVAL);
  assert_int_equal(sp_cuda_cast(d, SP_FLOAT16, d, SP_UINT8, 4, NULL),
                   SP_EINVAL);
  assert_int_equal(sp_cuda_cast(NULL, SP_FLOAT16, d, SP_FLOAT32, 4, NULL),
                   SP_EINVAL);
  assert_int_equal(sp_cuda_cast(NULL, SP_FLOAT16, NULL, SP_FLOAT32, 0, NULL),
                   0);
  int n = -1;
  assert_int_equal(sp_cuda_device_count(&n), 0);
  assert_true(n > 0);
  assert_int_equal(sp_cuda_device_count(NULL), SP_EINVAL);
  cudaFree(d);
}
#endif

int main(void) {
#ifndef SHARDPLANE_HAVE_CUDA
  return sp_test_skip("built without CUDA (no CUDA toolkit at configure "
                      "time)");
#else
  int n = 0;
  int rc = sp_cuda_device_count(&n);
  if (rc != 0) {
    char why[128];
    snprintf(why, sizeof why, "cannot query CUDA devices (%s)",
             sp_strerror(rc));
    return sp_test_skip(why);
  }
  if (n == 0) return sp_test_skip("no CUDA device (or no driver) present");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_all_16bit_inputs),
      cmocka_unit_test(test_pairs_lengths_offsets),
      cmocka_unit_test(test_in_place_and_errors),
      cmocka_unit_test(test_all_f32_inputs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
#endif
}
