/* The FSDP runtime: flat-parameter shards, unshard / reshard, gradient
 * reduction per unit in the schedule of the job's strategy
 * (../shared/reference/fsdp-semantics.md §4-6).
 *
 * Collectives run on one communication thread in issue order. Every rank
 * issues the same collectives in the same order (the schedule is a pure
 * function of the plan), which is what the backends require; the thread
 * lets an all-gather issued as a prefetch overlap the caller's compute, as
 * FSDP's unshard stream does on a GPU.
 *
 * Storage is reached only through a memory-ops table (fsdp_internal.h):
 * host memory here, device memory in fsdp_cuda.c, where the thread's work
 * goes on a comm stream ordered after the compute stream with events. The
 * schedule below is the same for both. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cast.h"
#include "fsdp_internal.h"

/* ---- helpers ---- */

static void *xcalloc(size_t n, size_t size) {
  if (n == 0 || size == 0) return calloc(1, 1);
  if (n > SIZE_MAX / size) return NULL;
  return calloc(n, size);
}

/* FSDP's gradient divide factors (_get_gradient_predivide_factor): the
 * gradient is divided by pre before the collective and by post after, so
 * neither the sum nor the quotient overflows in low precision. */
static void divide_factors(uint32_t world, double *pre, double *post) {
  uint32_t p = 1;
  while (world % p == 0 && world / p > p) p *= 2;
  *pre = p;
  *post = (double)world / p;
}

/* A unit's name in messages: its module FQN, "root" for the root. */
static const char *unit_name(const sp_fsdp *f, uint32_t unit) {
  const char *fqn = sp_plan_unit_fqn(f->plan, unit);
  return fqn && *fqn ? fqn : "root";
}

static int transition(sp_fsdp *f, sp_machine m, uint32_t unit, int to,
                      sp_diag *d) {
  int rc = sp_session_transition(f->s, m, unit, to, d);
  if (rc < 0)
    sp_diag_prefix(d, rc, "unit %u (%s)", unit, unit_name(f, unit));
  return rc;
}

/* Scales n elements of dtype dt in place by 1/div (exact rounding of the
 * quotient to dt: computed in double, rounded once). */
static int scale_div(void *buf, sp_dtype dt, size_t n, double div,
                     float *tmp) {
  if (div == 1.0 || n == 0) return 0;
  if (dt == SP_FLOAT32) {
    float *p = buf;
    for (size_t i = 0; i < n; i++) p[i] = (float)((double)p[i] / div);
    return 0;
  }
  if (dt == SP_FLOAT64) {
    double *p = buf;
    for (size_t i = 0; i < n; i++) p[i] /= div;
    return 0;
  }
  /* low precision: via float32, whose quotient rounds to the same value
   * as the exact one for the power-of-two and small factors used here
   * except in rare double-rounding ties; FSDP divides in the low dtype
   * directly, which rounds once as well. */
  int rc = sp_cast(tmp, SP_FLOAT32, buf, dt, n);
  if (rc < 0) return rc;
  for (size_t i = 0; i < n; i++) tmp[i] = (float)((double)tmp[i] / div);
  return sp_cast(buf, dt, tmp, SP_FLOAT32, n);
}

/* ---- host storage: the memory-ops table for "cpu" ---- */

static int host_alloc(sp_fsdp *f, size_t n, size_t esize, void **out,
                      sp_diag *d) {
  (void)f;
  if (esize && n > SIZE_MAX / esize)
    return sp_diag_set(d, SP_ETOOBIG, "%zu elements of %zu bytes overflow",
                       n, esize);
  *out = xcalloc(n, esize);
  if (!*out)
    return sp_diag_set(d, SP_ENOMEM, "no memory for %zu elements of %zu "
                       "bytes", n, esize);
  return 0;
}

static void host_release(sp_fsdp *f, void *p) {
  (void)f;
  free(p);
}

static int host_zero(sp_fsdp *f, sp_fsdp_lane l, void *p, size_t bytes,
                     sp_diag *d) {
  (void)f, (void)l, (void)d;
  memset(p, 0, bytes);
  return 0;
}

static int host_copy(sp_fsdp *f, sp_fsdp_lane l, void *dst, const void *src,
                     size_t bytes, sp_diag *d) {
  (void)f, (void)l, (void)d;
  if (dst != src) memcpy(dst, src, bytes);
  return 0;
}

static int host_cast(sp_fsdp *f, sp_fsdp_lane l, void *dst, sp_dtype dt,
                     const void *src, sp_dtype st, size_t n, sp_diag *d) {
  (void)f, (void)l;
  int rc = sp_cast(dst, dt, src, st, n);
  if (rc < 0)
    return sp_diag_set(d, rc, "casting %s to %s", sp_dtype_name(st),
                       sp_dtype_name(dt));
  return 0;
}

static int host_scale_div(sp_fsdp *f, sp_fsdp_lane l, void *buf, sp_dtype dt,
                          size_t n, double div, sp_diag *d) {
  (void)l;
  int rc = scale_div(buf, dt, n, div, f->host_tmp);
  if (rc < 0)
    return sp_diag_set(d, rc, "dividing %s gradients by %g",
                       sp_dtype_name(dt), div);
  return 0;
}

static int host_cast_div(sp_fsdp *f, sp_fsdp_lane l, void *dst, sp_dtype dt,
                         void *src, sp_dtype st, size_t n, double div,
                         sp_diag *d) {
  int rc = host_scale_div(f, l, src, st, n, div, d);
  return rc < 0 ? rc : host_cast(f, l, dst, dt, src, st, n, d);
}

/* p -= lr * g, computed in double and rounded once to the master dtype, as
 * the reference trainer does; then zero_grad. */
static int host_sgd(sp_fsdp *f, void *shard, sp_dtype pdt, void *grad,
                    sp_dtype gdt, size_t c, double lr, sp_diag *d) {
  (void)f;
  double *p = xcalloc(c, sizeof(double)), *g = xcalloc(c, sizeof(double));
  int rc = p && g ? 0 : SP_ENOMEM;
  if (rc == 0) rc = sp_cast(p, SP_FLOAT64, shard, pdt, c);
  if (rc == 0) rc = sp_cast(g, SP_FLOAT64, grad, gdt, c);
  if (rc == 0) {
    for (size_t i = 0; i < c; i++) p[i] -= lr * g[i];
    rc = sp_cast(shard, pdt, p, SP_FLOAT64, c);
    /* zero_grad: a unit that gets no gradient next step must not be
     * moved again by this one */
    memset(grad, 0, c * sp_dtype_size(gdt));
  }
  free(p);
  free(g);
  return rc < 0 ? sp_diag_set(d, rc, "%s", sp_strerror(rc)) : 0;
}

static int host_to_host(sp_fsdp *f, void *host, const void *src,
                        size_t bytes, sp_diag *d) {
  (void)f, (void)d;
  if (host != src) memcpy(host, src, bytes);
  return 0;
}

static int host_from_host(sp_fsdp *f, void *dst, const void *host,
                          size_t bytes, sp_diag *d) {
  (void)f, (void)d;
  if (dst != host) memcpy(dst, host, bytes);
  return 0;
}

