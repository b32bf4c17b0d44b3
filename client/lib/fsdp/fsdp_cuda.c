/* The FSDP runtime's device storage (fsdp_internal.h, sp_fsdp_mem_ops):
 * cudaMalloc'd shards, views, gradients and buffers, two streams (compute
 * and comm) ordered with one event per work-ring slot, and device names.
 * Every allocation comes through the runtime's pool (plan/memory.h), which
 * keeps the unsharded slots' blocks cached from the first step to
 * sp_fsdp_free: no cudaMalloc or cudaFree in a later step.
 *
 * Ordering, as fsdp_internal.h sets it out: the training thread's device
 * work (zeroing gradients, the optimizer, clipping, buffer casts, uploads) and the trainer's
 * kernels run on the compute stream; the communication thread's casts run
 * on the comm stream, which waits for an event recorded on the compute
 * stream when the work was queued. A work item ends with the comm stream
 * drained, so a finished ticket means finished on the device, and the
 * training thread may use the results on the compute stream at once.
 * The communicator runs on a stream of its own: before each collective the
 * comm lane records an event that stream waits for, so the collective sees
 * the lane's casts; it returns once complete on the device.
 *
 * Both streams are non-blocking: they must not serialise against the
 * legacy default stream that other code in the process may use, and
 * nothing here relies on it. Allocation zeroes on the compute stream for
 * the same reason (a plain cudaMemset would run on the legacy stream,
 * unordered with non-blocking streams).
 *
 * Without CUDA (SHARDPLANE_HAVE_CUDA unset) only the device-name functions
 * exist, and asking for a GPU fails with SP_EUNSUPPORTED. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cast/cast_cuda.h"
#include "fsdp_internal.h"

/* "cuda:N" -> N; -1 when malformed. Digits only, no sign or spaces, so
 * "cuda:+1" or "cuda: 1" are not read as device 1. */
static long cuda_ordinal(const char *s) {
  if (strncmp(s, "cuda:", 5) != 0) return -1;
  s += 5;
  if (*s < '0' || *s > '9') return -1;
  long n = 0;
  for (; *s; s++) {
    if (*s < '0' || *s > '9' || n > 1000000) return -1;
    n = n * 10 + (*s - '0');
  }
  return n;
}

#if SHARDPLANE_HAVE_CUDA

#include <cuda_runtime_api.h>

#include "cast/cast_cuda.h"
#include "cuda/cuda_check.h"
#include "cuda_internal.h"

/* ---- the device memory ops ---- */

typedef struct cuda_state {
  int device;
  cudaStream_t compute, comm;
  cudaEvent_t *marks; /* one per work-ring slot */
  size_t n_marks;
  cudaEvent_t handoff; /* comm lane -> a communicator's stream */
} cuda_state;

static cuda_state *state(const sp_fsdp *f) { return f->dev; }

static cudaStream_t lane(const sp_fsdp *f, sp_fsdp_lane l) {
  return l == SP_LANE_COMM ? state(f)->comm : state(f)->compute;
}

static int cu_alloc(sp_fsdp *f, size_t n, size_t esize, void **out,
                    sp_diag *d) {
  *out = NULL;
  if (esize && n > SIZE_MAX / esize)
    return sp_diag_set(d, SP_ETOOBIG, "%zu elements of %zu bytes overflow", n,
                       esize);
  /* a valid, distinct pointer also for an empty tensor */
  size_t bytes = n * esize;
  if (bytes == 0) bytes = 1;
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return sp_diag_set(d, SP_ENOMEM,
                       "cudaMalloc of %zu bytes on cuda:%d: "
                       "out of device memory",
                       bytes, state(f)->device);
  }
  SP_CUDA_CHECK(d, e);
  e = cudaMemsetAsync(p, 0, bytes, state(f)->compute);
  if (e != cudaSuccess) {
    cudaFree(p);
    return sp_cuda_diag(d, e, "cudaMemsetAsync(p, 0, bytes, compute)", __FILE__,
                        __LINE__);
  }
  *out = p;
  return 0;
}

