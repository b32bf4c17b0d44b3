/* The NCCL backend of sp_comm.
 *
 * Without a device (CI, a CPU-only build) this checks what needs none: the
 * SP_EUNSUPPORTED answer of a library built without NCCL, the device string
 * checks (SP_EINVAL before any CUDA call or store access), SP_ENODEV for a
 * GPU that is not there, sp_comm_cuda_stream on a Gloo communicator. Then it
 * reports skipped (exit 77) with the reason.
 *
 * With a device (one GPU gives one rank: NCCL refuses two ranks on one GPU):
 * a single-member NCCL communicator over an in-memory store runs every
 * operation for every dtype, in and out of place, at odd counts, and each
 * result is compared bit for bit against the same operation on a
 * single-member Gloo communicator on the host (the CPU reference), with
 * guard bytes after every output to catch count/byte mix-ups. Then: ordering
 * on the communicator's stream, host pointers refused, abort of an idle and
 * of a blocked operation, an operation timeout, init that times out or is
 * cancelled while waiting for a missing member, a rank whose id never comes,
 * and, only with two or more GPUs, a real multi-rank run (one thread per
 * GPU). A blocked operation is made with a host function on the
 * communicator's stream that waits for a flag, so no kernel is needed here.
 * Each test runs under alarm(): a hang kills the process instead of eating
 * the GPU session's time.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/clock.h"
#include "support/mem_store.h"
#include "lib/shardplane.h"
#include "support/testutil.h"

#if SHARDPLANE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cast/cast_cuda.h"
#endif

static sp_comm_opts nccl_opts(sp_mstore *st, const char *prefix, uint32_t rank,
                              uint32_t size, const char *device,
                              uint64_t timeout_ms) {
  sp_comm_opts o = {.backend = SP_BACKEND_NCCL,
                    .prefix = prefix,
                    .rank = rank,
                    .size = size,
                    .timeout_ms = timeout_ms,
                    .device = device};
  if (st != NULL) o.store = sp_mstore_comm_store(st);
  return o;
}

static int g_ndev; /* CUDA devices, counted in main */

/* ==== checks that need no device ======================================== */

static void test_gloo_has_no_stream(void **state) {
  (void)state;
  sp_comm_opts o = {.backend = SP_BACKEND_GLOO, .rank = 0, .size = 1};
  sp_comm *c = NULL;
  sp_diag d = {{0}};
  assert_int_equal(sp_comm_new(&o, &c, &d), 0);
  void *s = (void *)&o;
  assert_int_equal(sp_comm_cuda_stream(c, &s), SP_EUNSUPPORTED);
  assert_null(s);
  assert_int_equal(sp_comm_cuda_stream(c, NULL), SP_EINVAL);
  s = (void *)&o;
  assert_int_equal(sp_comm_cuda_stream(NULL, &s), SP_EINVAL);
  assert_null(s);
  sp_comm_free(c);
}

#if !SHARDPLANE_HAVE_NCCL
static void test_not_built(void **state) {
  (void)state;
  sp_mstore st;
  sp_mstore_init(&st);
  sp_comm *c = (sp_comm *)&st;
  sp_diag d = {{0}};
  sp_comm_opts o = nccl_opts(&st, "nb", 0, 1, "cuda:0", 1000);
  assert_int_equal(sp_comm_new(&o, &c, &d), SP_EUNSUPPORTED);
  assert_null(c);
  assert_non_null(strstr(d.msg, "NCCL"));
  o = nccl_opts(&st, "nb", 1, 2, "cuda:0", 1000);
  assert_int_equal(sp_comm_new(&o, &c, &d), SP_EUNSUPPORTED);
  assert_int_equal(st.sets + st.gets, 0);
  sp_mstore_destroy(&st);
}
#else
/* Checked before any CUDA call or store access, so they hold on a machine
 * without a GPU too. */
static void test_bad_device_strings(void **state) {
  (void)state;
  static const char *bad[] = {NULL,      "",        "cpu",
                              "cuda",    "cuda:",   "cuda:x",
                              "cuda:-1", "cuda:1x", " cuda:0",
                              "CUDA:0",  "cuda:0 ", "cuda:+1",
                              "gpu:0",   "cuda::0", "cuda:99999999999"};
  sp_mstore st;
  sp_mstore_init(&st);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    for (uint32_t size = 1; size <= 2; size++) {
      sp_comm *c = (sp_comm *)&st;
      sp_diag d = {{0}};
      sp_comm_opts o = nccl_opts(&st, "bad", 0, size, bad[i], 1000);
      int rc = sp_comm_new(&o, &c, &d);
      if (rc != SP_EINVAL)
        fail_msg("device '%s' size %u: got %s (%s), want SP_EINVAL",
                 bad[i] ? bad[i] : "(null)", size, sp_err_name(rc), d.msg);
      assert_null(c);
      assert_non_null(strstr(d.msg, "cuda:N"));
    }
  }
  assert_int_equal(st.sets + st.gets, 0); /* nothing reached the store */
  sp_mstore_destroy(&st);
}

