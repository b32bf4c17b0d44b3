/* The FSDP runtime: flat-parameter shards, unshard / reshard, gradient
 * reduction per unit in the schedule of the job's strategy
 * (../shared/reference/fsdp-semantics.md §4-6).
 *
 * Collectives run on one communication thread in issue order. Every rank
 * issues the same collectives in the same order (the schedule is a pure
 * function of the plan), which is what the backends require; the thread
 * lets an all-gather issued as a prefetch overlap the caller's compute, as
 * FSDP's unshard stream does on a GPU. */
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

static sp_comm *gather_comm(sp_fsdp *f) {
  return f->plan->strategy == SP_HYBRID_SHARD ? f->shard_comm
                                              : f->world_comm;
}

/* ---- the communication thread ---- */

static int run_gather(sp_fsdp *f, sp_fsdp_unit *fu, sp_diag *d) {
  const sp_unit *u = fu->u;
  uint8_t *src = fu->shard;
  if (fu->mp_shard) {
    int rc = sp_cast(fu->mp_shard, u->param_dtype, fu->shard, u->dtype,
                     (size_t)fu->c);
    if (rc < 0) return sp_diag_set(d, rc, "casting the shard to %s",
                                   sp_dtype_name(u->param_dtype));
    src = fu->mp_shard;
  }
  if (f->plan->strategy == SP_NO_SHARD) {
    memcpy(fu->full, src, (size_t)fu->c * fu->psize);
    return 0;
  }
  return sp_comm_all_gather(gather_comm(f), src, fu->full, (size_t)fu->c,
                            u->param_dtype, d);
}

/* The post-backward reduction: FSDP's _post_backward_hook +
 * _reduce_grad / _reduce_grad_no_shard. */
static int run_reduce(sp_fsdp *f, sp_fsdp_unit *fu, float *tmp, sp_diag *d) {
  const sp_unit *u = fu->u;
  sp_dtype rdt = u->reduce_dtype;
  size_t padded = (size_t)fu->padded;
  uint8_t *in = fu->full_grad;
  int rc;
  if (fu->red_in) {
    rc = sp_cast(fu->red_in, rdt, fu->full_grad, u->param_dtype, padded);
    if (rc < 0) return rc;
    in = fu->red_in;
  }
  rc = scale_div(in, rdt, padded, f->pre_divide, tmp);
  if (rc < 0) return rc;
  switch (f->plan->strategy) {
    case SP_NO_SHARD:
      rc = sp_comm_all_reduce(f->world_comm, in, padded, rdt, d);
      if (rc < 0) return rc;
      memcpy(fu->red_out, in, padded * sp_dtype_size(rdt));
      break;
    case SP_HYBRID_SHARD:
      rc = sp_comm_reduce_scatter(f->shard_comm, in, fu->red_out,
                                  (size_t)fu->c, rdt, d);
      if (rc == 0 && f->replica_comm && sp_comm_size(f->replica_comm) > 1)
        rc = sp_comm_all_reduce(f->replica_comm, fu->red_out, (size_t)fu->c,
                                rdt, d);
      if (rc < 0) return rc;
      break;
    default:
      rc = sp_comm_reduce_scatter(f->world_comm, in, fu->red_out,
                                  (size_t)fu->c, rdt, d);
      if (rc < 0) return rc;
  }
  rc = scale_div(fu->red_out, rdt, (size_t)fu->c, f->post_divide, tmp);
  if (rc < 0) return rc;
  return sp_cast(fu->shard_grad, fu->grad_dtype, fu->red_out, rdt,
                 (size_t)fu->c);
}

static int run_work(sp_fsdp *f, const sp_fsdp_work *w, float *tmp,
                    sp_diag *d) {
  sp_fsdp_unit *fu = w->kind == SP_WORK_ALL_REDUCE ? NULL : &f->units[w->unit];
  int rc;
  switch (w->kind) {
    case SP_WORK_GATHER:
      rc = run_gather(f, fu, d);
      break;
    case SP_WORK_REDUCE:
      rc = run_reduce(f, fu, tmp, d);
      break;
    case SP_WORK_ALL_REDUCE:
      rc = sp_comm_all_reduce(f->world_comm, w->buf, w->count, w->dt, d);
      break;
    case SP_WORK_GATHER_MASTER:
      if (f->plan->strategy == SP_NO_SHARD) {
        memcpy(w->buf, fu->shard, (size_t)fu->c * fu->esize);
        rc = 0;
      } else {
        rc = sp_comm_all_gather(gather_comm(f), fu->shard, w->buf,
                                (size_t)fu->c, fu->u->dtype, d);
      }
      break;
    default:
      rc = sp_diag_set(d, SP_EINVAL, "unknown work kind %d", (int)w->kind);
  }
  if (rc < 0 && w->kind != SP_WORK_ALL_REDUCE)
    sp_diag_prefix(d, rc, "unit %u (%s)", w->unit, unit_name(f, w->unit));
  return rc;
}

