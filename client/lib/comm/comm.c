/* Communicators: the backend-independent half of sp_comm (shardplane.h).
 *
 * Every operation goes through the same gate, in a fixed order: the handle,
 * the abort flag, the broken state, the dtype, the sizes (checked for
 * overflow before anything is allocated), the pointers. Only then does a
 * backend see the call, so a backend never validates and never has to
 * format the communicator's name into its messages.
 *
 * A communicator whose operation failed (peer lost, timeout) is broken for
 * good: Gloo closes every connection when a transfer fails (the transport is
 * in an unknown state, and closing is what guarantees no late transfer can
 * write into a buffer the caller has freed), so later operations return the
 * first failure at once instead of hanging on dead sockets.
 */
#include "comm_internal.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_sum.h"

struct sp_comm {
  const sp_comm_backend *be; /* NULL for a single member: no network */
  void *impl;
  char *prefix;
  uint32_t rank;
  uint32_t size;
  uint64_t timeout_ms;
  sp_comm_store store;
  /* Written by sp_comm_abort from any thread, read before every operation;
   * the backend keeps its own flag for waking a blocked transfer. */
  atomic_bool aborted;
  /* Only the operating thread touches these. */
  int broken;
  char broken_msg[SP_DIAG_MAX];
};

/* ---- lifetime ----------------------------------------------------------- */

static char *dup_str(const char *s) {
  size_t n = strlen(s);
  char *p = malloc(n + 1);
  if (p != NULL) memcpy(p, s, n + 1);
  return p;
}