/* A well-formed name of a GPU that is not there. */
static void test_missing_device(void **state) {
  (void)state;
  sp_mstore st;
  sp_mstore_init(&st);
  char dev[32];
  snprintf(dev, sizeof dev, "cuda:%d", g_ndev);
  sp_comm *c = NULL;
  sp_diag d = {{0}};
  sp_comm_opts o = nccl_opts(&st, "nodev", 0, 1, dev, 1000);
  int rc = sp_comm_new(&o, &c, &d);
  if (rc != SP_ENODEV)
    fail_msg("%s: got %s (%s), want SP_ENODEV", dev, sp_err_name(rc), d.msg);
  assert_null(c);
  assert_non_null(strstr(d.msg, dev));
  assert_int_equal(st.sets + st.gets, 0);
  sp_mstore_destroy(&st);
}
#endif

/* ==== checks on a GPU =================================================== */

#if SHARDPLANE_HAVE_NCCL && SHARDPLANE_HAVE_CUDA

#define SP_OK(call, d)                                         \
  do {                                                         \
    int rc_ = (call);                                          \
    if (rc_ != 0)                                              \
      fail_msg("%s:%d: %s: %s: %s", __FILE__, __LINE__, #call, \
               sp_err_name(rc_), (d)->msg);                    \
  } while (0)

#define SP_WANT(want, call, d)                                               \
  do {                                                                       \
    int rc_ = (call);                                                        \
    if (rc_ != (want))                                                       \
      fail_msg("%s:%d: %s: got %s, want %s (%s)", __FILE__, __LINE__, #call, \
               sp_err_name(rc_), sp_err_name(want), (d)->msg);               \
  } while (0)

/* Each test may take at most this long; SIGALRM's default action ends the
 * process, which ctest reports as a failure, instead of a hang. */
static int watchdog(void **state) {
  (void)state;
  alarm(120);
  return 0;
}
static int watchdog_off(void **state) {
  (void)state;
  alarm(0);
  return 0;
}

static sp_comm *new_n1(sp_mstore *st, const char *prefix, uint64_t timeout_ms) {
  sp_comm *c = NULL;
  sp_diag d = {{0}};
  sp_comm_opts o = nccl_opts(st, prefix, 0, 1, "cuda:0", timeout_ms);
  SP_OK(sp_comm_new(&o, &c, &d), &d);
  assert_non_null(c);
  return c;
}

/* The host reference: a single-member Gloo communicator runs on the host. */
static sp_comm *new_host_ref(void) {
  sp_comm_opts o = {.backend = SP_BACKEND_GLOO, .rank = 0, .size = 1};
  sp_comm *c = NULL;
  sp_diag d = {{0}};
  SP_OK(sp_comm_new(&o, &c, &d), &d);
  return c;
}

/* Random bits; floating dtypes get no NaN (the host sum stores the default
 * NaN, NCCL passes a single member's NaN through: not the property under
 * test), but the specials that are easy to get wrong lead: +-0, +-inf, the
 * smallest subnormal and the largest finite value. */
static void fill_random(void *buf, sp_dtype dt, size_t count,
                        sp_test_rng *rng) {
  size_t esz = sp_dtype_size(dt);
  unsigned char *p = buf;
  for (size_t i = 0; i < count; i++) {
    uint64_t x = sp_test_rng_next(rng);
    switch (dt) {
      case SP_FLOAT32: {
        static const uint32_t sp[] = {0x00000000u, 0x80000000u, 0x7F800000u,
                                      0xFF800000u, 0x00000001u, 0x7F7FFFFFu};
        uint32_t u = i < 6 ? sp[i] : (uint32_t)x;
        if ((u & 0x7F800000u) == 0x7F800000u && i >= 6) u ^= 0x00800000u;
        memcpy(p + i * esz, &u, esz);
        break;
      }
      case SP_FLOAT64: {
        static const uint64_t sp[] = {0,
                                      0x8000000000000000ull,
                                      0x7FF0000000000000ull,
                                      0xFFF0000000000000ull,
                                      1,
                                      0x7FEFFFFFFFFFFFFFull};
        uint64_t u = i < 6 ? sp[i] : x;
        if ((u & 0x7FF0000000000000ull) == 0x7FF0000000000000ull && i >= 6)
          u ^= 0x0010000000000000ull;
        memcpy(p + i * esz, &u, esz);
        break;
      }
      case SP_FLOAT16:
      case SP_BFLOAT16: {
        uint16_t inf = dt == SP_FLOAT16 ? 0x7C00 : 0x7F80;
        uint16_t sp[] = {
            0, 0x8000, inf, (uint16_t)(inf | 0x8000), 1, (uint16_t)(inf - 1)};
        uint16_t u = i < 6 ? sp[i] : (uint16_t)x;
        uint16_t emask = dt == SP_FLOAT16 ? 0x7C00 : 0x7F80;
        uint16_t elow = dt == SP_FLOAT16 ? 0x0400 : 0x0080;
        if ((u & emask) == emask && i >= 6) u ^= elow;
        memcpy(p + i * esz, &u, esz);
        break;
      }
      default: memcpy(p + i * esz, &x, esz);
    }
  }
}