static void *comm_thread(void *arg) {
  sp_fsdp *f = arg;
  /* scratch for low-precision divides: the largest padded unit */
  size_t scratch = 1;
  for (size_t i = 0; i < f->n_units; i++)
    if ((size_t)f->units[i].padded > scratch)
      scratch = (size_t)f->units[i].padded;
  float *tmp = malloc(scratch * sizeof(float));
  pthread_mutex_lock(&f->mu);
  if (!tmp && !f->error) {
    f->error = sp_diag_set(&f->error_diag, SP_ENOMEM,
                           "no memory for reduction scratch");
  }
  for (;;) {
    while (!f->stopping && f->completed == f->issued)
      pthread_cond_wait(&f->cv, &f->mu);
    if (f->completed == f->issued) break; /* stopping and drained */
    sp_fsdp_work w = f->queue[f->completed % (int64_t)f->queue_cap];
    int failed = f->error;
    pthread_mutex_unlock(&f->mu);
    sp_diag d = {{0}};
    /* after a failure the rest of the queue is not run: the collective
     * sequence is broken and peers would hang on a half-issued op */
    int rc = failed ? failed : run_work(f, &w, tmp, &d);
    pthread_mutex_lock(&f->mu);
    if (rc < 0 && !f->error) {
      f->error = rc;
      f->error_diag = d;
    }
    f->completed++;
    pthread_cond_broadcast(&f->cv);
  }
  pthread_mutex_unlock(&f->mu);
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
  int64_t t = f->issued++;
  f->queue[t % (int64_t)f->queue_cap] = *w;
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
  fu->shard = xcalloc(c, fu->esize);
  fu->shard_grad = xcalloc(c, sp_dtype_size(fu->grad_dtype));
  fu->full = xcalloc(padded, fu->psize);
  fu->full_grad = xcalloc(padded, fu->psize);
  fu->red_out = xcalloc(pl->strategy == SP_NO_SHARD ? padded : c, rsize);
  bool ok = fu->shard && fu->shard_grad && fu->full && fu->full_grad &&
            fu->red_out;
  if (u->param_dtype != u->dtype) {
    fu->mp_shard = xcalloc(c, fu->psize);
    ok = ok && fu->mp_shard;
  }
  if (u->reduce_dtype != u->param_dtype) {
    fu->red_in = xcalloc(padded, rsize);
    ok = ok && fu->red_in;
  }
  if (!ok)
    return sp_diag_set(d, SP_ENOMEM,
                       "unit %u (%s): no memory for %lld elements", ui,
                       unit_name(f, ui),
                       (long long)padded);
  /* initialise the master shard parameter by parameter */
  size_t n = 0;
  int rc = sp_plan_shard_params(pl, ui, f->rank, NULL, 0, &n);
  if (rc < 0) return sp_diag_set(d, rc, "shard params of unit %u", ui);
  sp_shard_param *sp = xcalloc(n, sizeof *sp);
  if (!sp) return sp_diag_set(d, SP_ENOMEM, "no memory");
  rc = sp_plan_shard_params(pl, ui, f->rank, sp, n, &n);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const sp_flat_entry *e = &pl->entries[sp[i].entry];
    if (f->opts.init_param)
      f->opts.init_param(f->opts.user, f->model, e->param,
                         sp[i].intra_start, sp[i].numel_in_shard,
                         fu->shard + (size_t)sp[i].offset_in_shard * fu->esize);
  }
  free(sp);
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
  sp_fsdp *f = calloc(1, sizeof *f);
  if (!f) return sp_diag_set(d, SP_ENOMEM, "no memory");
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
  for (uint32_t u = 0; rc == 0 && u < pl->n_units; u++)
    rc = alloc_unit(f, u, d);
  for (size_t b = 0; rc == 0 && b < f->model->n_buffers; b++) {
    const sp_tensor_spec *bs = &f->model->buffers[b];
    f->buffer_dtype[b] = bs->dtype;
    f->buffers[b] = xcalloc((size_t)bs->numel, sp_dtype_size(bs->dtype));
    if (!f->buffers[b]) {
      rc = sp_diag_set(d, SP_ENOMEM, "no memory for buffer %s", bs->fqn);
      break;
    }
    if (f->opts.init_buffer)
      f->opts.init_buffer(f->opts.user, f->model, (int32_t)b, f->buffers[b]);
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
  for (size_t i = 0; f->units && i < f->n_units; i++) {
    sp_fsdp_unit *fu = &f->units[i];
    free(fu->shard);
    free(fu->shard_grad);
    free(fu->mp_shard);
    free(fu->full);
    free(fu->full_grad);
    free(fu->red_in);
    free(fu->red_out);
  }
  for (size_t b = 0; f->buffers && b < f->model->n_buffers; b++)
    free(f->buffers[b]);
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
                          (uint64_t)fu->padded);
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
    uint8_t *nb = xcalloc(n, sp_dtype_size(to));
    if (!nb)
      return sp_diag_set(d, SP_ENOMEM, "no memory for buffer %s",
                         f->model->buffers[b].fqn);
    int rc = sp_cast(nb, to, f->buffers[b], f->buffer_dtype[b], n);
    if (rc < 0) {
      free(nb);
      return sp_diag_set(d, rc, "casting buffer %s to %s",
                         f->model->buffers[b].fqn, sp_dtype_name(to));
    }
    free(f->buffers[b]);
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
  if (fu->has_data)
    memset(fu->full_grad, 0, (size_t)fu->padded * fu->psize);
  return prefetch(f, ui, d);
}