static void cu_release(sp_fsdp *f, void *p) {
  if (!p) return;
  /* work queued on the compute stream may still read it */
  (void)cudaStreamSynchronize(state(f)->compute);
  (void)cudaFree(p);
}

static int cu_zero(sp_fsdp *f, sp_fsdp_lane l, void *p, size_t bytes,
                   sp_diag *d) {
  if (bytes) SP_CUDA_CHECK(d, cudaMemsetAsync(p, 0, bytes, lane(f, l)));
  return 0;
}

static int cu_copy(sp_fsdp *f, sp_fsdp_lane l, void *dst, const void *src,
                   size_t bytes, sp_diag *d) {
  if (bytes && dst != src)
    SP_CUDA_CHECK(d, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                     lane(f, l)));
  return 0;
}

static int cu_cast(sp_fsdp *f, sp_fsdp_lane l, void *dst, sp_dtype dt,
                   const void *src, sp_dtype st, size_t n, sp_diag *d) {
  int rc = sp_cuda_cast(dst, dt, src, st, n, (void *)lane(f, l));
  if (rc < 0)
    return sp_diag_set(
        d, rc,
        "%s:%d: sp_cuda_cast(%s -> %s, %zu elements) "
        "failed: %s%s",
        __FILE__, __LINE__, sp_dtype_name(st), sp_dtype_name(dt), n,
        sp_strerror(rc),
        rc == SP_ECUDA ? " (the CUDA error is logged above)" : "");
  return 0;
}

static int cu_scale_div(sp_fsdp *f, sp_fsdp_lane l, void *buf, sp_dtype dt,
                        size_t n, double div, sp_diag *d) {
  if (div == 1.0 || n == 0) return 0;
  return sp_fsdp_cuda_scale_div(buf, dt, n, div, (void *)lane(f, l), d);
}

static int cu_acc_div(sp_fsdp *f, sp_fsdp_lane l, void *dst, sp_dtype dt,
                      void *src, sp_dtype st, size_t n, double div,
                      sp_diag *d) {
  /* the quotient in place (scale_div's rule, as the host), then the sum */
  int rc = cu_scale_div(f, l, src, st, n, div, d);
  if (rc == 0)
    rc = sp_fsdp_cuda_acc(dst, dt, src, st, n, (void *)lane(f, l), d);
  return rc;
}

static int cu_scale(sp_fsdp *f, sp_fsdp_lane l, void *g, sp_dtype gdt, size_t n,
                    double k, sp_diag *d) {
  return sp_fsdp_cuda_scale(g, gdt, n, k, (void *)lane(f, l), d);
}

static int cu_sqsum(sp_fsdp *f, const void *g, sp_dtype gdt, size_t n,
                    double *partial, double *out, sp_diag *d) {
  return sp_fsdp_cuda_sqsum(g, gdt, n, partial, out, (void *)state(f)->compute,
                            d);
}

static int cu_sgd(sp_fsdp *f, void *p, sp_dtype pdt, const void *g,
                  sp_dtype gdt, float *buf, size_t n, double lr,
                  double momentum, double wd, sp_diag *d) {
  return sp_fsdp_cuda_sgd(p, pdt, g, gdt, buf, n, lr, momentum, wd,
                          (void *)state(f)->compute, d);
}

static int cu_adamw(sp_fsdp *f, void *p, sp_dtype pdt, const void *g,
                    sp_dtype gdt, float *m, float *v, size_t n,
                    const sp_fsdp_adamw_args *a, sp_diag *d) {
  return sp_fsdp_cuda_adamw(p, pdt, g, gdt, m, v, n, a,
                            (void *)state(f)->compute, d);
}