/* cudaMemcpy from pageable memory may return before the data has reached
 * the device, and cudaMemset is asynchronous; the communicator's stream is
 * non-blocking (not ordered after the legacy default stream), so every
 * upload is followed by a device synchronize before an operation reads it. */
static void h2d(void *dst, const void *src, size_t bytes) {
  SP_TEST_CU(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  SP_TEST_CU(cudaDeviceSynchronize());
}
static void dmemset(void *dst, int v, size_t bytes) {
  SP_TEST_CU(cudaMemset(dst, v, bytes));
  SP_TEST_CU(cudaDeviceSynchronize());
}

enum { GUARD = 64 };

/* A device buffer of `bytes` followed by GUARD bytes of 0xA5, which no
 * operation may touch. */
static void *dev_alloc_guarded(size_t bytes) {
  void *p = NULL;
  SP_TEST_CU(cudaMalloc(&p, bytes + GUARD));
  SP_TEST_CU(cudaMemset(p, 0xA5, bytes + GUARD));
  SP_TEST_CU(cudaDeviceSynchronize());
  return p;
}

/* Copies bytes back and checks them against want, and the guard. */
static void check_device(const void *dev, const void *want, size_t bytes,
                         const char *what, sp_dtype dt, size_t count) {
  unsigned char *got = malloc(bytes + GUARD);
  assert_non_null(got);
  SP_TEST_CU(cudaMemcpy(got, dev, bytes + GUARD, cudaMemcpyDeviceToHost));
  if (memcmp(got, want, bytes) != 0) {
    size_t k = 0;
    while (k < bytes && got[k] == ((const unsigned char *)want)[k]) k++;
    fail_msg(
        "%s %s count %zu: first differing byte %zu (got 0x%02x, want "
        "0x%02x)",
        what, sp_dtype_name(dt), count, k, got[k],
        ((const unsigned char *)want)[k]);
  }
  for (size_t k = 0; k < GUARD; k++)
    if (got[bytes + k] != 0xA5)
      fail_msg("%s %s count %zu: wrote past the end (guard byte %zu)", what,
               sp_dtype_name(dt), count, k);
  free(got);
}

/* Every operation and dtype on one member, against the host reference. */
static void test_ops_single_member(void **state) {
  (void)state;
  static const sp_dtype sum_types[] = {SP_FLOAT32,  SP_FLOAT64, SP_FLOAT16,
                                       SP_BFLOAT16, SP_INT32,   SP_INT64};
  static const sp_dtype move_types[] = {
      SP_FLOAT32, SP_FLOAT64, SP_FLOAT16, SP_BFLOAT16, SP_INT32,
      SP_INT64,   SP_INT16,   SP_INT8,    SP_UINT8,    SP_BOOL};
  static const size_t counts[] = {1, 3, 8, 1001, 65537, (1u << 20) + 3};
  sp_mstore st;
  sp_mstore_init(&st);
  sp_comm *c = new_n1(&st, "ops", 30000);
  /* Rank 0 published its id, even alone, since the store has a set. */
  assert_int_equal(sp_mstore_len(&st, "ops/nccl_id"), 128);
  assert_int_equal(sp_comm_rank(c), 0);
  assert_int_equal(sp_comm_size(c), 1);
  sp_comm *ref = new_host_ref();
  sp_test_rng rng = {0x5EED};
  sp_diag d = {{0}};
  size_t checked = 0;
  for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++) {
    size_t count = counts[ci];
    for (size_t ti = 0; ti < sizeof move_types / sizeof move_types[0]; ti++) {
      sp_dtype dt = move_types[ti];
      bool sum = false;
      for (size_t k = 0; k < sizeof sum_types / sizeof sum_types[0]; k++)
        sum = sum || sum_types[k] == dt;
      size_t bytes = count * sp_dtype_size(dt);
      unsigned char *in = malloc(bytes), *want = malloc(bytes);
      assert_non_null(in);
      assert_non_null(want);
      fill_random(in, dt, count, &rng);
      void *dsend = dev_alloc_guarded(bytes), *drecv = dev_alloc_guarded(bytes);
      h2d(dsend, in, bytes);

      /* all_gather, out of place and in place (send == recv + 0 * count) */
      SP_OK(sp_comm_all_gather(ref, in, want, count, dt, &d), &d);
      SP_OK(sp_comm_all_gather(c, dsend, drecv, count, dt, &d), &d);
      check_device(drecv, want, bytes, "all_gather", dt, count);
      dmemset(drecv, 0, bytes);
      h2d(drecv, in, bytes);
      SP_OK(sp_comm_all_gather(c, drecv, drecv, count, dt, &d), &d);
      check_device(drecv, want, bytes, "all_gather in place", dt, count);

      /* broadcast from the root, in place */
      memcpy(want, in, bytes);
      SP_OK(sp_comm_broadcast(ref, want, count, dt, 0, &d), &d);
      h2d(drecv, in, bytes);
      SP_OK(sp_comm_broadcast(c, drecv, count, dt, 0, &d), &d);
      check_device(drecv, want, bytes, "broadcast", dt, count);

      if (sum) {
        /* reduce_scatter out of place and in place (recv == send) */
        SP_OK(sp_comm_reduce_scatter(ref, in, want, count, dt, &d), &d);
        dmemset(drecv, 0, bytes);
        SP_OK(sp_comm_reduce_scatter(c, dsend, drecv, count, dt, &d), &d);
        check_device(drecv, want, bytes, "reduce_scatter", dt, count);
        h2d(drecv, in, bytes);
        SP_OK(sp_comm_reduce_scatter(c, drecv, drecv, count, dt, &d), &d);
        check_device(drecv, want, bytes, "reduce_scatter in place", dt, count);
        /* all_reduce, in place by definition */
        memcpy(want, in, bytes);
        SP_OK(sp_comm_all_reduce(ref, want, count, dt, &d), &d);
        h2d(drecv, in, bytes);
        SP_OK(sp_comm_all_reduce(c, drecv, count, dt, &d), &d);
        check_device(drecv, want, bytes, "all_reduce", dt, count);
      } else {
        /* comm.c refuses sums of these before the backend sees them, and
         * that does not break the communicator */
        SP_WANT(SP_EINVAL, sp_comm_all_reduce(c, drecv, count, dt, &d), &d);
      }
      /* the send buffer is never written */
      check_device(dsend, in, bytes, "send buffer after the ops", dt, count);
      SP_TEST_CU(cudaFree(dsend));
      SP_TEST_CU(cudaFree(drecv));
      free(in);
      free(want);
      checked++;
    }
  }
  SP_OK(sp_comm_barrier(c, &d), &d);
  SP_OK(sp_comm_barrier(c, &d), &d);
  /* The gate's checks come before the backend and do not break it. */
  SP_OK(sp_comm_all_reduce(c, NULL, 0, SP_FLOAT32, &d), &d);
  SP_WANT(SP_EINVAL, sp_comm_all_reduce(c, NULL, 4, SP_FLOAT32, &d), &d);
  SP_WANT(SP_EINVAL, sp_comm_broadcast(c, NULL, 4, SP_FLOAT32, 1, &d), &d);
  SP_OK(sp_comm_barrier(c, &d), &d);
  /* One member leaves at once, without needing the store's add. */
  SP_OK(sp_comm_leave(c, &d), &d);
  printf(
      "NCCL single member: %zu dtype x count combinations, every op, "
      "bit-identical to the host reference\n",
      checked);
  double t0 = sp_clock_s();
  sp_comm_free(c); /* ncclCommFinalize + ncclCommDestroy */
  double t_free = sp_clock_s() - t0;
  printf("sp_comm_free (finalize + destroy): %.1f ms\n", t_free * 1e3);
  assert_true(t_free < 10.0);
  sp_comm_free(ref);
  sp_mstore_destroy(&st);
}

