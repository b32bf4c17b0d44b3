/* GPU casts against the CPU scalar reference: all 65536 inputs of each
 * 16-bit format to every floating dtype, and every dtype pair at odd lengths
 * and misaligned offsets (which select the vector kernels with and without
 * a head, the element and the byte kernels); the fused forms
 * (sp_cuda_cast_at into a slot, sp_cuda_cast_div with FSDP's post-divide)
 * on random data with every special value, against a CPU reference that
 * computes what client/lib/fsdp/fsdp_mem_host.c computes. The 2^32 float32
 * inputs are in test_cuda_cast_exhaustive.c. Skips, with the reason, when
 * CUDA was not built or no device is present. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cast/cast_scalar.h"
#include "cast/dtype.h"
#include "base/sp_error.h"
#include "support/testutil.h"

#if SHARDPLANE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cast/cast_cuda.h"

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

/* The byte every destination buffer is filled with before a cast; it
 * changes with every call, so an element a kernel forgot to write cannot
 * pass by holding the right value from an earlier call. */
static unsigned char g_fill = 0x11;

/* Fills the whole device buffer with the next fill byte. */
static unsigned char fill_device(void *dev, size_t bytes) {
  g_fill = (unsigned char)(g_fill * 73u + 41u);
  SP_TEST_CU(cudaMemset(dev, g_fill, bytes));
  return g_fill;
}

/* Copies the destination back: `bytes` at dst_off into host_dst, and checks
 * that the dst_off bytes before it and GUARD bytes after it still hold the
 * fill byte (a kernel wrote only its own elements). */
enum { GUARD = 32 };
static void fetch_checked(void *host_dst, const void *ddst, size_t dst_off,
                          size_t bytes, unsigned char fill, const char *what) {
  size_t total = dst_off + bytes + GUARD;
  unsigned char *all = malloc(total);
  assert_non_null(all);
  SP_TEST_CU(cudaMemcpy(all, ddst, total, cudaMemcpyDeviceToHost));
  for (size_t k = 0; k < dst_off; k++)
    if (all[k] != fill)
      fail_msg("%s: byte %zu before the destination was written", what, k);
  for (size_t k = 0; k < GUARD; k++)
    if (all[dst_off + bytes + k] != fill)
      fail_msg("%s: byte %zu after the destination was written", what, k);
  memcpy(host_dst, all + dst_off, bytes);
  free(all);
}

/* Host -> device, cast on the default stream, device -> host. ddst must
 * hold dst_off + n * size + GUARD bytes. */
static void gpu_cast(void *host_dst, sp_dtype dt, const void *host_src,
                     sp_dtype st, size_t n, size_t src_off, size_t dst_off,
                     void *dsrc, void *ddst) {
  size_t ss = sp_dtype_size(st), ds = sp_dtype_size(dt);
  unsigned char *s = (unsigned char *)dsrc + src_off;
  unsigned char *d = (unsigned char *)ddst + dst_off;
  unsigned char fill = fill_device(ddst, dst_off + n * ds + GUARD);
  if (n > 0)
    SP_TEST_CU(cudaMemcpy(s, host_src, n * ss, cudaMemcpyHostToDevice));
  int rc = sp_cuda_cast(d, dt, s, st, n, NULL);
  if (rc != 0) fail_msg("sp_cuda_cast: %s", sp_strerror(rc));
  SP_TEST_CU(cudaDeviceSynchronize());
  fetch_checked(host_dst, ddst, dst_off, n * ds, fill, "sp_cuda_cast");
}

/* A test's buffers: input, expected and result on the host, source and
 * destination on the device. */
typedef struct bufs {
  unsigned char *in, *want, *got;
  void *dsrc, *ddst;
} bufs;

