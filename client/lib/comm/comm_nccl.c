/* The NCCL backend of sp_comm (GPU; built only when CMake finds CUDA and
 * NCCL, which defines SHARDPLANE_HAVE_NCCL).
 *
 * Buffers are device memory on the communicator's device. Every member runs
 * through NCCL, a single one included (NCCL supports nranks = 1), because
 * comm.c's host path would memcpy device pointers on the host.
 *
 * Why the communicator is non-blocking (ncclConfig_t.blocking = 0) and every
 * wait is a poll: a blocking NCCL call cannot be interrupted. With polling,
 * one loop (nc_wait) watches, for every wait there is (init, an operation,
 * finalize): NCCL's asynchronous error, the CUDA stream, the abort flag that
 * sp_comm_abort sets from any thread, and the deadline. On abort or deadline
 * the waiting thread itself calls ncclCommAbort: the comm handle is freed by
 * it, so calling it from the aborting thread while this one still polls the
 * handle would be a use after free. An idle communicator that is aborted is
 * refused by comm.c's gate and aborted in nc_destroy.
 *
 * Why every operation waits for completion before returning: the contract of
 * sp_comm (comm_internal.h) is that when a call returns, successfully or
 * not, nothing will touch the caller's buffers any more. The caller orders
 * its own stream against ours with events (sp_comm_cuda_stream) if it wants
 * the GPU kept busy across the wait.
 *
 * Failure rule, as for Gloo: an operation that fails (NCCL error, CUDA
 * error, timeout, abort, a buffer that is not device memory) aborts the NCCL
 * communicator, waits (bounded) for our stream to drain so no late transfer
 * lands in the caller's memory, and leaves the communicator dead; comm.c
 * then marks it broken.
 *
 * Every CUDA and NCCL call goes through NC_CUDA_CALL / SP_NCCL_CALL (or
 * the return form SP_NCCL_CHECK), which write "file:line: call: error" into
 * the diagnostic and give a negative SP_E* code (SP_ECUDA / SP_ENCCL).
 */
#include "comm_internal.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cast/cast_cuda.h"

#if NCCL_VERSION_CODE < 21400
#error "the NCCL backend needs NCCL >= 2.14 (non-blocking init, finalize)"
#endif

/* ---- checked calls ------------------------------------------------------- */

/* Fills d with the NCCL error string and NCCL's own last message (which
 * often says why: "Duplicate GPU detected", a socket error, ...). */
static int nc_nccl_fail(sp_diag *d, ncclResult_t r, const char *expr,
                        const char *file, int line) {
  const char *last = ncclGetLastError(NULL);
  bool has_last = last != NULL && last[0] != '\0';
  return sp_diag_set(d, SP_ENCCL, "%s:%d: %s: NCCL error %d (%s)%s%s", file,
                     line, expr, (int)r, ncclGetErrorString(r),
                     has_last ? ": " : "", has_last ? last : "");
}

/* ncclInProgress is not a failure on a non-blocking communicator: the call
 * was accepted and nc_wait polls for its end. */
static int nc_nccl_check(sp_diag *d, ncclResult_t r, const char *expr,
                         const char *file, int line) {
  if (r == ncclSuccess || r == ncclInProgress) return 0;
  return nc_nccl_fail(d, r, expr, file, line);
}

static int nc_cuda_check(sp_diag *d, cudaError_t e, const char *expr,
                         const char *file, int line) {
  if (e == cudaSuccess) return 0;
  /* Clear the runtime's last-error slot for a non-sticky error, so an
   * unrelated later check does not report it again (a sticky one, a kernel
   * fault, stays and fails every later call, as it must). */
  (void)cudaGetLastError();
  return sp_diag_set(d, SP_ECUDA, "%s:%d: %s: CUDA error %s (%s)", file, line,
                     expr, cudaGetErrorName(e), cudaGetErrorString(e));
}

/* Expression forms (0 or a negative SP_E* code, d filled), for call sites
 * that must clean up before returning. */