/* No store at all: a single member needs none. */
static void test_single_member_without_store(void **state) {
  (void)state;
  sp_comm *c = NULL;
  sp_diag d = {{0}};
  sp_comm_opts o = nccl_opts(NULL, NULL, 0, 1, "cuda:0", 10000);
  SP_OK(sp_comm_new(&o, &c, &d), &d);
  float h[5] = {1, -2, 3.5f, 0, 1e-40f}, got[5];
  void *dv = NULL;
  SP_TEST_CU(cudaMalloc(&dv, sizeof h));
  h2d(dv, h, sizeof h);
  SP_OK(sp_comm_all_reduce(c, dv, 5, SP_FLOAT32, &d), &d);
  SP_TEST_CU(cudaMemcpy(got, dv, sizeof got, cudaMemcpyDeviceToHost));
  assert_memory_equal(got, h, sizeof h);
  SP_TEST_CU(cudaFree(dv));
  sp_comm_free(c);
}

/* Work enqueued on the communicator's stream runs before its operations. */
static void test_stream_ordering(void **state) {
  (void)state;
  sp_mstore st;
  sp_mstore_init(&st);
  sp_comm *c = new_n1(&st, "stream", 10000);
  void *s = NULL;
  assert_int_equal(sp_comm_cuda_stream(c, &s), 0);
  assert_non_null(s);
  SP_TEST_CU(cudaStreamQuery((cudaStream_t)s));
  enum { N = 1 << 20 };
  void *dsend = NULL, *drecv = NULL;
  SP_TEST_CU(cudaMalloc(&dsend, N));
  SP_TEST_CU(cudaMalloc(&drecv, N));
  SP_TEST_CU(cudaMemset(dsend, 0, N));
  SP_TEST_CU(cudaMemset(drecv, 0, N));
  SP_TEST_CU(cudaDeviceSynchronize());
  /* Not synchronized: only the stream orders the memset before the
   * gather, whose result must see 0x5A everywhere. */
  SP_TEST_CU(cudaMemsetAsync(dsend, 0x5A, N, (cudaStream_t)s));
  sp_diag d = {{0}};
  SP_OK(sp_comm_all_gather(c, dsend, drecv, N, SP_UINT8, &d), &d);
  unsigned char *h = malloc(N), *want = malloc(N);
  assert_non_null(h);
  assert_non_null(want);
  memset(want, 0x5A, N);
  SP_TEST_CU(cudaMemcpy(h, drecv, N, cudaMemcpyDeviceToHost));
  assert_memory_equal(h, want, N);
  free(h);
  free(want);
  SP_TEST_CU(cudaFree(dsend));
  SP_TEST_CU(cudaFree(drecv));
  sp_comm_free(c);
  sp_mstore_destroy(&st);
}