static int host_slot_nop(sp_fsdp *f, size_t slot, sp_diag *d) {
  (void)f, (void)slot, (void)d;
  return 0;
}

static int host_drain(sp_fsdp *f, sp_fsdp_lane l, sp_diag *d) {
  (void)f, (void)l, (void)d;
  return 0;
}

static int host_handoff(sp_fsdp *f, void *stream, sp_diag *d) {
  (void)f, (void)stream, (void)d;
  return 0;
}

static void host_destroy(sp_fsdp *f) { (void)f; }

static const sp_fsdp_mem_ops k_host_ops = {
    .name = "cpu",
    .device = false,
    .alloc = host_alloc,
    .release = host_release,
    .zero = host_zero,
    .copy = host_copy,
    .cast = host_cast,
    .scale_div = host_scale_div,
    .cast_div = host_cast_div,
    .sgd = host_sgd,
    .to_host = host_to_host,
    .from_host = host_from_host,
    .mark = host_slot_nop,
    .wait_mark = host_slot_nop,
    .drain = host_drain,
    .handoff = host_handoff,
    .thread_init = NULL,
    .destroy = host_destroy,
};

/* "cpu-staged": host storage that the runtime treats as a device's, so
 * every host access (initialisation, checkpoints, loads) goes through the
 * staging paths a GPU takes, and a machine without one can test them. */
static const sp_fsdp_mem_ops k_staged_ops = {
    .name = "cpu-staged",
    .device = true,
    .alloc = host_alloc,
    .release = host_release,
    .zero = host_zero,
    .copy = host_copy,
    .cast = host_cast,
    .scale_div = host_scale_div,
    .cast_div = host_cast_div,
    .sgd = host_sgd,
    .to_host = host_to_host,
    .from_host = host_from_host,
    .mark = host_slot_nop,
    .wait_mark = host_slot_nop,
    .drain = host_drain,
    .handoff = host_handoff,
    .thread_init = NULL,
    .destroy = host_destroy,
};

static sp_comm *gather_comm(sp_fsdp *f) {
  return f->plan->strategy == SP_HYBRID_SHARD ? f->shard_comm
                                              : f->world_comm;
}

/* ---- collectives on the comm lane ----
 * On the CPU these are the sp_comm calls themselves. On a GPU the
 * communicator runs on a stream of its own (sp_comm_cuda_stream) and
 * returns when its operation has completed on the device; the comm lane's
 * casts issued before must precede it, so an event on the comm lane is
 * handed to that stream first. Later comm-lane work follows the return,
 * hence the completed operation. */

static int handoff(sp_fsdp *f, sp_comm *c, sp_diag *d) {
  if (!f->dev) return 0; /* host storage, staged or not: nothing queued */
  void *stream = NULL;
  int rc = sp_comm_cuda_stream(c, &stream);
  if (rc < 0)
    return sp_diag_set(d, rc, "the communicator has no CUDA stream (not an "
                       "NCCL communicator?)");
  return f->mem->handoff(f, stream, d);
}

static int coll_all_gather(sp_fsdp *f, sp_comm *c, const void *send,
                           void *recv, size_t count, sp_dtype dt,
                           sp_diag *d) {
  int rc = handoff(f, c, d);
  return rc < 0 ? rc : sp_comm_all_gather(c, send, recv, count, dt, d);
}

static int coll_reduce_scatter(sp_fsdp *f, sp_comm *c, const void *send,
                               void *recv, size_t count, sp_dtype dt,
                               sp_diag *d) {
  int rc = handoff(f, c, d);
  return rc < 0 ? rc : sp_comm_reduce_scatter(c, send, recv, count, dt, d);
}

static int coll_all_reduce(sp_fsdp *f, sp_comm *c, void *buf, size_t count,
                           sp_dtype dt, sp_diag *d) {
  int rc = handoff(f, c, d);
  return rc < 0 ? rc : sp_comm_all_reduce(c, buf, count, dt, d);
}

/* ---- the communication thread ---- */

/* On a GPU: the shard cast (or copied) straight into its own slot of the
 * unsharded buffer, then gathered in place (send = recv + rank * c), so
 * mixed precision needs no separate low-precision shard. */
static int run_gather_device(sp_fsdp *f, sp_fsdp_unit *fu, sp_diag *d) {
  const sp_unit *u = fu->u;
  bool no_shard = f->plan->strategy == SP_NO_SHARD;
  sp_comm *c = gather_comm(f);
  size_t slot = no_shard ? 0 : (size_t)sp_comm_rank(c) * (size_t)fu->c;
  uint8_t *dst = fu->full + slot * fu->psize;
  int rc = f->mem->cast(f, SP_LANE_COMM, dst, u->param_dtype, fu->shard,
                        u->dtype, (size_t)fu->c, d);
  if (rc < 0) return sp_diag_prefix(d, rc, "casting the shard to %s",
                                    sp_dtype_name(u->param_dtype));
  if (no_shard) return 0;
  return coll_all_gather(f, c, dst, fu->full, (size_t)fu->c, u->param_dtype,
                         d);
}

static int run_gather(sp_fsdp *f, sp_fsdp_unit *fu, sp_diag *d) {
  if (f->dev) return run_gather_device(f, fu, d);
  const sp_unit *u = fu->u;
  uint8_t *src = fu->shard;
  const sp_fsdp_mem_ops *mem = f->mem;
  if (fu->mp_shard) {
    int rc = mem->cast(f, SP_LANE_COMM, fu->mp_shard, u->param_dtype,
                       fu->shard, u->dtype, (size_t)fu->c, d);
    if (rc < 0) return sp_diag_set(d, rc, "casting the shard to %s",
                                   sp_dtype_name(u->param_dtype));
    src = fu->mp_shard;
  }
  if (f->plan->strategy == SP_NO_SHARD)
    return mem->copy(f, SP_LANE_COMM, fu->full, src,
                     (size_t)fu->c * fu->psize, d);
  return coll_all_gather(f, gather_comm(f), src, fu->full, (size_t)fu->c,
                         u->param_dtype, d);
}

/* The post-backward reduction: FSDP's _post_backward_hook +
 * _reduce_grad / _reduce_grad_no_shard. */