#define SP_NCCL_CALL(d, call) \
  nc_nccl_check((d), (call), #call, __FILE__, __LINE__)
#define NC_CUDA_CALL(d, call) \
  nc_cuda_check((d), (call), #call, __FILE__, __LINE__)
/* Return forms. */
#define SP_NCCL_CHECK(d, call)               \
  do {                                       \
    int sp_nccl_rc_ = SP_NCCL_CALL(d, call); \
    if (sp_nccl_rc_ < 0) return sp_nccl_rc_; \
  } while (0)

/* ---- time ---------------------------------------------------------------- */

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ns(long ns) {
  struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
  nanosleep(&ts, NULL);
}

/* ---- state --------------------------------------------------------------- */

typedef struct nccl_impl {
  ncclComm_t comm; /* NULL once aborted or destroyed */
  cudaStream_t stream;
  int dev;
  uint32_t rank;
  uint32_t size;
  uint64_t timeout_ms;
  /* Two device int32: [0] stays 0 (the barrier's input), [1] receives the
   * barrier's sum. Separate buffers, so repeated barriers never grow a
   * value until it overflows. */
  int32_t *scratch;
  /* Set by nc_abort from any thread; read by the polling thread. */
  atomic_bool abort_req;
  /* The stream still had work after an abort and the drain wait ran out:
   * freeing device memory (an implicit device synchronize) could hang. */
  bool undrained;
} nccl_impl;

/* "cuda:N", N decimal, nothing else. */
static int parse_device(const char *s, int *ord) {
  if (s == NULL || strncmp(s, "cuda:", 5) != 0) return -1;
  const char *p = s + 5;
  if (*p == '\0') return -1;
  long v = 0;
  for (; *p != '\0'; p++) {
    if (*p < '0' || *p > '9') return -1;
    v = v * 10 + (*p - '0');
    if (v > 1000000) return -1;
  }
  *ord = (int)v;
  return 0;
}

static const char *mem_type_name(enum cudaMemoryType t) {
  switch (t) {
    case cudaMemoryTypeUnregistered: return "host (unregistered)";
    case cudaMemoryTypeHost: return "pinned host";
    case cudaMemoryTypeDevice: return "device";
    case cudaMemoryTypeManaged: return "managed";
  }
  return "unknown";
}

/* A host pointer handed to NCCL makes the kernel fault, which poisons the
 * whole CUDA context; refusing it here keeps the mistake an SP_EINVAL. */
static int nc_check_buffer(const nccl_impl *n, const void *p, const char *which,
                           sp_diag *d) {
  struct cudaPointerAttributes a;
  memset(&a, 0, sizeof a);
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return sp_diag_set(d, SP_EINVAL,
                       "%s buffer %p is not memory CUDA knows (%s); the NCCL "
                       "backend needs device memory on cuda:%d",
                       which, p, cudaGetErrorString(e), n->dev);
  }
  if (a.type == cudaMemoryTypeManaged) return 0;
  if (a.type == cudaMemoryTypeDevice && a.device == n->dev) return 0;
  if (a.type == cudaMemoryTypeDevice)
    return sp_diag_set(d, SP_EINVAL,
                       "%s buffer %p is device memory on cuda:%d, but the "
                       "communicator is on cuda:%d",
                       which, p, a.device, n->dev);
  return sp_diag_set(d, SP_EINVAL,
                     "%s buffer %p is %s memory; the NCCL backend needs "
                     "device memory on cuda:%d",
                     which, p, mem_type_name(a.type), n->dev);
}

/* The polling loop. Returns 0 once the communicator has no NCCL call in
 * progress and, if `stream`, our stream has drained; otherwise the first
 * of: an NCCL asynchronous error (SP_ENCCL), a CUDA error (SP_ECUDA), the
 * abort flag or cancel() (SP_ECANCELED), the deadline (SP_ETIMEDOUT).
 * The stream is queried only when NCCL reports no call in progress, as the
 * non-blocking API requires. A few hundred microseconds of tight polling
 * keep small collectives fast; after that the sleep doubles up to 1 ms, so
 * a long wait costs little CPU and an abort is seen within a millisecond. */
static int nc_wait(nccl_impl *n, bool stream, uint64_t deadline,
                   bool (*cancel)(void *), void *cancel_user, const char *what,
                   sp_diag *d) {
  long nap = 0;
  for (unsigned polls = 0;; polls++) {
    ncclResult_t ae = ncclSuccess;
    int rc = SP_NCCL_CALL(d, ncclCommGetAsyncError(n->comm, &ae));
    if (rc < 0) return rc;
    if (ae != ncclSuccess && ae != ncclInProgress)
      return nc_nccl_fail(d, ae, what, __FILE__, __LINE__);
    if (ae == ncclSuccess) {
      if (!stream) return 0;
      cudaError_t ce = cudaStreamQuery(n->stream);
      if (ce == cudaSuccess) return 0;
      if (ce != cudaErrorNotReady) return NC_CUDA_CALL(d, ce);
    }
    if (atomic_load(&n->abort_req))
      return sp_diag_set(d, SP_ECANCELED, "%s: aborted (sp_comm_abort)", what);
    if (cancel != NULL && cancel(cancel_user))
      return sp_diag_set(d, SP_ECANCELED, "%s: cancelled (opts.cancel)", what);
    if (now_ms() >= deadline)
      return sp_diag_set(d, SP_ETIMEDOUT, "%s did not complete within %llu ms",
                         what, (unsigned long long)n->timeout_ms);
    if (polls < 256) continue;
    nap = nap == 0 ? 10000 : (nap * 2 > 1000000 ? 1000000 : nap * 2);
    sleep_ns(nap);
  }
}

/* Appends to the diagnostic (truncating), keeping what is there. */
static void diag_append(sp_diag *d, const char *s) {
  size_t len = strnlen(d->msg, sizeof d->msg);
  if (len + 1 < sizeof d->msg)
    snprintf(d->msg + len, sizeof d->msg - len, "%s", s);
}

/* Aborts the NCCL communicator (NCCL stops its kernels) and waits, bounded
 * by the communicator's timeout (at least 1 s, at most 60 s), for our
 * stream to drain, so that no transfer can still write into the caller's
 * buffers once the failed call returns. Work the caller put on the stream
 * can keep it busy; then the diagnostic says so. */
static void nc_kill(nccl_impl *n, sp_diag *d) {
  if (n->comm != NULL) {
    ncclResult_t r = ncclCommAbort(n->comm);
    n->comm = NULL;
    if (r != ncclSuccess) {
      char buf[160];
      snprintf(buf, sizeof buf, "; ncclCommAbort: %s", ncclGetErrorString(r));
      diag_append(d, buf);
    }
  } else if (!n->undrained && cudaStreamQuery(n->stream) == cudaSuccess) {
    return;
  }
  uint64_t bound = n->timeout_ms < 1000 ? 1000 : n->timeout_ms;
  if (bound > 60000) bound = 60000;
  uint64_t deadline = now_ms() + bound;
  for (;;) {
    cudaError_t e = cudaStreamQuery(n->stream);
    if (e == cudaSuccess) {
      n->undrained = false;
      return;
    }
    if (e != cudaErrorNotReady) {
      (void)cudaGetLastError();
      char buf[200];
      snprintf(buf, sizeof buf, "; then the stream failed: %s",
               cudaGetErrorString(e));
      diag_append(d, buf);
      return;
    }
    if (now_ms() >= deadline) break;
    sleep_ns(1000000);
  }
  n->undrained = true;
  diag_append(d,
              "; the communicator's stream still has work queued after "
              "the abort, so the buffers may still be accessed");
}

static int nc_set_device(const nccl_impl *n, sp_diag *d) {
  int cur = -1;
  int rc = NC_CUDA_CALL(d, cudaGetDevice(&cur));
  if (rc == 0 && cur != n->dev) rc = NC_CUDA_CALL(d, cudaSetDevice(n->dev));
  return rc;
}

/* Before an operation: not dead, not aborted, device current. */
static int nc_begin(nccl_impl *n, sp_diag *d) {
  if (n->comm == NULL)
    return sp_diag_set(d, SP_ECANCELED, "the NCCL communicator was aborted");
  if (atomic_load(&n->abort_req))
    return sp_diag_set(d, SP_ECANCELED, "aborted");
  return nc_set_device(n, d);
}

/* After enqueueing (rc: the result of the checks and the NCCL call): waits
 * for completion, or kills the communicator on any failure. */
static int nc_finish(nccl_impl *n, int rc, const char *what, sp_diag *d) {
  if (rc == 0)
    rc = nc_wait(n, true, now_ms() + n->timeout_ms, NULL, NULL, what, d);
  if (rc < 0) {
    if (rc == SP_ETIMEDOUT)
      diag_append(d,
                  "; the NCCL communicator was aborted (are all members "
                  "issuing the same collectives?)");
    nc_kill(n, d);
  }
  return rc;
}

static int nc_dtype(sp_dtype dt, ncclDataType_t *out) {
  switch (dt) {
    case SP_FLOAT32: *out = ncclFloat32; return 0;
    case SP_FLOAT64: *out = ncclFloat64; return 0;
    case SP_FLOAT16: *out = ncclFloat16; return 0;
    case SP_BFLOAT16: *out = ncclBfloat16; return 0;
    case SP_INT32: *out = ncclInt32; return 0;
    case SP_INT64: *out = ncclInt64; return 0;
    default: return -1;
  }
}

/* ---- lifetime ------------------------------------------------------------ */

static void nc_release(nccl_impl *n) {
  /* cudaFree synchronizes the device; with work stuck on our stream it
   * would hang, so the scratch ints are leaked then (8 bytes). */
  if (n->scratch != NULL && !n->undrained) (void)cudaFree(n->scratch);
  if (n->stream != NULL) (void)cudaStreamDestroy(n->stream);
  (void)cudaGetLastError();
  free(n);
}

/* Rank 0's id, or the others' wait for it. The wait is cut into slices of
 * at most 100 ms so that cancel() is honoured while the store blocks. */
static int nc_exchange_id(const sp_comm_info *info, const sp_comm_store *st,
                          uint64_t deadline, ncclUniqueId *id, sp_diag *d) {
  char key[SP_COMM_MAX_PREFIX + 16];
  snprintf(key, sizeof key, "%s/nccl_id", info->prefix);
  if (info->rank == 0) {
    /* The id holds the address of a bootstrap socket this process now
     * listens on; it lives until the other members have initialised. */
    SP_NCCL_CHECK(d, ncclGetUniqueId(id));
    if (st == NULL || st->set == NULL) return 0; /* a single member */
    return st->set(st->user, key, id, sizeof *id, d);
  }
  for (;;) {
    if (info->cancel != NULL && info->cancel(info->cancel_user))
      return sp_diag_set(d, SP_ECANCELED,
                         "cancelled while waiting for '%s' from rank 0", key);
    uint64_t now = now_ms();
    if (now >= deadline)
      return sp_diag_set(d, SP_ETIMEDOUT,
                         "rank 0 did not publish '%s' within %llu ms", key,
                         (unsigned long long)info->timeout_ms);
    uint64_t slice = deadline - now < 100 ? deadline - now : 100;
    uint8_t *v = NULL;
    size_t len = 0;
    int rc = st->get(st->user, key, slice, &v, &len, d);
    if (rc == SP_ETIMEDOUT) {
      free(v);
      continue;
    }
    if (rc < 0) {
      free(v);
      return rc;
    }
    if (v == NULL || len != sizeof *id) {
      free(v);
      return sp_diag_set(d, SP_EFORMAT,
                         "'%s' holds %zu bytes, not an NCCL unique id (%zu)",
                         key, len, sizeof *id);
    }
    memcpy(id, v, sizeof *id);
    free(v);
    return 0;
  }
}

static int nc_create(const sp_comm_info *info, const sp_comm_store *store,
                     void **impl, sp_diag *d) {
  *impl = NULL;
  int dev = -1;
  /* The device string first, before any CUDA call or store access. */
  if (parse_device(info->device, &dev) != 0)
    return sp_diag_set(d, SP_EINVAL,
                       "device '%s' is not \"cuda:N\" (the NCCL backend needs "
                       "opts.device naming its GPU)",
                       info->device != NULL ? info->device : "(none)");
  int ndev = 0;
  int rc = sp_cuda_device_count(&ndev);
  if (rc < 0)
    return sp_diag_set(d, rc, "cannot count CUDA devices (%s)",
                       sp_strerror(rc));
  if (dev >= ndev)
    return sp_diag_set(d, SP_ENODEV,
                       "device %s does not exist: %d CUDA device%s visible%s",
                       info->device, ndev, ndev == 1 ? "" : "s",
                       ndev == 0 ? " (no GPU or no driver)" : "");
  int ver = 0;
  SP_NCCL_CHECK(d, ncclGetVersion(&ver));
  if (ver < NCCL_VERSION(2, 14, 0))
    return sp_diag_set(d, SP_EUNSUPPORTED,
                       "NCCL %d found at run time; 2.14 or newer is needed "
                       "(non-blocking init, finalize)",
                       ver);

  uint64_t deadline = now_ms() + info->timeout_ms;
  nccl_impl *n = calloc(1, sizeof *n);
  if (n == NULL) return sp_diag_set(d, SP_ENOMEM, "out of memory");
  n->dev = dev;
  n->rank = info->rank;
  n->size = info->size;
  n->timeout_ms = info->timeout_ms;
  atomic_init(&n->abort_req, false);

  /* NCCL requires the device to be current for init; it stays current on
   * this thread, which is what a worker with --device cuda:N wants. */
  rc = NC_CUDA_CALL(d, cudaSetDevice(dev));
  /* Non-blocking with respect to the legacy default stream: no implicit
   * synchronization with unrelated work; ordering is by events. */
  if (rc == 0)
    rc = NC_CUDA_CALL(
        d, cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking));
  if (rc == 0)
    rc = NC_CUDA_CALL(d, cudaMalloc((void **)&n->scratch, 2 * sizeof(int32_t)));
  /* On our stream, then waited for: a memset on the legacy stream would not
   * be ordered before work on a non-blocking stream. */
  if (rc == 0)
    rc = NC_CUDA_CALL(
        d, cudaMemsetAsync(n->scratch, 0, 2 * sizeof(int32_t), n->stream));
  if (rc == 0) rc = NC_CUDA_CALL(d, cudaStreamSynchronize(n->stream));
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  if (rc == 0) rc = nc_exchange_id(info, store, deadline, &id, d);
  if (rc == 0) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    /* Shows in NCCL's own logs (NCCL_DEBUG=INFO); the prefix outlives the
     * communicator. */
    cfg.commName = info->prefix;
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&comm, (int)info->size, id,
                                            (int)info->rank, &cfg);
    n->comm = comm;
    rc = SP_NCCL_CALL(d, r);
    if (rc == 0 && comm == NULL)
      rc = sp_diag_set(d, SP_ENCCL, "ncclCommInitRankConfig gave no comm");
    if (rc == 0) {
      char what[96];
      snprintf(what, sizeof what, "NCCL init of rank %u of %u on cuda:%d",
               info->rank, info->size, dev);
      rc =
          nc_wait(n, false, deadline, info->cancel, info->cancel_user, what, d);
      if (rc == SP_ETIMEDOUT)
        diag_append(d, " (are all members up, each on its own GPU?)");
    }
  }
  if (rc < 0) {
    if (n->comm != NULL) {
      (void)ncclCommAbort(n->comm);
      n->comm = NULL;
    }
    nc_release(n);
    return rc;
  }
  *impl = n;
  return 0;
}