/* Host memory is refused before anything is enqueued; the communicator is
 * then broken, as after any failed operation. */
static void test_host_pointers_refused(void **state) {
  (void)state;
  sp_mstore st;
  sp_mstore_init(&st);
  sp_diag d = {{0}};
  float host[16] = {0};
  void *dv = NULL;
  SP_TEST_CU(cudaMalloc(&dv, sizeof host));

  sp_comm *c = new_n1(&st, "host1", 10000);
  SP_WANT(SP_EINVAL, sp_comm_all_reduce(c, host, 16, SP_FLOAT32, &d), &d);
  assert_non_null(strstr(d.msg, "host"));
  assert_non_null(strstr(d.msg, "device memory on cuda:0"));
  /* broken now: even a device buffer is refused, naming the first failure */
  int rc = sp_comm_all_reduce(c, dv, 16, SP_FLOAT32, &d);
  assert_true(rc < 0);
  assert_non_null(strstr(d.msg, "broken"));
  sp_comm_free(c);

  /* pinned host memory is host memory too; here in the send position */
  void *pinned = NULL;
  SP_TEST_CU(cudaMallocHost(&pinned, sizeof host));
  c = new_n1(&st, "host2", 10000);
  SP_WANT(SP_EINVAL, sp_comm_all_gather(c, pinned, dv, 16, SP_FLOAT32, &d), &d);
  assert_non_null(strstr(d.msg, "pinned host"));
  sp_comm_free(c);
  c = new_n1(&st, "host3", 10000);
  SP_WANT(SP_EINVAL, sp_comm_reduce_scatter(c, dv, host, 16, SP_FLOAT32, &d),
          &d);
  assert_non_null(strstr(d.msg, "recv"));
  sp_comm_free(c);
  SP_TEST_CU(cudaFreeHost(pinned));
  SP_TEST_CU(cudaFree(dv));
  sp_mstore_destroy(&st);
}

/* An aborted communicator refuses everything and frees through
 * ncclCommAbort. */
static void test_abort_idle(void **state) {
  (void)state;
  sp_mstore st;
  sp_mstore_init(&st);
  sp_comm *c = new_n1(&st, "abort_idle", 10000);
  sp_diag d = {{0}};
  void *dv = NULL;
  SP_TEST_CU(cudaMalloc(&dv, 64));
  SP_OK(sp_comm_all_reduce(c, dv, 16, SP_FLOAT32, &d), &d);
  sp_comm_abort(c);
  sp_comm_abort(c); /* twice is fine */
  SP_WANT(SP_ECANCELED, sp_comm_all_reduce(c, dv, 16, SP_FLOAT32, &d), &d);
  SP_WANT(SP_ECANCELED, sp_comm_barrier(c, &d), &d);
  SP_OK(sp_comm_leave(c, &d), &d); /* nothing to protect */
  double t0 = sp_clock_s();
  sp_comm_free(c);
  assert_true(sp_clock_s() - t0 < 10.0);
  SP_TEST_CU(cudaFree(dv));
  sp_mstore_destroy(&st);
}

/* A single-member communicator whose stream is held by a host function
 * (the gate) until `open`, and a thread that opens the gate open_after_ms
 * after the start, having aborted the communicator abort_after_ms after
 * the start first when that is not 0. */
typedef struct held {
  sp_mstore st;
  sp_comm *c;
  void *dv; /* 4096 device bytes for the operation */
  atomic_int open;
  unsigned abort_after_ms; /* 0: no abort */
  unsigned open_after_ms;  /* after the start (or after the abort) */
  pthread_t t;
} held;

static void CUDART_CB gate_fn(void *arg) {
  held *h = arg;
  /* 30 s safety valve: never hold the GPU forever, whatever the test does */
  for (int i = 0; i < 30000 && !atomic_load(&h->open); i++) sp_test_sleep_ms(1);
}

static void *opener_thread(void *arg) {
  held *h = arg;
  if (h->abort_after_ms > 0) {
    sp_test_sleep_ms(h->abort_after_ms);
    sp_comm_abort(h->c);
  }
  sp_test_sleep_ms(h->open_after_ms);
  atomic_store(&h->open, 1);
  return NULL;
}