int sp_comm_new(const sp_comm_opts *opts, sp_comm **out, sp_diag *d) {
  if (out != NULL) *out = NULL;
  if (opts == NULL || out == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_comm_new: opts and out are required");
  if (opts->size == 0 || opts->size > SP_COMM_MAX_SIZE)
    return sp_diag_set(d, SP_EINVAL, "sp_comm_new: size %u out of range 1..%u",
                       opts->size, SP_COMM_MAX_SIZE);
  if (opts->rank >= opts->size)
    return sp_diag_set(d, SP_EINVAL, "sp_comm_new: rank %u not below size %u",
                       opts->rank, opts->size);
  const sp_comm_backend *be = NULL;
  switch (opts->backend) {
    case SP_BACKEND_GLOO: be = sp_comm_gloo_backend(); break;
    case SP_BACKEND_NCCL:
#if SHARDPLANE_HAVE_NCCL
      be = sp_comm_nccl_backend();
      break;
#else
      return sp_diag_set(d, SP_EUNSUPPORTED,
                         "sp_comm_new: the NCCL backend is not built into this "
                         "library (it needs CUDA and NCCL at configure time)");
#endif
    default:
      return sp_diag_set(d, SP_EINVAL, "sp_comm_new: unknown backend %d",
                         (int)opts->backend);
  }
  /* A single member never talks to anyone, so it needs neither a store nor
   * a namespace in it (an NCCL one publishes its id only if there is a
   * store, and nobody reads it). */
  const char *prefix = opts->prefix;
  if (opts->size > 1) {
    if (prefix == NULL || prefix[0] == '\0')
      return sp_diag_set(d, SP_EINVAL,
                         "sp_comm_new: rank %u/%u: a store prefix is required",
                         opts->rank, opts->size);
    if (opts->store.set == NULL || opts->store.get == NULL)
      return sp_diag_set(d, SP_EINVAL,
                         "sp_comm_new: comm '%s' rank %u/%u: store set and get "
                         "are required",
                         prefix, opts->rank, opts->size);
  }
  if (prefix == NULL || prefix[0] == '\0') prefix = "local";
  if (strlen(prefix) > SP_COMM_MAX_PREFIX)
    return sp_diag_set(d, SP_EINVAL,
                       "sp_comm_new: store prefix longer than %u bytes",
                       SP_COMM_MAX_PREFIX);
  uint64_t timeout_ms = opts->timeout_ms;
  if (timeout_ms == 0) timeout_ms = SP_COMM_DEFAULT_TIMEOUT_MS;
  if (timeout_ms > SP_COMM_MAX_TIMEOUT_MS) timeout_ms = SP_COMM_MAX_TIMEOUT_MS;

  sp_comm *c = calloc(1, sizeof *c);
  if (c == NULL) return sp_diag_set(d, SP_ENOMEM, "sp_comm_new: out of memory");
  c->prefix = dup_str(prefix);
  if (c->prefix == NULL) {
    free(c);
    return sp_diag_set(d, SP_ENOMEM, "sp_comm_new: out of memory");
  }
  c->rank = opts->rank;
  c->size = opts->size;
  c->timeout_ms = timeout_ms;
  c->store = opts->store;
  atomic_init(&c->aborted, false);

  /* Device buffers can never be handled by the host path below (a device
   * pointer must not be memcpy'd on the host), so such a backend serves a
   * single member too; NCCL supports one rank. */
  if (c->size > 1 || be->device_buffers) {
    sp_comm_info info = {.prefix = c->prefix,
                         .rank = c->rank,
                         .size = c->size,
                         .timeout_ms = timeout_ms,
                         .device = opts->device,
                         .host = opts->host,
                         .cancel = opts->cancel,
                         .cancel_user = opts->cancel_user};
    sp_diag local = {{0}};
    int rc = be->create(&info, &opts->store, &c->impl, &local);
    if (rc < 0) {
      sp_diag_set(d, rc, "comm '%s' rank %u/%u (%s): rendezvous: %s", c->prefix,
                  c->rank, c->size, be->name, local.msg);
      free(c->prefix);
      free(c);
      return rc;
    }
    c->be = be;
  }
  *out = c;
  return 0;
}

/* Every member counts itself out through the store; the last one releases
 * the others: three store calls a member, whatever the size. The wait is
 * cut into slices so that an abort (a peer lost meanwhile) ends it. */
int sp_comm_leave(sp_comm *c, sp_diag *d) {
  if (c == NULL) return sp_diag_set(d, SP_EINVAL, "sp_comm_leave: NULL");
  if (c->size == 1 || c->be == NULL || c->broken != 0 ||
      atomic_load(&c->aborted))
    return 0;
  if (c->store.add == NULL)
    return sp_diag_set(d, SP_EUNSUPPORTED, "comm '%s': the store has no add",
                       c->prefix);
  char key[SP_COMM_MAX_PREFIX + 16];
  int64_t n = 0;
  snprintf(key, sizeof key, "%s/leaving", c->prefix);
  int rc = c->store.add(c->store.user, key, 1, &n, d);
  if (rc < 0) return rc;
  snprintf(key, sizeof key, "%s/left", c->prefix);
  if (n == (int64_t)c->size) return c->store.set(c->store.user, key, "1", 1, d);
  for (uint64_t waited = 0; waited < c->timeout_ms; waited += 100) {
    if (atomic_load(&c->aborted))
      return sp_diag_set(d, SP_ECANCELED,
                         "comm '%s' rank %u/%u: aborted "
                         "while leaving",
                         c->prefix, c->rank, c->size);
    uint8_t *v = NULL;
    size_t len = 0;
    rc = c->store.get(c->store.user, key, 100, &v, &len, d);
    free(v);
    if (rc != SP_ETIMEDOUT) return rc;
  }
  return sp_diag_set(d, SP_ETIMEDOUT,
                     "comm '%s' rank %u/%u: the other "
                     "members did not all leave within %llu ms",
                     c->prefix, c->rank, c->size,
                     (unsigned long long)c->timeout_ms);
}

void sp_comm_free(sp_comm *c) {
  if (c == NULL) return;
  if (c->be != NULL) c->be->destroy(c->impl);
  free(c->prefix);
  free(c);
}

int sp_comm_cuda_stream(sp_comm *c, void **stream) {
  if (stream != NULL) *stream = NULL;
  if (c == NULL || stream == NULL) return SP_EINVAL;
  if (c->be == NULL || c->be->cuda_stream == NULL) return SP_EUNSUPPORTED;
  *stream = c->be->cuda_stream(c->impl);
  return *stream != NULL ? 0 : SP_EUNSUPPORTED;
}

uint32_t sp_comm_rank(const sp_comm *c) { return c != NULL ? c->rank : 0; }
uint32_t sp_comm_size(const sp_comm *c) { return c != NULL ? c->size : 0; }

void sp_comm_abort(sp_comm *c) {
  if (c == NULL) return;
  atomic_store(&c->aborted, true);
  if (c->be != NULL) c->be->abort(c->impl);
}

/* ---- the operation gate ------------------------------------------------- */

static const char *op_name(sp_coll_op op) {
  switch (op) {
    case SP_OP_ALL_GATHER: return "all_gather";
    case SP_OP_REDUCE_SCATTER: return "reduce_scatter";
    case SP_OP_ALL_REDUCE: return "all_reduce";
    case SP_OP_BROADCAST: return "broadcast";
    case SP_OP_BARRIER: return "barrier";
  }
  return "?";
}

/* The checks every operation shares. members is how many count-element
 * blocks the largest buffer holds: size for all_gather and reduce_scatter
 * (size * count elements), 1 for all_reduce and broadcast. On success
 * *nbytes is count * element size. */
static int comm_gate(sp_comm *c, sp_coll_op op, size_t count, sp_dtype dt,
                     uint32_t members, bool sum, size_t *nbytes, sp_diag *d) {
  const char *name = op_name(op);
  if (c == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_comm_%s: communicator is NULL", name);
  if (atomic_load(&c->aborted))
    return sp_diag_set(d, SP_ECANCELED,
                       "comm '%s' rank %u/%u %s: communicator was aborted",
                       c->prefix, c->rank, c->size, name);
  if (c->broken != 0)
    return sp_diag_set(d, c->broken,
                       "comm '%s' rank %u/%u %s: communicator is broken by an "
                       "earlier failure: %s",
                       c->prefix, c->rank, c->size, name, c->broken_msg);
  if (op == SP_OP_BARRIER) return 0;
  if (!sp_dtype_valid(dt))
    return sp_diag_set(d, SP_EINVAL,
                       "comm '%s' rank %u/%u %s: invalid dtype %d", c->prefix,
                       c->rank, c->size, name, (int)dt);
  if (sum && !sp_comm_dtype_summable(dt))
    return sp_diag_set(d, SP_EINVAL,
                       "comm '%s' rank %u/%u %s: no sum for dtype %s (float32, "
                       "float64, bfloat16, float16, int64, int32 have one)",
                       c->prefix, c->rank, c->size, name, sp_dtype_name(dt));
  size_t esz = sp_dtype_size(dt);
  if (count > SIZE_MAX / esz / members)
    return sp_diag_set(d, SP_EINVAL,
                       "comm '%s' rank %u/%u %s: %zu %s elements times %u "
                       "members overflow size_t",
                       c->prefix, c->rank, c->size, name, count,
                       sp_dtype_name(dt), members);
  *nbytes = count * esz;
  return 0;
}

/* Turns a backend failure into the caller's diagnostic and, unless the
 * failure was an abort (the flag already covers later calls), breaks the
 * communicator. */
static int comm_failed(sp_comm *c, sp_coll_op op, int rc, sp_dtype dt,
                       size_t count, const sp_diag *cause, sp_diag *d) {
  if (atomic_load(&c->aborted)) rc = SP_ECANCELED;
  if (rc != SP_ECANCELED && c->broken == 0) {
    c->broken = rc;
    /* truncation is fine for a diagnostic; using the result tells gcc so */
    if (snprintf(c->broken_msg, sizeof c->broken_msg, "%s: %s", op_name(op),
                 cause->msg) < 0)
      c->broken_msg[0] = '\0';
  }
  if (op == SP_OP_BARRIER)
    return sp_diag_set(d, rc, "comm '%s' rank %u/%u barrier: %s", c->prefix,
                       c->rank, c->size, cause->msg);
  return sp_diag_set(d, rc, "comm '%s' rank %u/%u %s(%s, count %zu): %s",
                     c->prefix, c->rank, c->size, op_name(op),
                     sp_dtype_name(dt), count, cause->msg);
}

static int null_buffer(sp_comm *c, sp_coll_op op, sp_diag *d) {
  return sp_diag_set(d, SP_EINVAL,
                     "comm '%s' rank %u/%u %s: NULL buffer with count > 0",
                     c->prefix, c->rank, c->size, op_name(op));
}

int sp_comm_all_gather(sp_comm *c, const void *send, void *recv, size_t count,
                       sp_dtype dt, sp_diag *d) {
  size_t nbytes = 0;
  int rc = comm_gate(c, SP_OP_ALL_GATHER, count, dt, c ? c->size : 1, false,
                     &nbytes, d);
  if (rc < 0) return rc;
  if (count == 0) return 0;
  if (send == NULL || recv == NULL) return null_buffer(c, SP_OP_ALL_GATHER, d);
  if (c->be == NULL) {
    /* memmove: send may be recv itself (rank 0 of 1). */
    memmove(recv, send, nbytes);
    return 0;
  }
  sp_diag cause = {{0}};
  rc = c->be->all_gather(c->impl, send, recv, nbytes, &cause);
  if (rc < 0) return comm_failed(c, SP_OP_ALL_GATHER, rc, dt, count, &cause, d);
  return 0;
}

int sp_comm_reduce_scatter(sp_comm *c, const void *send, void *recv,
                           size_t count, sp_dtype dt, sp_diag *d) {
  size_t nbytes = 0;
  int rc = comm_gate(c, SP_OP_REDUCE_SCATTER, count, dt, c ? c->size : 1, true,
                     &nbytes, d);
  if (rc < 0) return rc;
  if (count == 0) return 0;
  if (send == NULL || recv == NULL)
    return null_buffer(c, SP_OP_REDUCE_SCATTER, d);
  if (c->be == NULL) {
    /* The sum over one member, through the same code as for many, so a
     * size-1 group rounds exactly like a larger one would. */
    const void *blocks[1] = {send};
    return sp_comm_sum_blocks(recv, blocks, 1, count, dt);
  }
  sp_diag cause = {{0}};
  rc = c->be->reduce_scatter(c->impl, send, recv, count, dt, &cause);
  if (rc < 0)
    return comm_failed(c, SP_OP_REDUCE_SCATTER, rc, dt, count, &cause, d);
  return 0;
}

int sp_comm_all_reduce(sp_comm *c, void *buf, size_t count, sp_dtype dt,
                       sp_diag *d) {
  size_t nbytes = 0;
  int rc = comm_gate(c, SP_OP_ALL_REDUCE, count, dt, 1, true, &nbytes, d);
  if (rc < 0) return rc;
  if (count == 0) return 0;
  if (buf == NULL) return null_buffer(c, SP_OP_ALL_REDUCE, d);
  if (c->be == NULL) {
    const void *blocks[1] = {buf};
    return sp_comm_sum_blocks(buf, blocks, 1, count, dt);
  }
  sp_diag cause = {{0}};
  rc = c->be->all_reduce(c->impl, buf, count, dt, &cause);
  if (rc < 0) return comm_failed(c, SP_OP_ALL_REDUCE, rc, dt, count, &cause, d);
  return 0;
}

int sp_comm_broadcast(sp_comm *c, void *buf, size_t count, sp_dtype dt,
                      uint32_t root, sp_diag *d) {
  size_t nbytes = 0;
  int rc = comm_gate(c, SP_OP_BROADCAST, count, dt, 1, false, &nbytes, d);
  if (rc < 0) return rc;
  if (root >= c->size)
    return sp_diag_set(d, SP_EINVAL,
                       "comm '%s' rank %u/%u broadcast: root %u not below size "
                       "%u",
                       c->prefix, c->rank, c->size, root, c->size);
  if (count == 0) return 0;
  if (buf == NULL) return null_buffer(c, SP_OP_BROADCAST, d);
  if (c->be == NULL) return 0;
  sp_diag cause = {{0}};
  rc = c->be->broadcast(c->impl, buf, nbytes, root, &cause);
  if (rc < 0) return comm_failed(c, SP_OP_BROADCAST, rc, dt, count, &cause, d);
  return 0;
}

int sp_comm_barrier(sp_comm *c, sp_diag *d) {
  size_t nbytes = 0;
  int rc =
      comm_gate(c, SP_OP_BARRIER, 0, SP_DTYPE_INVALID, 1, false, &nbytes, d);
  if (rc < 0) return rc;
  if (c->be == NULL) return 0;
  sp_diag cause = {{0}};
  rc = c->be->barrier(c->impl, &cause);
  if (rc < 0)
    return comm_failed(c, SP_OP_BARRIER, rc, SP_DTYPE_INVALID, 0, &cause, d);
  return 0;
}