int sp_fsdp_post_backward(sp_fsdp *f, uint32_t ui, sp_diag *d) {
  int rc = check_unit(f, ui, d);
  if (rc == 0)
    rc = transition(f, SP_MACHINE_HANDLE, ui, SP_HANDLE_BACKWARD_POST, d);
  if (rc < 0) return rc;
  sp_fsdp_unit *fu = &f->units[ui];
  if (fu->reduces) {
    sp_fsdp_work w = {.kind = SP_WORK_REDUCE, .unit = ui};
    int64_t t = sp_fsdp_enqueue(f, &w, d);
    if (t < 0) return (int)t;
    fu->reduce_ticket = t;
    sp_dtype rdt = fu->u->reduce_dtype;
    if (f->plan->strategy == SP_NO_SHARD) {
      sp_session_collective(f->s, SP_OP_ALL_REDUCE, ui, rdt,
                            (uint64_t)fu->padded);
      f->stats.all_reduces++;
    } else {
      sp_session_collective(f->s, SP_OP_REDUCE_SCATTER, ui, rdt,
                            (uint64_t)fu->padded);
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
  uint8_t *tmp = xcalloc((size_t)fu->padded, fu->esize);
  if (!tmp) return sp_diag_set(d, SP_ENOMEM, "no memory to gather unit %u",
                               ui);
  sp_fsdp_work w = {.kind = SP_WORK_GATHER_MASTER, .unit = ui, .buf = tmp};
  int64_t t = sp_fsdp_enqueue(f, &w, d);
  if (t < 0) {
    free(tmp);
    return (int)t;
  }
  if (f->plan->strategy != SP_NO_SHARD)
    sp_session_collective(f->s, SP_OP_ALL_GATHER, ui, fu->u->dtype,
                          (uint64_t)fu->padded);
  rc = sp_fsdp_wait(f, t, d);
  if (rc == 0) memcpy(dst, tmp, (size_t)fu->u->numel * fu->esize);
  free(tmp);
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
 * the reference trainer does. */
int sp_fsdp_sgd_step(sp_fsdp *f, double lr, sp_diag *d) {
  for (size_t ui = 0; ui < f->n_units; ui++) {
    sp_fsdp_unit *fu = &f->units[ui];
    if (!fu->reduces) continue;
    /* an unsharded copy kept across steps (NO_SHARD) is stale now */
    reshard(f, (uint32_t)ui);
    size_t c = (size_t)fu->c;
    double *p = xcalloc(c, sizeof(double)), *g = xcalloc(c, sizeof(double));
    int rc = p && g ? 0 : SP_ENOMEM;
    if (rc == 0) rc = sp_cast(p, SP_FLOAT64, fu->shard, fu->u->dtype, c);
    if (rc == 0) rc = sp_cast(g, SP_FLOAT64, fu->shard_grad, fu->grad_dtype, c);
    if (rc == 0) {
      for (size_t i = 0; i < c; i++) p[i] -= lr * g[i];
      rc = sp_cast(fu->shard, fu->u->dtype, p, SP_FLOAT64, c);
      /* zero_grad: a unit that gets no gradient next step must not be
       * moved again by this one */
      memset(fu->shard_grad, 0, c * sp_dtype_size(fu->grad_dtype));
    }
    free(p);
    free(g);
    if (rc < 0)
      return sp_diag_set(d, rc, "SGD on unit %zu (%s): %s", ui,
                         unit_name(f, (uint32_t)ui), sp_strerror(rc));
  }
  return 0;
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
  sp_comm_opts o = {.backend = job->backend,
                    .store = sp_session_comm_store(s),
                    .timeout_ms = timeout_ms};
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