static void held_start(held *h, const char *prefix, uint64_t timeout_ms,
                       unsigned abort_after_ms, unsigned open_after_ms) {
  sp_mstore_init(&h->st);
  h->c = new_n1(&h->st, prefix, timeout_ms);
  void *s = NULL;
  assert_int_equal(sp_comm_cuda_stream(h->c, &s), 0);
  h->dv = NULL;
  SP_TEST_CU(cudaMalloc(&h->dv, 4096));
  atomic_init(&h->open, 0);
  h->abort_after_ms = abort_after_ms;
  h->open_after_ms = open_after_ms;
  SP_TEST_CU(cudaLaunchHostFunc((cudaStream_t)s, gate_fn, h));
  assert_int_equal(pthread_create(&h->t, NULL, opener_thread, h), 0);
}

/* After held_start: the thread joined (the gate open). */
static void held_join(held *h) { pthread_join(h->t, NULL); }

static void held_free(held *h) {
  sp_comm_free(h->c);
  SP_TEST_CU(cudaFree(h->dv));
  sp_mstore_destroy(&h->st);
}

/* sp_comm_abort from another thread wakes an operation that is waiting for
 * the device: SP_ECANCELED, promptly, and the communicator stays aborted. */
static void test_abort_blocked_op(void **state) {
  (void)state;
  held h;
  held_start(&h, "abort_blocked", 20000, 200, 300);
  sp_diag d = {{0}};
  double t0 = sp_clock_s();
  int rc = sp_comm_all_reduce(h.c, h.dv, 1024, SP_FLOAT32, &d);
  double dt = sp_clock_s() - t0;
  held_join(&h);
  printf("aborted all_reduce returned %s after %.0f ms: %s\n", sp_err_name(rc),
         dt * 1e3, d.msg);
  if (rc != SP_ECANCELED)
    fail_msg("got %s (%s), want SP_ECANCELED", sp_err_name(rc), d.msg);
  assert_true(dt >= 0.15);
  assert_true(dt < 10.0);
  SP_WANT(SP_ECANCELED, sp_comm_barrier(h.c, &d), &d);
  held_free(&h);
}

/* An operation that does not complete within the timeout: SP_ETIMEDOUT,
 * the NCCL communicator aborted, the sp_comm broken. */
static void test_op_timeout(void **state) {
  (void)state;
  held h;
  held_start(&h, "op_timeout", 300, 0, 1000);
  sp_diag d = {{0}};
  double t0 = sp_clock_s();
  int rc =
      sp_comm_all_gather(h.c, h.dv, (char *)h.dv + 2048, 512, SP_FLOAT32, &d);
  double dt = sp_clock_s() - t0;
  held_join(&h);
  printf("blocked all_gather returned %s after %.0f ms: %s\n", sp_err_name(rc),
         dt * 1e3, d.msg);
  if (rc != SP_ETIMEDOUT)
    fail_msg("got %s (%s), want SP_ETIMEDOUT", sp_err_name(rc), d.msg);
  assert_non_null(strstr(d.msg, "300 ms"));
  assert_true(dt >= 0.25);
  assert_true(dt < 10.0);
  rc = sp_comm_barrier(h.c, &d);
  if (rc != SP_ETIMEDOUT || strstr(d.msg, "broken") == NULL)
    fail_msg(
        "after a timeout: got %s (%s), want the broken communicator's "
        "SP_ETIMEDOUT",
        sp_err_name(rc), d.msg);
  held_free(&h);
}

typedef struct canceller {
  double start;
  double after_s;
  atomic_int calls;
} canceller;

static bool cancel_after(void *user) {
  canceller *k = user;
  atomic_fetch_add(&k->calls, 1);
  return sp_clock_s() - k->start >= k->after_s;
}

/* Rank 0 of 2 with nobody else: the non-blocking init waits for rank 1
 * until the timeout, then aborts (SP_ETIMEDOUT); with a cancel callback it
 * stops when told (SP_ECANCELED). The id was published either way. */
static void test_init_timeout_and_cancel(void **state) {
  (void)state;
  sp_mstore st;
  sp_mstore_init(&st);
  sp_comm *c = (sp_comm *)&st;
  sp_diag d = {{0}};
  sp_comm_opts o = nccl_opts(&st, "lonely", 0, 2, "cuda:0", 1500);
  double t0 = sp_clock_s();
  int rc = sp_comm_new(&o, &c, &d);
  double dt = sp_clock_s() - t0;
  printf("rank 0 of 2 alone: %s after %.0f ms: %s\n", sp_err_name(rc), dt * 1e3,
         d.msg);
  if (rc != SP_ETIMEDOUT)
    fail_msg("got %s (%s), want SP_ETIMEDOUT", sp_err_name(rc), d.msg);
  assert_null(c);
  assert_true(dt >= 1.4);
  assert_true(dt < 20.0);
  assert_int_equal(sp_mstore_len(&st, "lonely/nccl_id"), 128);

  canceller k = {.start = sp_clock_s(), .after_s = 0.3};
  atomic_init(&k.calls, 0);
  o = nccl_opts(&st, "lonely2", 0, 2, "cuda:0", 30000);
  o.cancel = cancel_after;
  o.cancel_user = &k;
  t0 = sp_clock_s();
  rc = sp_comm_new(&o, &c, &d);
  dt = sp_clock_s() - t0;
  printf("rank 0 of 2 cancelled: %s after %.0f ms: %s\n", sp_err_name(rc),
         dt * 1e3, d.msg);
  if (rc != SP_ECANCELED)
    fail_msg("got %s (%s), want SP_ECANCELED", sp_err_name(rc), d.msg);
  assert_true(dt < 15.0);
  assert_true(atomic_load(&k.calls) > 0);
  sp_mstore_destroy(&st);
}