static int cu_to_host(sp_fsdp *f, void *host, const void *src, size_t bytes,
                      sp_diag *d) {
  if (!bytes) return 0;
  cudaStream_t s = state(f)->compute;
  SP_CUDA_CHECK(d,
                cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, s));
  SP_CUDA_CHECK(d, cudaStreamSynchronize(s));
  return 0;
}

static int cu_from_host(sp_fsdp *f, void *dst, const void *host, size_t bytes,
                        sp_diag *d) {
  if (!bytes) return 0;
  cudaStream_t s = state(f)->compute;
  SP_CUDA_CHECK(d,
                cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, s));
  /* the caller frees or reuses host memory on return */
  SP_CUDA_CHECK(d, cudaStreamSynchronize(s));
  return 0;
}

static int cu_mark(sp_fsdp *f, size_t slot, sp_diag *d) {
  cuda_state *cs = state(f);
  if (slot >= cs->n_marks)
    return sp_diag_set(d, SP_ERANGE, "work slot %zu of %zu", slot, cs->n_marks);
  SP_CUDA_CHECK(d, cudaEventRecord(cs->marks[slot], cs->compute));
  return 0;
}

static int cu_wait_mark(sp_fsdp *f, size_t slot, sp_diag *d) {
  cuda_state *cs = state(f);
  if (slot >= cs->n_marks)
    return sp_diag_set(d, SP_ERANGE, "work slot %zu of %zu", slot, cs->n_marks);
  SP_CUDA_CHECK(d, cudaStreamWaitEvent(cs->comm, cs->marks[slot], 0));
  return 0;
}

static int cu_drain(sp_fsdp *f, sp_fsdp_lane l, sp_diag *d) {
  SP_CUDA_CHECK(d, cudaStreamSynchronize(lane(f, l)));
  return 0;
}

static int cu_handoff(sp_fsdp *f, void *stream, sp_diag *d) {
  cuda_state *cs = state(f);
  /* one event suffices: only the comm thread hands off, one collective at
   * a time, and a wait captures the event's state when it is enqueued */
  SP_CUDA_CHECK(d, cudaEventRecord(cs->handoff, cs->comm));
  SP_CUDA_CHECK(d, cudaStreamWaitEvent((cudaStream_t)stream, cs->handoff, 0));
  return 0;
}

static int cu_thread_init(sp_fsdp *f, sp_diag *d) {
  SP_CUDA_CHECK(d, cudaSetDevice(state(f)->device));
  return 0;
}

static void cu_state_free(cuda_state *cs) {
  if (!cs) return;
  for (size_t i = 0; cs->marks && i < cs->n_marks; i++)
    if (cs->marks[i]) (void)cudaEventDestroy(cs->marks[i]);
  free(cs->marks);
  if (cs->handoff) (void)cudaEventDestroy(cs->handoff);
  if (cs->comm) (void)cudaStreamDestroy(cs->comm);
  if (cs->compute) (void)cudaStreamDestroy(cs->compute);
  free(cs);
}

static void cu_destroy(sp_fsdp *f) {
  cu_state_free(f->dev);
  f->dev = NULL;
}

static const sp_fsdp_mem_ops k_cuda_ops = {
    .name = "cuda",
    .device = true,
    .alloc = cu_alloc,
    .release = cu_release,
    .zero = cu_zero,
    .copy = cu_copy,
    .cast = cu_cast,
    .scale_div = cu_scale_div,
    .acc_div = cu_acc_div,
    .scale = cu_scale,
    .sqsum = cu_sqsum,
    .sgd = cu_sgd,
    .adamw = cu_adamw,
    .to_host = cu_to_host,
    .from_host = cu_from_host,
    .mark = cu_mark,
    .wait_mark = cu_wait_mark,
    .drain = cu_drain,
    .handoff = cu_handoff,
    .thread_init = cu_thread_init,
    .destroy = cu_destroy,
};