/* Finalize (flushes, and waits for the other members to finalize too), then
 * destroy; abort instead when the communicator was aborted or finalize
 * fails or outlives the timeout. */
static void nc_destroy(void *impl) {
  nccl_impl *n = impl;
  if (n == NULL) return;
  sp_diag d = {{0}};
  (void)nc_set_device(n, &d);
  if (n->comm != NULL) {
    bool ok = false;
    if (!atomic_load(&n->abort_req) &&
        SP_NCCL_CALL(&d, ncclCommFinalize(n->comm)) == 0)
      ok = nc_wait(n, false, now_ms() + n->timeout_ms, NULL, NULL,
                   "ncclCommFinalize", &d) == 0;
    if (ok && SP_NCCL_CALL(&d, ncclCommDestroy(n->comm)) == 0)
      n->comm = NULL;
    else
      nc_kill(n, &d);
  }
  nc_release(n);
}

/* ---- operations ---------------------------------------------------------- */

static int nc_all_gather(void *impl, const void *send, void *recv,
                         size_t nbytes, sp_diag *d) {
  nccl_impl *n = impl;
  int rc = nc_begin(n, d);
  if (rc == 0) rc = nc_check_buffer(n, send, "send", d);
  if (rc == 0) rc = nc_check_buffer(n, recv, "recv", d);
  /* Pure data movement: bytes, whatever the dtype (NCCL counts elements;
   * here an element is a byte). */
  if (rc == 0)
    rc = SP_NCCL_CALL(
        d, ncclAllGather(send, recv, nbytes, ncclUint8, n->comm, n->stream));
  return nc_finish(n, rc, "ncclAllGather", d);
}