static void bufs_new(bufs *b, size_t host_bytes, size_t dsrc_bytes,
                     size_t ddst_bytes) {
  b->in = malloc(host_bytes);
  b->want = malloc(host_bytes);
  b->got = malloc(host_bytes);
  assert_non_null(b->in);
  assert_non_null(b->want);
  assert_non_null(b->got);
  b->dsrc = b->ddst = NULL;
  SP_TEST_CU(cudaMalloc(&b->dsrc, dsrc_bytes));
  SP_TEST_CU(cudaMalloc(&b->ddst, ddst_bytes));
}

static void bufs_free(bufs *b) {
  SP_TEST_CU(cudaFree(b->dsrc));
  SP_TEST_CU(cudaFree(b->ddst));
  free(b->in);
  free(b->want);
  free(b->got);
}

static void test_all_16bit_inputs(void **state) {
  (void)state;
  enum { N = 65536 };
  bufs io;
  bufs_new(&io, N * 8, N * 8, N * 8 + 64);
  uint16_t *in = (uint16_t *)io.in;
  for (uint32_t i = 0; i < N; i++) in[i] = (uint16_t)i;
  const sp_dtype srcs[] = {SP_FLOAT16, SP_BFLOAT16};
  for (int s = 0; s < 2; s++) {
    for (int t = 0; t < 4; t++) {
      sp_dtype dt = k_float_types[t];
      ref_cast(io.want, dt, in, srcs[s], N);
      gpu_cast(io.got, dt, in, srcs[s], N, 0, 0, io.dsrc, io.ddst);
      if (memcmp(io.got, io.want, N * sp_dtype_size(dt)) != 0)
        fail_msg("GPU %s -> %s differs from scalar", sp_dtype_name(srcs[s]),
                 sp_dtype_name(dt));
    }
  }
  bufs_free(&io);
}