static int run_reduce(sp_fsdp *f, sp_fsdp_unit *fu, sp_diag *d) {
  const sp_unit *u = fu->u;
  const sp_fsdp_mem_ops *mem = f->mem;
  sp_dtype rdt = u->reduce_dtype;
  size_t padded = (size_t)fu->padded;
  uint8_t *in = fu->full_grad;
  int rc;
  if (fu->red_in) {
    rc = mem->cast(f, SP_LANE_COMM, fu->red_in, rdt, fu->full_grad,
                   u->param_dtype, padded, d);
    if (rc < 0) return rc;
    in = fu->red_in;
  }
  rc = mem->scale_div(f, SP_LANE_COMM, in, rdt, padded, f->pre_divide, d);
  if (rc < 0) return rc;
  switch (f->plan->strategy) {
    case SP_NO_SHARD:
      rc = coll_all_reduce(f, f->world_comm, in, padded, rdt, d);
      if (rc == 0)
        rc = mem->copy(f, SP_LANE_COMM, fu->red_out, in,
                       padded * sp_dtype_size(rdt), d);
      if (rc < 0) return rc;
      break;
    case SP_HYBRID_SHARD:
      rc = coll_reduce_scatter(f, f->shard_comm, in, fu->red_out,
                               (size_t)fu->c, rdt, d);
      if (rc == 0 && f->replica_comm && sp_comm_size(f->replica_comm) > 1)
        rc = coll_all_reduce(f, f->replica_comm, fu->red_out, (size_t)fu->c,
                             rdt, d);
      if (rc < 0) return rc;
      break;
    default:
      rc = coll_reduce_scatter(f, f->world_comm, in, fu->red_out,
                               (size_t)fu->c, rdt, d);
      if (rc < 0) return rc;
  }
  /* post-divide and cast to the shard's gradient dtype */
  return mem->cast_div(f, SP_LANE_COMM, fu->shard_grad, fu->grad_dtype,
                       fu->red_out, rdt, (size_t)fu->c, f->post_divide, d);
}

static int run_work(sp_fsdp *f, const sp_fsdp_work *w, sp_diag *d) {
  sp_fsdp_unit *fu = w->kind == SP_WORK_ALL_REDUCE ? NULL : &f->units[w->unit];
  int rc;
  switch (w->kind) {
    case SP_WORK_GATHER:
      rc = run_gather(f, fu, d);
      break;
    case SP_WORK_REDUCE:
      rc = run_reduce(f, fu, d);
      break;
    case SP_WORK_ALL_REDUCE:
      rc = coll_all_reduce(f, f->world_comm, w->buf, w->count, w->dt, d);
      break;
    case SP_WORK_GATHER_MASTER:
      if (f->plan->strategy == SP_NO_SHARD) {
        rc = f->mem->copy(f, SP_LANE_COMM, w->buf, fu->shard,
                          (size_t)fu->c * fu->esize, d);
      } else {
        rc = coll_all_gather(f, gather_comm(f), fu->shard, w->buf,
                             (size_t)fu->c, fu->u->dtype, d);
      }
      break;
    default:
      rc = sp_diag_set(d, SP_EINVAL, "unknown work kind %d", (int)w->kind);
  }
  /* complete means finished on the device: the waiter may use the result
   * on any stream, and the next item may reuse this one's scratch */
  if (rc == 0) rc = f->mem->drain(f, SP_LANE_COMM, d);
  if (rc < 0 && w->kind != SP_WORK_ALL_REDUCE)
    sp_diag_prefix(d, rc, "unit %u (%s)", w->unit, unit_name(f, w->unit));
  return rc;
}

static void *comm_thread(void *arg) {
  sp_fsdp *f = arg;
  float *tmp = NULL;
  sp_diag init_d = {{0}};
  int init_rc = 0;
  if (f->mem->scale_div == host_scale_div) {
    /* scratch for low-precision divides: the largest padded unit */
    size_t scratch = 1;
    for (size_t i = 0; i < f->n_units; i++)
      if ((size_t)f->units[i].padded > scratch)
        scratch = (size_t)f->units[i].padded;
    tmp = malloc(scratch * sizeof(float));
    if (!tmp)
      init_rc = sp_diag_set(&init_d, SP_ENOMEM,
                            "no memory for reduction scratch");
    f->host_tmp = tmp;
  } else if (f->mem->thread_init) {
    init_rc = f->mem->thread_init(f, &init_d);
  }
  pthread_mutex_lock(&f->mu);
  if (init_rc < 0 && !f->error) {
    f->error = init_rc;
    f->error_diag = init_d;
  }
  for (;;) {
    while (!f->stopping && f->completed == f->issued)
      pthread_cond_wait(&f->cv, &f->mu);
    if (f->completed == f->issued) break; /* stopping and drained */
    size_t slot = (size_t)(f->completed % (int64_t)f->queue_cap);
    sp_fsdp_work w = f->queue[slot];
    int failed = f->error;
    pthread_mutex_unlock(&f->mu);
    sp_diag d = {{0}};
    /* after a failure the rest of the queue is not run: the collective
     * sequence is broken and peers would hang on a half-issued op */
    int rc = failed;
    if (!failed) rc = f->mem->wait_mark(f, slot, &d);
    if (rc == 0) rc = run_work(f, &w, &d);
    pthread_mutex_lock(&f->mu);
    if (rc < 0 && !f->error) {
      f->error = rc;
      f->error_diag = d;
    }
    f->completed++;
    pthread_cond_broadcast(&f->cv);
  }
  pthread_mutex_unlock(&f->mu);
  f->host_tmp = NULL;
  free(tmp);
  return NULL;
}

int64_t sp_fsdp_enqueue(sp_fsdp *f, const sp_fsdp_work *w, sp_diag *d) {
  pthread_mutex_lock(&f->mu);
  /* a full ring waits for the oldest: bounded by construction (at most one
   * gather and one reduce per unit plus caller all-reduces are pending) */
  while (f->issued - f->completed >= (int64_t)f->queue_cap && !f->error)
    pthread_cond_wait(&f->cv, &f->mu);
  if (f->error) {
    int rc = f->error;
    if (d) *d = f->error_diag;
    pthread_mutex_unlock(&f->mu);
    return rc;
  }
  int64_t t = f->issued;
  size_t slot = (size_t)(t % (int64_t)f->queue_cap);
  /* the slot's previous item has completed (the ring is not full), so its
   * mark may be recorded again */
  sp_diag md = {{0}};
  int mrc = f->mem->mark(f, slot, &md);
  if (mrc < 0) {
    pthread_mutex_unlock(&f->mu);
    if (d) *d = md;
    return mrc;
  }
  f->issued++;
  f->queue[slot] = *w;
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
  return t;
}

int sp_fsdp_wait(sp_fsdp *f, int64_t ticket, sp_diag *d) {
  pthread_mutex_lock(&f->mu);
  while (f->completed <= ticket && !f->error)
    pthread_cond_wait(&f->cv, &f->mu);
  int rc = f->error;
  if (rc && d) *d = f->error_diag;
  pthread_mutex_unlock(&f->mu);
  return rc;
}

static bool ticket_done(sp_fsdp *f, int64_t ticket) {
  pthread_mutex_lock(&f->mu);
  bool done = f->completed > ticket;
  pthread_mutex_unlock(&f->mu);
  return done;
}

/* ---- construction ---- */

/* Zeroed storage for n elements of esize bytes, or NULL with *rc set (the
 * first failure of a series wins, so one check after several calls). */
static void *mem_alloc(sp_fsdp *f, size_t n, size_t esize, int *rc,
                       sp_diag *d) {
  void *p = NULL;
  if (*rc < 0) return NULL;
  int r = f->mem->alloc(f, n, esize, &p, d);
  if (r < 0) {
    *rc = r;
    return NULL;
  }
  return p;
}