/* Rank 1 of 2 whose id never comes: the store wait times out, or is
 * cancelled; an id of the wrong size is SP_EFORMAT. No NCCL call is made. */
static void test_rank1_without_id(void **state) {
  (void)state;
  sp_mstore st;
  sp_mstore_init(&st);
  sp_comm *c = NULL;
  sp_diag d = {{0}};
  sp_comm_opts o = nccl_opts(&st, "noid", 1, 2, "cuda:0", 500);
  double t0 = sp_clock_s();
  SP_WANT(SP_ETIMEDOUT, sp_comm_new(&o, &c, &d), &d);
  assert_true(sp_clock_s() - t0 >= 0.45);
  assert_non_null(strstr(d.msg, "noid/nccl_id"));
  assert_null(c);

  canceller k = {.start = sp_clock_s(), .after_s = 0.2};
  atomic_init(&k.calls, 0);
  o = nccl_opts(&st, "noid2", 1, 2, "cuda:0", 30000);
  o.cancel = cancel_after;
  o.cancel_user = &k;
  t0 = sp_clock_s();
  SP_WANT(SP_ECANCELED, sp_comm_new(&o, &c, &d), &d);
  assert_true(sp_clock_s() - t0 < 5.0);

  assert_int_equal(sp_mstore_set(&st, "short/nccl_id", "xyz", 3, &d), 0);
  o = nccl_opts(&st, "short", 1, 2, "cuda:0", 5000);
  SP_WANT(SP_EFORMAT, sp_comm_new(&o, &c, &d), &d);
  assert_null(c);
  sp_mstore_destroy(&st);
}

/* ---- more than one GPU: a real multi-rank run -------------------------- */

enum { MAX_RANKS = 8 };

typedef struct rank_arg {
  sp_mstore *st;
  uint32_t rank, size;
  char fail[SP_DIAG_MAX + 128];
} rank_arg;

#define RFAIL(a, ...)                                  \
  do {                                                 \
    snprintf((a)->fail, sizeof(a)->fail, __VA_ARGS__); \
    goto out;                                          \
  } while (0)

/* Values are small integers, exact in every dtype used and in any sum
 * order, so the expected results do not depend on NCCL's algorithm. */
static void *rank_thread(void *arg) {
  rank_arg *a = arg;
  const uint32_t W = a->size, r = a->rank;
  const size_t n = 1000;
  char dev[16];
  snprintf(dev, sizeof dev, "cuda:%u", r);
  sp_comm *c = NULL;
  sp_diag d = {{0}};
  float *h = malloc(W * n * sizeof(float));
  float *dbuf = NULL, *dout = NULL;
  if (h == NULL) RFAIL(a, "no memory");
  sp_comm_opts o = nccl_opts(a->st, "multi", r, W, dev, 60000);
  int rc = sp_comm_new(&o, &c, &d);
  if (rc != 0) RFAIL(a, "rank %u: sp_comm_new: %s", r, d.msg);
  if (cudaMalloc((void **)&dbuf, W * n * sizeof(float)) != cudaSuccess ||
      cudaMalloc((void **)&dout, W * n * sizeof(float)) != cudaSuccess)
    RFAIL(a, "rank %u: cudaMalloc failed", r);
  /* all_gather: member i contributes i*1000 + k */
  for (size_t k = 0; k < n; k++) h[k] = (float)(r * 1000 + k);
  if (cudaMemcpy(dbuf, h, n * sizeof(float), cudaMemcpyHostToDevice) !=
          cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess)
    RFAIL(a, "rank %u: copy", r);
  rc = sp_comm_all_gather(c, dbuf, dout, n, SP_FLOAT32, &d);
  if (rc != 0) RFAIL(a, "rank %u: all_gather: %s", r, d.msg);
  if (cudaMemcpy(h, dout, W * n * sizeof(float), cudaMemcpyDeviceToHost) !=
      cudaSuccess)
    RFAIL(a, "rank %u: copy back", r);
  for (uint32_t i = 0; i < W; i++)
    for (size_t k = 0; k < n; k++)
      if (h[i * n + k] != (float)(i * 1000 + k))
        RFAIL(a, "rank %u: all_gather block %u elem %zu = %g", r, i, k,
              (double)h[i * n + k]);
  /* reduce_scatter: block b of member i holds i + b + k % 7 */
  for (uint32_t b = 0; b < W; b++)
    for (size_t k = 0; k < n; k++) h[b * n + k] = (float)(r + b + k % 7);
  if (cudaMemcpy(dbuf, h, W * n * sizeof(float), cudaMemcpyHostToDevice) !=
          cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess)
    RFAIL(a, "rank %u: copy", r);
  rc = sp_comm_reduce_scatter(c, dbuf, dout, n, SP_FLOAT32, &d);
  if (rc != 0) RFAIL(a, "rank %u: reduce_scatter: %s", r, d.msg);
  if (cudaMemcpy(h, dout, n * sizeof(float), cudaMemcpyDeviceToHost) !=
      cudaSuccess)
    RFAIL(a, "rank %u: copy back", r);
  for (size_t k = 0; k < n; k++) {
    float want = 0;
    for (uint32_t i = 0; i < W; i++) want += (float)(i + r + k % 7);
    if (h[k] != want)
      RFAIL(a, "rank %u: reduce_scatter elem %zu = %g, want %g", r, k,
            (double)h[k], (double)want);
  }
  /* broadcast from the last member */
  for (size_t k = 0; k < n; k++) h[k] = (float)(r == W - 1 ? k * 3 : 0);
  if (cudaMemcpy(dbuf, h, n * sizeof(float), cudaMemcpyHostToDevice) !=
          cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess)
    RFAIL(a, "rank %u: copy", r);
  rc = sp_comm_broadcast(c, dbuf, n, SP_FLOAT32, W - 1, &d);
  if (rc != 0) RFAIL(a, "rank %u: broadcast: %s", r, d.msg);
  if (cudaMemcpy(h, dbuf, n * sizeof(float), cudaMemcpyDeviceToHost) !=
      cudaSuccess)
    RFAIL(a, "rank %u: copy back", r);
  for (size_t k = 0; k < n; k++)
    if (h[k] != (float)(k * 3))
      RFAIL(a, "rank %u: broadcast elem %zu = %g", r, k, (double)h[k]);
  rc = sp_comm_barrier(c, &d);
  if (rc != 0) RFAIL(a, "rank %u: barrier: %s", r, d.msg);
out:
  cudaFree(dbuf);
  cudaFree(dout);
  sp_comm_free(c);
  free(h);
  return NULL;
}