static int attach(cuda_state *cs, size_t n_marks, sp_diag *d) {
  SP_CUDA_CHECK(d, cudaSetDevice(cs->device));
  SP_CUDA_CHECK(d,
                cudaStreamCreateWithFlags(&cs->compute, cudaStreamNonBlocking));
  SP_CUDA_CHECK(d, cudaStreamCreateWithFlags(&cs->comm, cudaStreamNonBlocking));
  cs->marks = calloc(n_marks, sizeof *cs->marks);
  if (!cs->marks) return sp_diag_set(d, SP_ENOMEM, "no memory");
  cs->n_marks = n_marks;
  /* no timing: the cheapest events, used only for ordering */
  for (size_t i = 0; i < n_marks; i++)
    SP_CUDA_CHECK(
        d, cudaEventCreateWithFlags(&cs->marks[i], cudaEventDisableTiming));
  SP_CUDA_CHECK(d,
                cudaEventCreateWithFlags(&cs->handoff, cudaEventDisableTiming));
  return 0;
}

int sp_fsdp_cuda_attach(sp_fsdp *f, const char *device, sp_diag *d) {
  int ordinal = -1;
  int rc = sp_device_parse(device, &ordinal, d);
  if (rc < 0) return rc;
  if (ordinal < 0)
    return sp_diag_set(d, SP_EINVAL, "sp_fsdp_cuda_attach: %s is no GPU",
                       device);
  cuda_state *cs = calloc(1, sizeof *cs);
  if (!cs) return sp_diag_set(d, SP_ENOMEM, "no memory");
  cs->device = ordinal;
  rc = attach(cs, f->queue_cap, d);
  if (rc < 0) {
    cu_state_free(cs);
    return sp_diag_prefix(d, rc, "%s", device);
  }
  f->dev = cs;
  f->mem = &k_cuda_ops;
  return 0;
}

void *sp_fsdp_cuda_stream(const sp_fsdp *f) {
  return f && f->mem->device ? (void *)state(f)->compute : NULL;
}

#else /* !SHARDPLANE_HAVE_CUDA */

int sp_fsdp_cuda_attach(sp_fsdp *f, const char *device, sp_diag *d) {
  (void)f;
  int ordinal;
  int rc = sp_device_parse(device, &ordinal, d);
  return rc < 0 ? rc
                : sp_diag_set(d, SP_EINVAL,
                              "sp_fsdp_cuda_attach: %s is no "
                              "GPU",
                              device);
}

void *sp_fsdp_cuda_stream(const sp_fsdp *f) {
  (void)f;
  return NULL;
}

#endif

/* ---- device names (with and without CUDA) ---- */

int sp_device_parse(const char *device, int *ordinal, sp_diag *d) {
  if (!device || !ordinal)
    return sp_diag_set(d, SP_EINVAL, "sp_device_parse: NULL argument");
  *ordinal = -1;
  if (strcmp(device, "cpu") == 0 || strcmp(device, "cpu-staged") == 0) return 0;
  long n = cuda_ordinal(device);
  if (n < 0)
    return sp_diag_set(d, SP_EINVAL, "%s: expected cpu or cuda:N", device);
#if !SHARDPLANE_HAVE_CUDA
  return sp_diag_set(d, SP_EUNSUPPORTED,
                     "%s: this library was built "
                     "without CUDA",
                     device);
#else
  int count = 0;
  int rc = sp_cuda_device_count(&count);
  if (rc < 0)
    return sp_diag_set(d, rc,
                       "%s: cannot count CUDA devices (the driver's "
                       "error is logged above)",
                       device);
  if (count == 0)
    return sp_diag_set(d, SP_ENODEV, "%s: no CUDA device", device);
  if (n >= count)
    return sp_diag_set(d, SP_ENODEV, "%s: no such CUDA device (%d present)",
                       device, count);
  *ordinal = (int)n;
  return 0;
#endif
}