static int alloc_unit(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  const sp_plan *pl = f->plan;
  sp_fsdp_unit *fu = &f->units[ui];
  const sp_unit *u = &pl->units[ui];
  fu->u = u;
  fu->gather_ticket = fu->reduce_ticket = -1;
  fu->post_forward_index = -1;
  fu->has_data = u->n_params > 0 && u->numel > 0;
  if (!fu->has_data) return 0;
  fu->reduces = u->requires_grad;
  fu->esize = sp_dtype_size(u->dtype);
  fu->psize = sp_dtype_size(u->param_dtype);
  fu->c = u->shard_numel;
  fu->padded = pl->strategy == SP_NO_SHARD
                   ? fu->c
                   : fu->c * (int64_t)pl->shard_world;
  fu->grad_dtype =
      u->keep_low_precision_grads ? u->param_dtype : u->dtype;
  size_t c = (size_t)fu->c, padded = (size_t)fu->padded;
  size_t rsize = sp_dtype_size(u->reduce_dtype);
  /* Everything a step needs, once: the views, gradients and reduction
   * buffers are reused every step (on a GPU: no cudaMalloc per step). */
  int rc = 0;
  fu->shard = mem_alloc(f, c, fu->esize, &rc, d);
  fu->shard_grad = mem_alloc(f, c, sp_dtype_size(fu->grad_dtype), &rc, d);
  fu->full = mem_alloc(f, padded, fu->psize, &rc, d);
  fu->full_grad = mem_alloc(f, padded, fu->psize, &rc, d);
  fu->red_out =
      mem_alloc(f, pl->strategy == SP_NO_SHARD ? padded : c, rsize, &rc, d);
  if (u->param_dtype != u->dtype && !f->dev)
    fu->mp_shard = mem_alloc(f, c, fu->psize, &rc, d);
  if (u->reduce_dtype != u->param_dtype)
    fu->red_in = mem_alloc(f, padded, rsize, &rc, d);
  if (rc < 0)
    return sp_diag_prefix(d, rc, "unit %u (%s): %lld elements", ui,
                          unit_name(f, ui), (long long)padded);
  /* initialise the master shard parameter by parameter; the callback
   * writes host memory, so a device shard is filled through a host image */
  uint8_t *host = fu->shard;
  if (f->mem->device) {
    host = xcalloc(c, fu->esize);
    if (!host)
      return sp_diag_set(d, SP_ENOMEM, "unit %u (%s): no host memory for "
                         "%zu elements", ui, unit_name(f, ui), c);
  }
  size_t n = 0;
  rc = sp_plan_shard_params(pl, ui, f->rank, NULL, 0, &n);
  if (rc < 0) {
    if (host != fu->shard) free(host);
    return sp_diag_set(d, rc, "shard params of unit %u", ui);
  }
  sp_shard_param *sp = xcalloc(n, sizeof *sp);
  if (!sp) {
    if (host != fu->shard) free(host);
    return sp_diag_set(d, SP_ENOMEM, "no memory");
  }
  rc = sp_plan_shard_params(pl, ui, f->rank, sp, n, &n);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const sp_flat_entry *e = &pl->entries[sp[i].entry];
    if (f->opts.init_param)
      f->opts.init_param(f->opts.user, f->model, e->param,
                         sp[i].intra_start, sp[i].numel_in_shard,
                         host + (size_t)sp[i].offset_in_shard * fu->esize);
  }
  free(sp);
  if (host != fu->shard) {
    if (rc == 0) rc = f->mem->from_host(f, fu->shard, host, c * fu->esize, d);
    free(host);
  }
  return rc;
}

int sp_fsdp_new(const sp_fsdp_opts *opts, sp_fsdp **out, sp_diag *d) {
  if (!opts || !out || !opts->session || !opts->world)
    return sp_diag_set(d, SP_EINVAL, "sp_fsdp_new: session and world "
                                     "communicator are required");
  *out = NULL;
  const sp_plan *pl = sp_session_plan(opts->session);
  if (pl->strategy == SP_HYBRID_SHARD &&
      (!opts->shard_group || !opts->replica_group))
    return sp_diag_set(d, SP_EINVAL, "HYBRID_SHARD needs the shard and "
                                     "replica group communicators");
  if (sp_comm_size(opts->world) != pl->world_size)
    return sp_diag_set(d, SP_EINVAL,
                       "world communicator has %u members, the job %u",
                       sp_comm_size(opts->world), pl->world_size);
  bool on_cpu = !opts->device || strcmp(opts->device, "cpu") == 0;
  bool staged = opts->device && strcmp(opts->device, "cpu-staged") == 0;
  sp_fsdp *f = calloc(1, sizeof *f);
  if (!f) return sp_diag_set(d, SP_ENOMEM, "no memory");
  f->mem = &k_host_ops;
  f->s = opts->session;
  f->plan = pl;
  f->model = pl->model;
  f->rank = sp_session_rank(opts->session);
  f->world = pl->world_size;
  f->opts = *opts;
  if (!f->opts.max_inflight_gathers) f->opts.max_inflight_gathers = 2;
  f->world_comm = opts->world;
  f->shard_comm = opts->shard_group;
  f->replica_comm = opts->replica_group;
  divide_factors(f->world, &f->pre_divide, &f->post_divide);
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->cv, NULL);
  f->n_units = pl->n_units;
  f->queue_cap = 2 * pl->n_units + 16;
  f->units = xcalloc(pl->n_units, sizeof *f->units);
  f->order = xcalloc(pl->n_units, sizeof *f->order);
  f->inflight = xcalloc(f->opts.max_inflight_gathers + 1,
                        sizeof *f->inflight);
  f->queue = xcalloc(f->queue_cap, sizeof *f->queue);
  f->buffers = xcalloc(f->model->n_buffers, sizeof *f->buffers);
  f->buffer_dtype = xcalloc(f->model->n_buffers, sizeof *f->buffer_dtype);
  int rc = 0;
  if (!f->units || !f->order || !f->inflight || !f->queue || !f->buffers ||
      !f->buffer_dtype)
    rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  /* the storage's home: before the first allocation. Device buffers need
   * communicators that take device pointers, i.e. have a CUDA stream; a
   * host backend would read device addresses on the host. */
  if (rc == 0 && staged) {
    f->mem = &k_staged_ops;
  } else if (rc == 0 && !on_cpu) {
    sp_comm *cs[3] = {f->world_comm, f->shard_comm, f->replica_comm};
    for (int i = 0; rc == 0 && i < 3; i++) {
      void *stream = NULL;
      if (cs[i] && sp_comm_cuda_stream(cs[i], &stream) < 0)
        rc = sp_diag_set(d, SP_EINVAL, "device %s: the %s communicator "
                         "takes host memory; a runtime on a GPU needs NCCL "
                         "communicators (sp_fsdp_comms_open on a session "
                         "with a cuda device)", opts->device,
                         i == 0 ? "world" : i == 1 ? "shard-group"
                                                   : "replica-group");
    }
    if (rc == 0) rc = sp_fsdp_cuda_attach(f, opts->device, d);
  }
  for (uint32_t u = 0; rc == 0 && u < pl->n_units; u++)
    rc = alloc_unit(f, u, d);
  for (size_t b = 0; rc == 0 && b < f->model->n_buffers; b++) {
    const sp_tensor_spec *bs = &f->model->buffers[b];
    size_t n = (size_t)bs->numel, es = sp_dtype_size(bs->dtype);
    f->buffer_dtype[b] = bs->dtype;
    void *p = NULL;
    rc = f->mem->alloc(f, n, es, &p, d);
    if (rc < 0) {
      sp_diag_prefix(d, rc, "buffer %s", bs->fqn);
      break;
    }
    f->buffers[b] = p;
    if (!f->opts.init_buffer) continue;
    if (!f->mem->device) {
      f->opts.init_buffer(f->opts.user, f->model, (int32_t)b, f->buffers[b]);
      continue;
    }
    uint8_t *host = xcalloc(n, es);
    if (!host) {
      rc = sp_diag_set(d, SP_ENOMEM, "no host memory for buffer %s", bs->fqn);
      break;
    }
    f->opts.init_buffer(f->opts.user, f->model, (int32_t)b, host);
    rc = f->mem->from_host(f, f->buffers[b], host, n * es, d);
    free(host);
  }
  if (rc == 0) {
    if (pthread_create(&f->thread, NULL, comm_thread, f) != 0)
      rc = sp_diag_set(d, SP_ENOMEM, "cannot start the communication thread");
    else
      f->thread_started = true;
  }
  if (rc < 0) {
    sp_fsdp_free(f);
    return rc;
  }
  *out = f;
  return 0;
}