static int nc_reduce_scatter(void *impl, const void *send, void *recv,
                             size_t count, sp_dtype dt, sp_diag *d) {
  nccl_impl *n = impl;
  ncclDataType_t t;
  if (nc_dtype(dt, &t) != 0)
    return sp_diag_set(d, SP_EINVAL, "NCCL has no sum for %s",
                       sp_dtype_name(dt));
  int rc = nc_begin(n, d);
  if (rc == 0) rc = nc_check_buffer(n, send, "send", d);
  if (rc == 0) rc = nc_check_buffer(n, recv, "recv", d);
  if (rc == 0)
    rc = SP_NCCL_CALL(d, ncclReduceScatter(send, recv, count, t, ncclSum,
                                           n->comm, n->stream));
  return nc_finish(n, rc, "ncclReduceScatter", d);
}

static int nc_all_reduce(void *impl, void *buf, size_t count, sp_dtype dt,
                         sp_diag *d) {
  nccl_impl *n = impl;
  ncclDataType_t t;
  if (nc_dtype(dt, &t) != 0)
    return sp_diag_set(d, SP_EINVAL, "NCCL has no sum for %s",
                       sp_dtype_name(dt));
  int rc = nc_begin(n, d);
  if (rc == 0) rc = nc_check_buffer(n, buf, "buf", d);
  if (rc == 0)
    rc = SP_NCCL_CALL(
        d, ncclAllReduce(buf, buf, count, t, ncclSum, n->comm, n->stream));
  return nc_finish(n, rc, "ncclAllReduce", d);
}