static void test_multi_gpu(void **state) {
  (void)state;
  if (g_ndev < 2) {
    printf(
        "multi-GPU run skipped: %d CUDA device (NCCL needs one GPU per "
        "rank)\n",
        g_ndev);
    skip();
  }
  uint32_t W = g_ndev < MAX_RANKS ? (uint32_t)g_ndev : MAX_RANKS;
  sp_mstore st;
  sp_mstore_init(&st);
  rank_arg args[MAX_RANKS];
  pthread_t th[MAX_RANKS];
  for (uint32_t r = 0; r < W; r++) {
    args[r] = (rank_arg){.st = &st, .rank = r, .size = W};
    assert_int_equal(pthread_create(&th[r], NULL, rank_thread, &args[r]), 0);
  }
  for (uint32_t r = 0; r < W; r++) pthread_join(th[r], NULL);
  for (uint32_t r = 0; r < W; r++)
    if (args[r].fail[0] != '\0') fail_msg("%s", args[r].fail);
  printf(
      "NCCL across %u GPUs: all_gather, reduce_scatter, broadcast, "
      "barrier agree\n",
      W);
  sp_mstore_destroy(&st);
}

#define GPU_TEST(fn) cmocka_unit_test_setup_teardown(fn, watchdog, watchdog_off)
#endif

int main(void) {
  int n = 0;
#if SHARDPLANE_HAVE_CUDA
  if (sp_cuda_device_count(&n) != 0) n = 0;
#endif
  g_ndev = n;
  const struct CMUnitTest nodev[] = {
    cmocka_unit_test(test_gloo_has_no_stream),
#if SHARDPLANE_HAVE_NCCL
    cmocka_unit_test(test_bad_device_strings),
    cmocka_unit_test(test_missing_device),
#else
    cmocka_unit_test(test_not_built),
#endif
  };
  int rc = cmocka_run_group_tests_name("without a device", nodev, NULL, NULL);
  if (rc != 0) return rc;
#if !SHARDPLANE_HAVE_NCCL
  return sp_test_skip(
      "libshardplane was built without the NCCL backend (it "
      "needs CUDA and NCCL >= 2.14 at configure time); the "
      "SP_EUNSUPPORTED answer was checked");
#else
  if (n == 0)
    return sp_test_skip(
        "no CUDA device (or no driver) present; the device "
        "string checks and SP_ENODEV were checked");
  const struct CMUnitTest gpu[] = {
      GPU_TEST(test_ops_single_member),
      GPU_TEST(test_single_member_without_store),
      GPU_TEST(test_stream_ordering),
      GPU_TEST(test_host_pointers_refused),
      GPU_TEST(test_abort_idle),
      GPU_TEST(test_abort_blocked_op),
      GPU_TEST(test_op_timeout),
      GPU_TEST(test_rank1_without_id),
      GPU_TEST(test_multi_gpu),
      /* last: it leaves NCCL bootstrap threads waiting for a rank that never
       * comes, which must not disturb the tests above */
      GPU_TEST(test_init_timeout_and_cancel),
  };
  return cmocka_run_group_tests_name("NCCL on a GPU", gpu, NULL, NULL);
#endif
}