void sp_fsdp_free(sp_fsdp *f) {
  if (!f) return;
  if (f->thread_started) {
    pthread_mutex_lock(&f->mu);
    f->stopping = true;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->thread, NULL);
  }
  /* nothing may still run on the device when its memory goes */
  if (f->mem->device) {
    sp_diag ignored = {{0}};
    (void)f->mem->drain(f, SP_LANE_COMPUTE, &ignored);
    (void)f->mem->drain(f, SP_LANE_COMM, &ignored);
  }
  for (size_t i = 0; f->units && i < f->n_units; i++) {
    sp_fsdp_unit *fu = &f->units[i];
    f->mem->release(f, fu->shard);
    f->mem->release(f, fu->shard_grad);
    f->mem->release(f, fu->mp_shard);
    f->mem->release(f, fu->full);
    f->mem->release(f, fu->full_grad);
    f->mem->release(f, fu->red_in);
    f->mem->release(f, fu->red_out);
  }
  for (size_t b = 0; f->buffers && b < f->model->n_buffers; b++)
    f->mem->release(f, f->buffers[b]);
  f->mem->destroy(f);
  free(f->buffers);
  free(f->buffer_dtype);
  free(f->units);
  free(f->order);
  free(f->inflight);
  free(f->queue);
  pthread_mutex_destroy(&f->mu);
  pthread_cond_destroy(&f->cv);
  free(f);
}

/* ---- unshard with the limiter ---- */

static int issue_gather(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  sp_fsdp_unit *fu = &f->units[ui];
  /* _FreeEventQueue: drop finished gathers, then block on the oldest while
   * the limit is reached */
  size_t k = 0;
  for (size_t i = 0; i < f->n_inflight; i++)
    if (!ticket_done(f, f->inflight[i])) f->inflight[k++] = f->inflight[i];
  f->n_inflight = k;
  while (f->n_inflight >= f->opts.max_inflight_gathers) {
    int rc = sp_fsdp_wait(f, f->inflight[0], d);
    if (rc < 0) return rc;
    memmove(f->inflight, f->inflight + 1,
            (f->n_inflight - 1) * sizeof *f->inflight);
    f->n_inflight--;
  }
  sp_fsdp_work w = {.kind = SP_WORK_GATHER, .unit = ui};
  int64_t t = sp_fsdp_enqueue(f, &w, d);
  if (t < 0) return (int)t;
  if (f->plan->strategy != SP_NO_SHARD)
    sp_session_collective(f->s, SP_OP_ALL_GATHER, ui, fu->u->param_dtype,
                          (uint64_t)fu->c);
  fu->gather_ticket = t;
  f->inflight[f->n_inflight++] = t;
  f->stats.all_gathers++;
  if (f->n_inflight > f->stats.max_inflight)
    f->stats.max_inflight = f->n_inflight;
  return 0;
}

static int unshard(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  sp_fsdp_unit *fu = &f->units[ui];
  if (!fu->has_data || fu->unsharded) return 0;
  if (fu->gather_ticket < 0) {
    int rc = issue_gather(f, ui, d);
    if (rc < 0) return rc;
  }
  int rc = sp_fsdp_wait(f, fu->gather_ticket, d);
  if (rc < 0) return rc;
  fu->gather_ticket = -1;
  fu->unsharded = true;
  return 0;
}

static void reshard(sp_fsdp *f, uint32_t ui) {
  sp_fsdp_unit *fu = &f->units[ui];
  /* storage stays allocated (reused every step); the views go away */
  fu->unsharded = false;
  fu->prefetched = false;
}

/* FULL_SHARD and HYBRID_SHARD free after forward, except the root unit. */
static bool reshard_after_forward(const sp_fsdp *f, uint32_t ui) {
  return ui != 0 && (f->plan->strategy == SP_FULL_SHARD ||
                     f->plan->strategy == SP_HYBRID_SHARD);
}

static int check_unit(const sp_fsdp *f, uint32_t ui, sp_diag *d) {
  if (ui >= f->n_units)
    return sp_diag_set(d, SP_ERANGE, "unit %u out of range (%zu units)", ui,
                       f->n_units);
  return 0;
}

/* Refuses an illegal transition before the call acts on it: unshard issues
 * an all-gather, and a rank that issued one for a call it then refused
 * would leave its peers (which never issue it) out of step, or hang. Fails
 * with the session's message naming the legal states; changes nothing. */
static int check_transition(sp_fsdp *f, uint32_t ui, int to, sp_diag *d) {
  int from = sp_session_state(f->s, SP_MACHINE_HANDLE, ui);
  if (sp_state_transition_legal(SP_MACHINE_HANDLE, from, to)) return 0;
  return transition(f, SP_MACHINE_HANDLE, ui, to, d);
}

/* ---- lazy init and buffers ---- */

int sp_fsdp_lazy_init(sp_fsdp *f, sp_diag *d) {
  if (f->lazy_init_done) return 0;
  for (size_t i = 0; i < f->plan->n_buffers; i++) {
    const sp_plan_buffer *pb = &f->plan->buffers[i];
    int32_t b = pb->buffer;
    sp_dtype to = pb->compute_dtype;
    if (to == f->buffer_dtype[b] || !sp_dtype_is_floating(to)) continue;
    size_t n = (size_t)f->model->buffers[b].numel;
    void *nb = NULL;
    int rc = f->mem->alloc(f, n, sp_dtype_size(to), &nb, d);
    if (rc < 0)
      return sp_diag_prefix(d, rc, "buffer %s", f->model->buffers[b].fqn);
    rc = f->mem->cast(f, SP_LANE_COMPUTE, nb, to, f->buffers[b],
                      f->buffer_dtype[b], n, d);
    /* the old storage may still be read by the cast on the device */
    if (rc == 0) rc = f->mem->drain(f, SP_LANE_COMPUTE, d);
    if (rc < 0) {
      f->mem->release(f, nb);
      return sp_diag_set(d, rc, "casting buffer %s to %s",
                         f->model->buffers[b].fqn, sp_dtype_name(to));
    }
    f->mem->release(f, f->buffers[b]);
    f->buffers[b] = nb;
    f->buffer_dtype[b] = to;
  }
  f->lazy_init_done = true;
  return 0;
}