static int nc_broadcast(void *impl, void *buf, size_t nbytes, uint32_t root,
                        sp_diag *d) {
  nccl_impl *n = impl;
  int rc = nc_begin(n, d);
  if (rc == 0) rc = nc_check_buffer(n, buf, "buf", d);
  if (rc == 0)
    rc = SP_NCCL_CALL(d, ncclBroadcast(buf, buf, nbytes, ncclUint8, (int)root,
                                       n->comm, n->stream));
  return nc_finish(n, rc, "ncclBroadcast", d);
}

/* An all-reduce of one int on the device: it completes on a member only
 * after every member has entered it. */
static int nc_barrier(void *impl, sp_diag *d) {
  nccl_impl *n = impl;
  int rc = nc_begin(n, d);
  if (rc == 0)
    rc = SP_NCCL_CALL(d, ncclAllReduce(n->scratch, n->scratch + 1, 1, ncclInt32,
                                       ncclSum, n->comm, n->stream));
  return nc_finish(n, rc, "barrier (ncclAllReduce of one int)", d);
}

/* Any thread: only a flag; the polling thread (or nc_destroy) calls
 * ncclCommAbort. */
static void nc_abort(void *impl) {
  nccl_impl *n = impl;
  atomic_store(&n->abort_req, true);
}

static void *nc_cuda_stream(void *impl) {
  const nccl_impl *n = impl;
  return (void *)n->stream;
}

static const sp_comm_backend nccl_backend = {
    .name = "nccl",
    .create = nc_create,
    .destroy = nc_destroy,
    .all_gather = nc_all_gather,
    .reduce_scatter = nc_reduce_scatter,
    .all_reduce = nc_all_reduce,
    .broadcast = nc_broadcast,
    .barrier = nc_barrier,
    .abort = nc_abort,
    .cuda_stream = nc_cuda_stream,
    .device_buffers = 1,
};

const sp_comm_backend *sp_comm_nccl_backend(void) { return &nccl_backend; }