static void test_pairs_lengths_offsets(void **state) {
  (void)state;
  static const size_t lengths[] = {0, 1, 7, 8, 9, 15, 1000, 4097, 100003};
  /* byte offsets: 1 needs the byte kernel; 2, 4, 6, 12 the element kernel
   * or the vector kernel after a head, depending on the pair */
  static const size_t offsets[] = {0, 1, 2, 4, 6, 8, 12, 16};
  const size_t maxn = 100003;
  bufs io;
  bufs_new(&io, maxn * 8, maxn * 8 + 64, maxn * 8 + 64);
  sp_test_rng rng = {0xC0DA};
  for (size_t i = 0; i < maxn; i++) {
    uint64_t x = sp_test_rng_next(&rng);
    memcpy(io.in + i * 8, &x, 8);
  }
  size_t checked = 0;
  for (int a = 0; a < 4; a++) {
    for (int b = 0; b < 4; b++) {
      sp_dtype st = k_float_types[a], dt = k_float_types[b];
      for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
        size_t n = lengths[li];
        ref_cast(io.want, dt, io.in, st, n);
        for (size_t so = 0; so < sizeof offsets / sizeof offsets[0]; so++) {
          for (size_t dof = 0; dof < sizeof offsets / sizeof offsets[0];
               dof++) {
            gpu_cast(io.got, dt, io.in, st, n, offsets[so], offsets[dof],
                     io.dsrc, io.ddst);
            if (memcmp(io.got, io.want, n * sp_dtype_size(dt)) != 0)
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
  bufs_free(&io);
}

static void test_in_place_and_errors(void **state) {
  (void)state;
  enum { N = 4099 };
  uint16_t in[N], want[N], got[N];
  void *d = NULL;
  SP_TEST_CU(cudaMalloc(&d, N * 2));
  /* spread over all 16-bit patterns (the product exceeds 65535 near the
   * end, hence the wrap in integer arithmetic) */
  for (int i = 0; i < N; i++) in[i] = (uint16_t)((uint32_t)(i * 16.001));
  ref_cast(want, SP_FLOAT16, in, SP_BFLOAT16, N);
  SP_TEST_CU(cudaMemcpy(d, in, sizeof in, cudaMemcpyHostToDevice));
  assert_int_equal(sp_cuda_cast(d, SP_FLOAT16, d, SP_BFLOAT16, N, NULL), 0);
  SP_TEST_CU(cudaDeviceSynchronize());
  SP_TEST_CU(cudaMemcpy(got, d, sizeof got, cudaMemcpyDeviceToHost));
  assert_memory_equal(got, want, sizeof got);

  assert_int_equal(sp_cuda_cast(d, SP_INT32, d, SP_FLOAT32, 4, NULL),
                   SP_EINVAL);
  assert_int_equal(sp_cuda_cast(d, SP_FLOAT16, d, SP_UINT8, 4, NULL),
                   SP_EINVAL);
  assert_int_equal(sp_cuda_cast(NULL, SP_FLOAT16, d, SP_FLOAT32, 4, NULL),
                   SP_EINVAL);
  assert_int_equal(sp_cuda_cast(NULL, SP_FLOAT16, NULL, SP_FLOAT32, 0, NULL),
                   0);
  /* in place only when the elements line up */
  assert_int_equal(sp_cuda_cast(d, SP_FLOAT32, d, SP_BFLOAT16, 4, NULL),
                   SP_EINVAL);
  int n = -1;
  assert_int_equal(sp_cuda_device_count(&n), 0);
  assert_true(n > 0);
  assert_int_equal(sp_cuda_device_count(NULL), SP_EINVAL);
  cudaFree(d);
}

/* ---- fused forms --------------------------------------------------------- */

/* Random bits with the special values of the source dtype mixed in: zeros,
 * infinities, quiet and signalling NaNs with payloads, the smallest and
 * largest subnormals, the largest finite value, values that round to a tie
 * after a divide. */
static void fill_specials(void *buf, sp_dtype dt, size_t n, sp_test_rng *rng) {
  static const uint64_t f64s[] = {0,
                                  0x8000000000000000ull,
                                  0x7FF0000000000000ull,
                                  0xFFF0000000000000ull,
                                  0x7FF8000000000001ull,
                                  0xFFF4000000000123ull,
                                  0x7FF0000000000001ull,
                                  1,
                                  0x000FFFFFFFFFFFFFull,
                                  0x7FEFFFFFFFFFFFFFull,
                                  0x3FF0000000000000ull,
                                  0x4008000000000000ull};
  static const uint32_t f32s[] = {0,           0x80000000u, 0x7F800000u,
                                  0xFF800000u, 0x7FC00001u, 0xFFA00123u,
                                  0x7F800001u, 1,           0x007FFFFFu,
                                  0x7F7FFFFFu, 0x3F800000u, 0x40400000u};
  static const uint16_t f16s[] = {0,      0x8000, 0x7C00, 0xFC00,
                                  0x7E01, 0xFD23, 0x7C01, 1,
                                  0x03FF, 0x7BFF, 0x3C00, 0x4200};
  static const uint16_t bf16s[] = {0,      0x8000, 0x7F80, 0xFF80,
                                   0x7FC1, 0xFFA3, 0x7F81, 1,
                                   0x007F, 0x7F7F, 0x3F80, 0x4040};
  size_t esz = sp_dtype_size(dt);
  for (size_t i = 0; i < n; i++) {
    uint64_t x = sp_test_rng_next(rng);
    bool special = sp_test_rng_below(rng, 8) == 0;
    size_t k = (size_t)sp_test_rng_below(rng, 12);
    switch (dt) {
      case SP_FLOAT64:
        if (special) x = f64s[k];
        break;
      case SP_FLOAT32:
        if (special) x = f32s[k];
        break;
      case SP_FLOAT16:
        if (special) x = f16s[k];
        break;
      default:
        if (special) x = bf16s[k];
        break;
    }
    memcpy((unsigned char *)buf + i * esz, &x, esz);
  }
}

/* What client/lib/fsdp/fsdp_mem_host.c computes for one element: scale_div in
 * the reduce dtype (hardware double division; 16-bit through float32 with
 * sp_cast's conversions, whose every path equals cast_scalar.h), then the
 * cast to the gradient dtype. div == 1 skips the division, as the runtime
 * does. */
static uint64_t ref_div_one(uint64_t x, sp_dtype st, sp_dtype dt, double div) {
  uint64_t q = x;
  if (div != 1.0) {
    switch (st) {
      case SP_FLOAT64: {
        double v;
        memcpy(&v, &x, sizeof v);
        v /= div;
        memcpy(&q, &v, sizeof v);
        break;
      }
      case SP_FLOAT32: {
        uint32_t u = (uint32_t)x;
        float f;
        memcpy(&f, &u, sizeof f);
        f = (float)((double)f / div);
        memcpy(&u, &f, sizeof u);
        q = u;
        break;
      }
      default: {
        uint32_t w = st == SP_FLOAT16 ? sp_f16_to_f32_bits((uint16_t)x)
                                      : sp_bf16_to_f32_bits((uint16_t)x);
        float f;
        memcpy(&f, &w, sizeof f);
        f = (float)((double)f / div);
        memcpy(&w, &f, sizeof w);
        q = st == SP_FLOAT16 ? sp_f32_to_f16_bits(w) : sp_f32_to_bf16_bits(w);
        break;
      }
    }
  }
  return ref_one(q, st, dt);
}

static void ref_cast_div(void *dst, sp_dtype dt, const void *src, sp_dtype st,
                         size_t n, double div) {
  size_t ss = sp_dtype_size(st), ds = sp_dtype_size(dt);
  for (size_t i = 0; i < n; i++) {
    uint64_t x = 0;
    memcpy(&x, (const unsigned char *)src + i * ss, ss);
    uint64_t y = ref_div_one(x, st, dt, div);
    memcpy((unsigned char *)dst + i * ds, &y, ds);
  }
}

/* Reports the first differing element of a result. */
static void compare_elems(const void *got, const void *want, const void *in,
                          sp_dtype st, sp_dtype dt, size_t n,
                          const char *what) {
  size_t ss = sp_dtype_size(st), ds = sp_dtype_size(dt);
  if (memcmp(got, want, n * ds) == 0) return;
  for (size_t i = 0; i < n; i++) {
    uint64_t g = 0, w = 0, x = 0;
    memcpy(&g, (const unsigned char *)got + i * ds, ds);
    memcpy(&w, (const unsigned char *)want + i * ds, ds);
    memcpy(&x, (const unsigned char *)in + i * ss, ss);
    if (g != w)
      fail_msg(
          "%s %s -> %s, n=%zu: element %zu, input 0x%llx: got 0x%llx, "
          "want 0x%llx",
          what, sp_dtype_name(st), sp_dtype_name(dt), n, i,
          (unsigned long long)x, (unsigned long long)g, (unsigned long long)w);
  }
}

/* A shard cast into its slot of a larger buffer: every pair, element
 * offsets that do and do not allow 16-byte vectors, the rest of the buffer
 * untouched. */
static void test_cast_at(void **state) {
  (void)state;
  static const size_t lengths[] = {1, 5, 8, 13, 1000, 65539};
  static const size_t src_offs[] = {0, 1, 3, 4, 8};
  static const size_t dst_offs[] = {0, 1, 2, 4, 7, 8, 65536 * 3};
  const size_t maxn = 65539, maxoff = 65536 * 3;
  bufs io;
  bufs_new(&io, maxn * 8, (maxn + 8) * 8, (maxn + maxoff) * 8 + GUARD);
  sp_test_rng rng = {0xA77};
  size_t checked = 0;
  for (int a = 0; a < 4; a++) {
    for (int b = 0; b < 4; b++) {
      sp_dtype st = k_float_types[a], dt = k_float_types[b];
      size_t ss = sp_dtype_size(st), ds = sp_dtype_size(dt);
      for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
        size_t n = lengths[li];
        fill_specials(io.in, st, n, &rng);
        ref_cast(io.want, dt, io.in, st, n);
        for (size_t so = 0; so < sizeof src_offs / sizeof src_offs[0]; so++) {
          for (size_t dof = 0; dof < sizeof dst_offs / sizeof dst_offs[0];
               dof++) {
            size_t soff = src_offs[so], doff = dst_offs[dof];
            unsigned char fill = fill_device(io.ddst, (doff + n) * ds + GUARD);
            SP_TEST_CU(cudaMemcpy((unsigned char *)io.dsrc + soff * ss, io.in,
                                  n * ss, cudaMemcpyHostToDevice));
            int rc =
                sp_cuda_cast_at(io.ddst, doff, dt, io.dsrc, soff, st, n, NULL);
            if (rc != 0) fail_msg("sp_cuda_cast_at: %s", sp_strerror(rc));
            SP_TEST_CU(cudaDeviceSynchronize());
            fetch_checked(io.got, io.ddst, doff * ds, n * ds, fill,
                          "sp_cuda_cast_at");
            compare_elems(io.got, io.want, io.in, st, dt, n, "sp_cuda_cast_at");
            checked++;
          }
        }
      }
    }
  }
  printf("GPU sp_cuda_cast_at: %zu slot casts checked\n", checked);
  /* offsets whose byte position overflows */
  assert_int_equal(sp_cuda_cast_at(io.ddst, SIZE_MAX / 2, SP_FLOAT32, io.dsrc,
                                   0, SP_BFLOAT16, 4, NULL),
                   SP_EINVAL);
  assert_int_equal(sp_cuda_cast_at(io.ddst, 0, SP_FLOAT32, io.dsrc, SIZE_MAX,
                                   SP_BFLOAT16, 4, NULL),
                   SP_EINVAL);
  assert_int_equal(
      sp_cuda_cast_at(io.ddst, 0, SP_INT32, io.dsrc, 0, SP_BFLOAT16, 4, NULL),
      SP_EINVAL);
  assert_int_equal(
      sp_cuda_cast_at(NULL, 0, SP_FLOAT32, NULL, 0, SP_BFLOAT16, 0, NULL), 0);
  bufs_free(&io);
}

/* The reduced gradient back to the master dtype with the post-divide: all
 * 16 pairs, FSDP's divisors and a few others, aligned and element-offset
 * pointers (vector kernel with and without a head, element kernel), in
 * place, and div == 1 (the plain cast, signalling NaNs copied unchanged). */
static void test_cast_div(void **state) {
  (void)state;
  static const double divs[] = {2, 3, 4, 6, 8, 1, 0.5, 7, 0.1, -3, 1e-300};
  static const size_t lengths[] = {1, 9, 1003, 100003};
  static const size_t offs[] = {0, 1, 3, 8};
  const size_t maxn = 100003;
  bufs io;
  bufs_new(&io, maxn * 8, (maxn + 8) * 8, (maxn + 8) * 8 + GUARD);
  sp_test_rng rng = {0xD1F};
  size_t checked = 0;
  for (int a = 0; a < 4; a++) {
    for (int b = 0; b < 4; b++) {
      sp_dtype st = k_float_types[a], dt = k_float_types[b];
      size_t ss = sp_dtype_size(st), ds = sp_dtype_size(dt);
      for (size_t vi = 0; vi < sizeof divs / sizeof divs[0]; vi++) {
        double div = divs[vi];
        for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
          size_t n = lengths[li];
          fill_specials(io.in, st, n, &rng);
          ref_cast_div(io.want, dt, io.in, st, n, div);
          for (size_t oi = 0; oi < sizeof offs / sizeof offs[0]; oi++) {
            /* source offset k, destination offset (k * 5) % 8: differing
             * alignments on the two sides */
            size_t soff = offs[oi], doff = (offs[oi] * 5) % 8;
            unsigned char fill = fill_device(io.ddst, (doff + n) * ds + GUARD);
            unsigned char *s = (unsigned char *)io.dsrc + soff * ss;
            SP_TEST_CU(cudaMemcpy(s, io.in, n * ss, cudaMemcpyHostToDevice));
            int rc = sp_cuda_cast_div((unsigned char *)io.ddst + doff * ds, dt,
                                      s, st, n, div, NULL);
            if (rc != 0) fail_msg("sp_cuda_cast_div: %s", sp_strerror(rc));
            SP_TEST_CU(cudaDeviceSynchronize());
            fetch_checked(io.got, io.ddst, doff * ds, n * ds, fill,
                          "sp_cuda_cast_div");
            char what[64];
            snprintf(what, sizeof what, "sp_cuda_cast_div(div %g)", div);
            compare_elems(io.got, io.want, io.in, st, dt, n, what);
            checked++;
          }
          /* in place, equal element sizes */
          if (ss == ds) {
            SP_TEST_CU(
                cudaMemcpy(io.dsrc, io.in, n * ss, cudaMemcpyHostToDevice));
            int rc = sp_cuda_cast_div(io.dsrc, dt, io.dsrc, st, n, div, NULL);
            if (rc != 0) fail_msg("sp_cuda_cast_div: %s", sp_strerror(rc));
            SP_TEST_CU(cudaDeviceSynchronize());
            SP_TEST_CU(
                cudaMemcpy(io.got, io.dsrc, n * ds, cudaMemcpyDeviceToHost));
            compare_elems(io.got, io.want, io.in, st, dt, n,
                          "sp_cuda_cast_div in place");
            checked++;
          }
        }
      }
    }
  }
  printf(
      "GPU sp_cuda_cast_div: %zu casts checked against fsdp.c's "
      "scale_div + sp_cast\n",
      checked);
  bufs_free(&io);
}

static void test_cast_div_errors(void **state) {
  (void)state;
  void *d = NULL;
  SP_TEST_CU(cudaMalloc(&d, 256));
  unsigned char *p = d;
  assert_int_equal(sp_cuda_cast_div(d, SP_FLOAT32, d, SP_FLOAT32, 4, 0.0, NULL),
                   SP_EINVAL);
  assert_int_equal(
      sp_cuda_cast_div(d, SP_FLOAT32, d, SP_FLOAT32, 4, HUGE_VAL, NULL),
      SP_EINVAL);
  assert_int_equal(sp_cuda_cast_div(d, SP_FLOAT32, d, SP_FLOAT32, 4, NAN, NULL),
                   SP_EINVAL);
  assert_int_equal(sp_cuda_cast_div(d, SP_INT32, d, SP_FLOAT32, 4, 2, NULL),
                   SP_EINVAL);
  assert_int_equal(
      sp_cuda_cast_div(NULL, SP_FLOAT32, d, SP_FLOAT32, 4, 2, NULL), SP_EINVAL);
  /* element alignment is required (no byte kernel for the divide) */
  assert_int_equal(
      sp_cuda_cast_div(p + 2, SP_FLOAT32, p + 64, SP_BFLOAT16, 4, 2, NULL),
      SP_EINVAL);
  assert_int_equal(
      sp_cuda_cast_div(p + 64, SP_FLOAT32, p + 1, SP_BFLOAT16, 4, 2, NULL),
      SP_EINVAL);
  /* in place only with equal element sizes */
  assert_int_equal(sp_cuda_cast_div(d, SP_FLOAT32, d, SP_BFLOAT16, 4, 2, NULL),
                   SP_EINVAL);
  assert_int_equal(
      sp_cuda_cast_div(NULL, SP_FLOAT32, NULL, SP_FLOAT16, 0, 2, NULL), 0);
  SP_TEST_CU(cudaDeviceSynchronize());
  SP_TEST_CU(cudaFree(d));
}
#endif

int main(void) {
  int rc = sp_test_need_cuda_device();
#if SHARDPLANE_HAVE_CUDA
  if (rc == 0) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_all_16bit_inputs),
        cmocka_unit_test(test_pairs_lengths_offsets),
        cmocka_unit_test(test_in_place_and_errors),
        cmocka_unit_test(test_cast_at),
        cmocka_unit_test(test_cast_div),
        cmocka_unit_test(test_cast_div_errors),
    };
    rc = cmocka_run_group_tests(tests, NULL, NULL);
  }
#endif
  return rc;
}