sp_dtype sp_fsdp_buffer_orig_dtype(const sp_fsdp *f, int32_t b) {
  return f->model->buffers[b].dtype;
}

void *sp_fsdp_buffer(sp_fsdp *f, int32_t b) {
  if (!f || b < 0 || (size_t)b >= f->model->n_buffers) return NULL;
  return f->buffers[b];
}

sp_dtype sp_fsdp_buffer_dtype(const sp_fsdp *f, int32_t b) {
  if (!f || b < 0 || (size_t)b >= f->model->n_buffers)
    return SP_DTYPE_INVALID;
  return f->buffer_dtype[b];
}

/* ---- the schedule ---- */

int sp_fsdp_pre_forward(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  int rc = check_unit(f, ui, d);
  if (rc == 0) rc = check_transition(f, ui, SP_HANDLE_FORWARD, d);
  if (rc == 0) rc = unshard(f, ui, d);
  if (rc == 0) rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_FORWARD, d);
  return rc;
}

int sp_fsdp_post_forward(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  int rc = check_unit(f, ui, d);
  /* The table also allows IDLE -> IDLE and BACKWARD_PRE -> IDLE, but those
   * rows are finish_backward's (_post_backward_final_callback); a
   * post_forward from them would record a bogus post-forward order and
   * reshard a unit in use. */
  int from = rc == 0 ? sp_session_state(f->s, SP_MACHINE_HANDLE, ui) : 0;
  if (rc == 0 && from != SP_HANDLE_FORWARD)
    rc = sp_diag_set(d, SP_ESTATE,
                     "unit %u (%s): post_forward from %s; legal only from "
                     "FORWARD (after pre_forward)",
                     ui, unit_name(f, ui),
                     sp_state_name(SP_MACHINE_HANDLE, from));
  if (rc == 0) rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_IDLE, d);
  if (rc < 0) return rc;
  sp_fsdp_unit *fu = &f->units[ui];
  if (fu->post_forward_index < 0 && f->n_order < f->n_units) {
    fu->post_forward_index = (int32_t)f->n_order;
    f->order[f->n_order++] = ui;
  }
  if (reshard_after_forward(f, ui)) reshard(f, ui);
  return 0;
}

int sp_fsdp_root_pre_forward(sp_fsdp *f, sp_diag *d) {
  int rc = sp_fsdp_lazy_init(f, d);
  if (rc == 0)
    rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD, d);
  if (rc == 0) rc = sp_fsdp_pre_forward(f, 0, d);
  return rc;
}

int sp_fsdp_root_post_forward(sp_fsdp *f, sp_diag *d) {
  int rc = sp_fsdp_post_forward(f, 0, d);
  if (rc == 0) rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE, d);
  return rc;
}

int sp_fsdp_root_pre_backward(sp_fsdp *f, sp_diag *d) {
  int rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD, d);
  if (rc == 0) rc = sp_fsdp_pre_backward(f, 0, d);
  return rc;
}

/* BACKWARD_PRE prefetch: the unit before this one in post-forward order
 * (_get_handle_to_prefetch). */
static int prefetch(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  int32_t idx = f->units[ui].post_forward_index;
  if (!f->opts.backward_prefetch || idx <= 0) return 0;
  uint32_t target = f->order[idx - 1];
  sp_fsdp_unit *tu = &f->units[target];
  if (!tu->has_data || tu->unsharded || tu->gather_ticket >= 0 ||
      tu->prefetched)
    return 0;
  /* FSDP prefetches only a handle that still needs its pre-backward
   * unshard (_needs_pre_backward_unshard): one whose backward already ran
   * (backward not in reverse forward order) would be gathered for nothing,
   * and its parameters left pending into the next step. */
  if (sp_session_state(f->s, SP_MACHINE_HANDLE, target) != SP_HANDLE_IDLE)
    return 0;
  int rc = issue_gather(f, target, d);
  if (rc < 0) return rc;
  tu->prefetched = true;
  f->stats.prefetches++;
  return 0;
}

int sp_fsdp_pre_backward(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  int rc = check_unit(f, ui, d);
  if (rc == 0) rc = check_transition(f, ui, SP_HANDLE_BACKWARD_PRE, d);
  if (rc == 0) rc = unshard(f, ui, d);
  if (rc == 0)
    rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_BACKWARD_PRE, d);
  if (rc < 0) return rc;
  sp_fsdp_unit *fu = &f->units[ui];
  /* a gradient of last step's reduction may still be read: wait for it
   * before the trainer overwrites the buffer */
  if (fu->reduce_ticket >= 0) {
    rc = sp_fsdp_wait(f, fu->reduce_ticket, d);
    if (rc < 0) return rc;
    fu->reduce_ticket = -1;
  }
  if (fu->has_data) {
    rc = f->mem->zero(f, SP_LANE_COMPUTE, fu->full_grad,
                      (size_t)fu->padded * fu->psize, d);
    if (rc < 0) return rc;
  }
  return prefetch(f, ui, d);
}

int sp_fsdp_post_backward(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  int rc = check_unit(f, ui, d);
  /* BACKWARD_POST -> BACKWARD_POST is reentrant activation checkpointing
   * running the hook again: the gradient is already being reduced (and,
   * in place, pre-divided), so a second reduction would divide it twice */
  bool again = rc == 0 && sp_session_state(f->s, SP_MACHINE_HANDLE, ui) ==
                              SP_HANDLE_BACKWARD_POST;
  if (rc == 0)
    rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_BACKWARD_POST, d);
  if (rc < 0 || again) return rc;
  sp_fsdp_unit *fu = &f->units[ui];
  if (fu->reduces) {
    sp_fsdp_work w = {.kind = SP_WORK_REDUCE, .unit = ui};
    int64_t t = sp_fsdp_enqueue(f, &w, d);
    if (t < 0) return (int)t;
    fu->reduce_ticket = t;
    sp_dtype rdt = fu->u->reduce_dtype;
    if (f->plan->strategy == SP_NO_SHARD) {
      sp_session_collective(f->s, SP_OP_ALL_REDUCE, ui, rdt,
                            (uint64_t)fu->c);
      f->stats.all_reduces++;
    } else {
      sp_session_collective(f->s, SP_OP_REDUCE_SCATTER, ui, rdt,
                            (uint64_t)fu->c);
      f->stats.reduce_scatters++;
      if (f->plan->strategy == SP_HYBRID_SHARD && f->replica_comm &&
          sp_comm_size(f->replica_comm) > 1) {
        sp_session_collective(f->s, SP_OP_ALL_REDUCE, ui, rdt,
                              (uint64_t)fu->c);
        f->stats.all_reduces++;
      }
    }
  }
  if (f->plan->strategy != SP_NO_SHARD) reshard(f, ui);
  return 0;
}

int sp_fsdp_finish_backward(sp_fsdp *f, sp_diag *d) {
  /* the table lets any handle state go to IDLE here (the final callback),
   * FORWARD included; but a unit still in forward means the caller is not
   * at the end of a backward pass */
  if (sp_session_state(f->s, SP_MACHINE_ROOT, 0) != SP_ROOT_FORWARD_BACKWARD)
    return sp_diag_set(d, SP_ESTATE, "finish_backward outside backward "
                       "(root %s)", sp_state_name(SP_MACHINE_ROOT,
                       sp_session_state(f->s, SP_MACHINE_ROOT, 0)));
  for (uint32_t ui = 0; ui < f->n_units; ui++)
    if (sp_session_state(f->s, SP_MACHINE_HANDLE, ui) == SP_HANDLE_FORWARD)
      return sp_diag_set(d, SP_ESTATE, "finish_backward during forward: "
                         "unit %u (%s) is in FORWARD", ui, unit_name(f, ui));
  int rc = 0;
  for (uint32_t ui = 0; ui < f->n_units && rc == 0; ui++) {
    sp_fsdp_unit *fu = &f->units[ui];
    if (fu->reduce_ticket >= 0) {
      rc = sp_fsdp_wait(f, fu->reduce_ticket, d);
      fu->reduce_ticket = -1;
    }
    /* a unit prefetched but whose backward never ran: its gather holds
     * this step's parameters, and a pending ticket would make the next
     * forward's unshard reuse them after SGD changed the shard. Wait for it
     * (sgd_step must not write the shard it reads) and drop it. */
    if (rc == 0 && fu->gather_ticket >= 0) {
      rc = sp_fsdp_wait(f, fu->gather_ticket, d);
      fu->gather_ticket = -1;
    }
    if (rc == 0 && sp_session_state(f->s, SP_MACHINE_HANDLE, ui) !=
                       SP_HANDLE_IDLE)
      rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_IDLE, d);
    /* _catch_all_reshard */
    if (f->plan->strategy != SP_NO_SHARD) reshard(f, ui);
    fu->post_forward_index = -1;
  }
  f->n_order = 0;
  if (rc == 0) rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE, d);
  return rc;
}

int sp_fsdp_all_reduce(sp_fsdp *f, void *buf, size_t count, sp_dtype dt,
                       sp_diag *d) {
  if (f->world == 1) return 0;
  sp_fsdp_work w = {.kind = SP_WORK_ALL_REDUCE, .buf = buf, .count = count,
                    .dt = dt};
  int64_t t = sp_fsdp_enqueue(f, &w, d);
  if (t < 0) return (int)t;
  sp_session_collective(f->s, SP_OP_ALL_REDUCE, 0, dt, count);
  f->stats.all_reduces++;
  return sp_fsdp_wait(f, t, d);
}

int sp_fsdp_gather_unit(sp_fsdp *f, uint32_t ui, void *dst, sp_diag *d) {
  int rc = check_unit(f, ui, d);
  if (rc < 0) return rc;
  sp_fsdp_unit *fu = &f->units[ui];
  if (!fu->has_data) return 0;
  rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_SUMMON_FULL_PARAMS, d);
  if (rc < 0) return rc;
  /* storage of the runtime's kind (the collective runs on it), allocated
   * per call: summoning is for checkpoints, not for steps */
  void *tmp = NULL;
  rc = f->mem->alloc(f, (size_t)fu->padded, fu->esize, &tmp, d);
  if (rc < 0)
    return sp_diag_prefix(d, rc, "gathering unit %u", ui);
  sp_fsdp_work w = {.kind = SP_WORK_GATHER_MASTER, .unit = ui, .buf = tmp};
  int64_t t = sp_fsdp_enqueue(f, &w, d);
  if (t < 0) {
    f->mem->release(f, tmp);
    return (int)t;
  }
  if (f->plan->strategy != SP_NO_SHARD)
    sp_session_collective(f->s, SP_OP_ALL_GATHER, ui, fu->u->dtype,
                          (uint64_t)fu->c);
  rc = sp_fsdp_wait(f, t, d);
  if (rc == 0)
    rc = f->mem->to_host(f, dst, tmp, (size_t)fu->u->numel * fu->esize, d);
  f->mem->release(f, tmp);
  if (rc == 0) rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_IDLE, d);
  return rc;
}

int sp_fsdp_gather_param(sp_fsdp *f, int32_t param, void *dst, sp_diag *d) {
  if (!f || param < 0 || (size_t)param >= f->model->n_params)
    return sp_diag_set(d, SP_ERANGE, "parameter %d out of range", param);
  uint32_t ui = (uint32_t)f->plan->param_unit[param];
  sp_fsdp_unit *fu = &f->units[ui];
  const sp_flat_entry *e = &f->plan->entries[f->plan->param_entry[param]];
  uint8_t *full = xcalloc((size_t)fu->u->numel, fu->esize);
  if (!full) return sp_diag_set(d, SP_ENOMEM, "no memory");
  int rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_SUMMON_FULL_PARAMS, d);
  if (rc == 0) rc = sp_fsdp_gather_unit(f, ui, full, d);
  if (rc == 0) rc = transition(f, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE, d);
  if (rc == 0)
    memcpy(dst, full + (size_t)e->offset * fu->esize,
           (size_t)e->numel * fu->esize);
  free(full);
  return rc;
}

/* ---- views ---- */

static sp_fsdp_unit *param_unit(sp_fsdp *f, int32_t param,
                                const sp_flat_entry **e) {
  if (!f || param < 0 || (size_t)param >= f->model->n_params) return NULL;
  int32_t ui = f->plan->param_unit[param];
  if (ui < 0) return NULL;
  *e = &f->plan->entries[f->plan->param_entry[param]];
  return &f->units[ui];
}

void *sp_fsdp_param(sp_fsdp *f, int32_t param) {
  const sp_flat_entry *e;
  sp_fsdp_unit *fu = param_unit(f, param, &e);
  if (!fu || !fu->unsharded) return NULL;
  return fu->full + (size_t)e->offset * fu->psize;
}

void *sp_fsdp_param_grad(sp_fsdp *f, int32_t param) {
  const sp_flat_entry *e;
  sp_fsdp_unit *fu = param_unit(f, param, &e);
  if (!fu || !fu->has_data) return NULL;
  return fu->full_grad + (size_t)e->offset * fu->psize;
}

sp_dtype sp_fsdp_param_dtype(const sp_fsdp *f, int32_t param) {
  const sp_flat_entry *e;
  sp_fsdp_unit *fu = param_unit((sp_fsdp *)f, param, &e);
  return fu && fu->has_data ? fu->u->param_dtype : SP_DTYPE_INVALID;
}

void *sp_fsdp_shard(sp_fsdp *f, uint32_t ui, int64_t *numel) {
  if (!f || ui >= f->n_units || !f->units[ui].has_data) {
    if (numel) *numel = 0;
    return NULL;
  }
  if (numel) *numel = f->units[ui].c;
  return f->units[ui].shard;
}

void *sp_fsdp_shard_grad(sp_fsdp *f, uint32_t ui) {
  if (!f || ui >= f->n_units) return NULL;
  return f->units[ui].shard_grad;
}

sp_dtype sp_fsdp_shard_grad_dtype(const sp_fsdp *f, uint32_t ui) {
  if (!f || ui >= f->n_units || !f->units[ui].has_data)
    return SP_DTYPE_INVALID;
  return f->units[ui].grad_dtype;
}

/* p -= lr * g, computed in double and rounded once to the master dtype, as
 * the reference trainer does (the memory ops' sgd). */
int sp_fsdp_sgd_step(sp_fsdp *f, double lr, sp_diag *d) {
  for (size_t ui = 0; ui < f->n_units; ui++) {
    sp_fsdp_unit *fu = &f->units[ui];
    if (!fu->reduces) continue;
    /* an unsharded copy kept across steps (NO_SHARD) is stale now */
    reshard(f, (uint32_t)ui);
    int rc = f->mem->sgd(f, fu->shard, fu->u->dtype, fu->shard_grad,
                         fu->grad_dtype, (size_t)fu->c, lr, d);
    if (rc < 0)
      return sp_diag_prefix(d, rc, "SGD on unit %zu (%s)", ui,
                            unit_name(f, (uint32_t)ui));
  }
  return 0;
}

/* ---- device placement ---- */

/* true for GPU storage only: "cpu-staged" storage is host memory the
 * caller may use directly */
bool sp_fsdp_on_device(const sp_fsdp *f) { return f && f->dev != NULL; }

int sp_fsdp_copy(sp_fsdp *f, void *dst, const void *src, size_t bytes,
                 sp_diag *d) {
  if (!f || (bytes && (!dst || !src)))
    return sp_diag_set(d, SP_EINVAL, "sp_fsdp_copy: NULL argument");
  if (bytes == 0) return 0;
  return f->mem->copy(f, SP_LANE_COMPUTE, dst, src, bytes, d);
}

int sp_fsdp_synchronize(sp_fsdp *f, sp_diag *d) {
  if (!f) return sp_diag_set(d, SP_EINVAL, "sp_fsdp_synchronize: NULL");
  return f->mem->drain(f, SP_LANE_COMPUTE, d);
}

/* ---- checkpoint access (fsdp_internal.h) ---- */

static int host_image(sp_fsdp *f, const void *src, size_t bytes,
                      const uint8_t **data, uint8_t **owned, sp_diag *d) {
  *owned = NULL;
  if (!f->mem->device) {
    *data = src;
    return 0;
  }
  uint8_t *h = malloc(bytes ? bytes : 1);
  if (!h) return sp_diag_set(d, SP_ENOMEM, "no host memory for %zu bytes",
                             bytes);
  int rc = f->mem->to_host(f, h, src, bytes, d);
  if (rc < 0) {
    free(h);
    return rc;
  }
  *data = *owned = h;
  return 0;
}

int sp_fsdp_shard_host(sp_fsdp *f, uint32_t u, const uint8_t **data,
                       uint8_t **owned, sp_diag *d) {
  sp_fsdp_unit *fu = &f->units[u];
  return host_image(f, fu->shard, (size_t)fu->c * fu->esize, data, owned, d);
}

int sp_fsdp_buffer_host(sp_fsdp *f, int32_t b, const uint8_t **data,
                        uint8_t **owned, sp_diag *d) {
  size_t bytes = (size_t)f->model->buffers[b].numel *
                 sp_dtype_size(f->buffer_dtype[b]);
  return host_image(f, f->buffers[b], bytes, data, owned, d);
}

static uint8_t *stage(sp_fsdp *f, void *storage, size_t bytes, sp_diag *d) {
  if (!f->mem->device) return storage;
  uint8_t *h = malloc(bytes ? bytes : 1);
  if (!h) sp_diag_set(d, SP_ENOMEM, "no host memory for %zu bytes", bytes);
  return h;
}

static int commit(sp_fsdp *f, void *storage, uint8_t *h, size_t bytes,
                  bool keep, sp_diag *d) {
  if (!f->mem->device || !h) return 0;
  int rc = keep ? f->mem->from_host(f, storage, h, bytes, d) : 0;
  free(h);
  return rc;
}

uint8_t *sp_fsdp_shard_stage(sp_fsdp *f, uint32_t u, sp_diag *d) {
  sp_fsdp_unit *fu = &f->units[u];
  return stage(f, fu->shard, (size_t)fu->c * fu->esize, d);
}

int sp_fsdp_shard_commit(sp_fsdp *f, uint32_t u, uint8_t *h, bool keep,
                         sp_diag *d) {
  sp_fsdp_unit *fu = &f->units[u];
  return commit(f, fu->shard, h, (size_t)fu->c * fu->esize, keep, d);
}

uint8_t *sp_fsdp_buffer_stage(sp_fsdp *f, int32_t b, sp_diag *d) {
  size_t bytes = (size_t)f->model->buffers[b].numel *
                 sp_dtype_size(f->buffer_dtype[b]);
  return stage(f, f->buffers[b], bytes, d);
}

int sp_fsdp_buffer_commit(sp_fsdp *f, int32_t b, uint8_t *h, bool keep,
                          sp_diag *d) {
  size_t bytes = (size_t)f->model->buffers[b].numel *
                 sp_dtype_size(f->buffer_dtype[b]);
  return commit(f, f->buffers[b], h, bytes, keep, d);
}

void sp_fsdp_get_stats(const sp_fsdp *f, sp_fsdp_stats *out) {
  if (f && out) *out = f->stats;
}

/* ---- communicators ---- */

int sp_fsdp_comms_open(sp_session *s, uint64_t timeout_ms, sp_comm **world,
                       sp_comm **shard_group, sp_comm **replica_group,
                       sp_diag *d) {
  const sp_plan *pl = sp_session_plan(s);
  const sp_job *job = sp_session_job(s);
  uint32_t r = sp_session_rank(s), w = pl->world_size;
  *world = *shard_group = *replica_group = NULL;
  /* A rank on a GPU moves device memory: NCCL, whatever the job says (its
   * backend names what CPU ranks use). */
  const char *device = sp_session_device(s);
  bool cuda = device && strncmp(device, "cuda", 4) == 0;
  sp_comm_opts o = {.backend = cuda ? SP_BACKEND_NCCL : job->backend,
                    .store = sp_session_comm_store(s),
                    .timeout_ms = timeout_ms,
                    .device = cuda ? device : NULL};
  char prefix[64];
  o.prefix = "comm/world";
  o.rank = r;
  o.size = w;
  int rc = sp_comm_new(&o, world, d);
  if (rc < 0 || pl->strategy != SP_HYBRID_SHARD) return rc;
  uint32_t g = pl->shard_world;
  snprintf(prefix, sizeof prefix, "comm/shard/%u", r / g);
  o.prefix = prefix;
  o.rank = r % g;
  o.size = g;
  rc = sp_comm_new(&o, shard_group, d);
  if (rc == 0) {
    snprintf(prefix, sizeof prefix, "comm/replica/%u", r % g);
    o.rank = r / g;
    o.size = w / g;
    rc = sp_comm_new(&o, replica_group, d);
  }
  if (rc < 0) {
    sp_comm_free(*world);
    sp_comm_free(*shard_group);
    *world = *shard_group = NULL;
  }
  return rc;
}
