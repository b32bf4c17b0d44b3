/* The FSDP runtime: flat-parameter shards, unshard / reshard, gradient
 * reduction per unit in the schedule of the job's strategy
 * (the rules: docs/fsdp.md).
 *
 * Collectives run on one communication thread in issue order. Every rank
 * issues the same collectives in the same order (the schedule is a pure
 * function of the plan), which is what the backends require; the thread
 * lets an all-gather issued as a prefetch overlap the caller's compute, as
 * FSDP's unshard stream does on a GPU.
 *
 * Storage is reached only through a memory-ops table (fsdp_internal.h):
 * host memory in fsdp_mem_host.c, device memory in fsdp_cuda.c, where the
 * thread's work goes on a comm stream ordered after the compute stream with
 * events. The schedule (fsdp_schedule.c) and the communication thread
 * (fsdp_comm.c) are the same for both.
 *
 * This file builds and frees the runtime and answers for its storage:
 * buffers, views, device placement, checkpoint access, communicators. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp_internal.h"

/* ---- helpers ---- */

void *sp_fsdp_xcalloc(size_t n, size_t size) {
  if (n == 0 || size == 0) return calloc(1, 1);
  if (n > SIZE_MAX / size) return NULL;
  return calloc(n, size);
}

/* FSDP's gradient divide factors (_get_gradient_predivide_factor): the
 * gradient is divided by pre before the collective and by post after, so
 * neither the sum nor the quotient overflows in low precision. */
void sp_fsdp_divide_factors(uint32_t world, double *pre, double *post) {
  uint32_t p = 1;
  while (world % p == 0 && world / p > p) p *= 2;
  *pre = p;
  *post = (double)world / p;
}

const char *sp_fsdp_unit_name(const sp_fsdp *f, uint32_t unit) {
  const char *fqn = sp_plan_unit_fqn(f->plan, unit);
  return fqn && *fqn ? fqn : "root";
}

/* ---- construction ---- */

/* ---- storage: every block through the pool (fsdp_internal.h) ---- */

static int pool_alloc(void *user, size_t n, size_t esize, void **out,
                      sp_diag *d) {
  sp_fsdp *f = user;
  return f->mem->alloc(f, n, esize, out, d);
}

static void pool_release(void *user, void *p) {
  sp_fsdp *f = user;
  f->mem->release(f, p);
}

int sp_fsdp_alloc(sp_fsdp *f, sp_mem_cat cat, size_t n, size_t esize, void **p,
                  sp_diag *d) {
  return sp_mem_pool_alloc(&f->pool, cat, n, esize, p, d);
}

int sp_fsdp_take(sp_fsdp *f, sp_mem_cat cat, size_t n, size_t esize, void **p,
                 sp_diag *d) {
  return sp_mem_pool_take(&f->pool, cat, n, esize, p, d);
}

int sp_fsdp_release(sp_fsdp *f, sp_mem_cat cat, void *p) {
  return sp_mem_pool_release(&f->pool, cat, p, NULL);
}

/* Zeroed storage of its own for n elements of esize bytes, or NULL with
 * *rc set (the first failure of a series wins, so one check after several
 * calls). */
static void *mem_alloc(sp_fsdp *f, sp_mem_cat cat, size_t n, size_t esize,
                       int *rc, sp_diag *d) {
  void *p = NULL;
  if (*rc < 0) return NULL;
  int r = sp_fsdp_alloc(f, cat, n, esize, &p, d);
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
  fu->padded = f->flat ? fu->c : fu->c * (int64_t)pl->shard_world;
  fu->grad_dtype = u->keep_low_precision_grads ? u->param_dtype : u->dtype;
  size_t c = (size_t)fu->c, padded = (size_t)fu->padded;
  fu->rsize = sp_dtype_size(u->reduce_dtype);
  fu->full_is_shard = f->flat && u->param_dtype == u->dtype;
  fu->grad_is_shard = f->flat && fu->grad_dtype == u->param_dtype;
  /* The sharded state lives for the runtime's life; the unsharded slots
   * come from the pool when a step needs them (fsdp_schedule.c). A flat
   * unit's shard is its unsharded parameter and, without mixed precision,
   * its shard gradient the unsharded gradient: FSDP's NO_SHARD flat
   * parameter and its .grad, one copy each. Its low-precision parameter
   * (mixed precision) is allocated here: a flat unit never reshards
   * within a step, so it would be held all along anyway. */
  int rc = 0;
  fu->shard = mem_alloc(f, SP_MEM_SHARD_PARAMS, c, fu->esize, &rc, d);
  fu->shard_grad = mem_alloc(f, SP_MEM_SHARD_GRADS, c,
                             sp_dtype_size(fu->grad_dtype), &rc, d);
  if (f->flat)
    fu->full = fu->full_is_shard
                   ? fu->shard
                   : mem_alloc(f, SP_MEM_PARAMS, padded, fu->psize, &rc, d);
  if (fu->grad_is_shard) fu->full_grad = fu->shard_grad;
  if (rc < 0)
    return sp_diag_prefix(d, rc, "unit %u (%s): %lld elements", ui,
                          sp_fsdp_unit_name(f, ui), (long long)padded);
  /* initialise the master shard parameter by parameter; the callback
   * writes host memory, so a device shard is filled through a host image */
  uint8_t *host = fu->shard;
  if (f->mem->device) {
    host = sp_fsdp_xcalloc(c, fu->esize);
    if (!host)
      return sp_diag_set(d, SP_ENOMEM,
                         "unit %u (%s): no host memory for "
                         "%zu elements",
                         ui, sp_fsdp_unit_name(f, ui), c);
  }
  size_t n = 0;
  rc = sp_plan_shard_params(pl, ui, f->rank, NULL, 0, &n);
  if (rc < 0) {
    if (host != fu->shard) free(host);
    return sp_diag_set(d, rc, "shard params of unit %u", ui);
  }
  sp_shard_param *sp = sp_fsdp_xcalloc(n, sizeof *sp);
  if (!sp) {
    if (host != fu->shard) free(host);
    return sp_diag_set(d, SP_ENOMEM, "no memory");
  }
  rc = sp_plan_shard_params(pl, ui, f->rank, sp, n, &n);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const sp_flat_entry *e = &pl->entries[sp[i].entry];
    if (f->opts.init_param)
      f->opts.init_param(f->opts.user, f->model, e->param, sp[i].intra_start,
                         sp[i].numel_in_shard,
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
  if (!opts || !out || !opts->session)
    return sp_diag_set(d, SP_EINVAL, "sp_fsdp_new: a session is required");
  *out = NULL;
  const sp_plan *pl = sp_session_plan(opts->session);
  /* a replica quorum's runtime: the shard group alone (the replica group
   * is formed per quorum, and no communicator spans the world) */
  bool quorum = pl->strategy == SP_HYBRID_SHARD && !opts->world &&
                opts->shard_group && !opts->replica_group;
  if (!opts->world && !quorum)
    return sp_diag_set(d, SP_EINVAL,
                       "sp_fsdp_new: the world communicator is required "
                       "(HYBRID_SHARD under a replica quorum: the shard "
                       "group alone)");
  if (pl->strategy == SP_HYBRID_SHARD && !quorum &&
      (!opts->shard_group || !opts->replica_group))
    return sp_diag_set(d, SP_EINVAL,
                       "HYBRID_SHARD needs the shard and "
                       "replica group communicators");
  if (!quorum && sp_comm_size(opts->world) != pl->world_size)
    return sp_diag_set(d, SP_EINVAL,
                       "world communicator has %u members, the job %u",
                       sp_comm_size(opts->world), pl->world_size);
  bool on_cpu = !opts->device || strcmp(opts->device, "cpu") == 0;
  bool staged = opts->device && strcmp(opts->device, "cpu-staged") == 0;
  sp_fsdp *f = calloc(1, sizeof *f);
  if (!f) return sp_diag_set(d, SP_ENOMEM, "no memory");
  f->mem = &sp_fsdp_host_ops;
  f->s = opts->session;
  f->plan = pl;
  f->model = pl->model;
  f->rank = sp_session_rank(opts->session);
  f->world = pl->world_size;
  f->flat = pl->shard_world == 1;
  f->opts = *opts;
  if (!f->opts.max_inflight_gathers) f->opts.max_inflight_gathers = 2;
  f->world_comm = opts->world;
  f->shard_comm = opts->shard_group;
  f->replica_comm = opts->replica_group;
  f->q_on = quorum;
  sp_fsdp_divide_factors(f->world, &f->pre_divide, &f->post_divide);
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->cv, NULL);
  sp_mem_pool_init(&f->pool, pool_alloc, pool_release, f);
  f->n_units = pl->n_units;
  f->queue_cap = 2 * pl->n_units + 16;
  f->units = sp_fsdp_xcalloc(pl->n_units, sizeof *f->units);
  f->order = sp_fsdp_xcalloc(pl->n_units, sizeof *f->order);
  f->inflight =
      sp_fsdp_xcalloc(f->opts.max_inflight_gathers + 1, sizeof *f->inflight);
  f->reducing = sp_fsdp_xcalloc(pl->n_units + 1, sizeof *f->reducing);
  f->queue = sp_fsdp_xcalloc(f->queue_cap, sizeof *f->queue);
  f->buffers = sp_fsdp_xcalloc(f->model->n_buffers, sizeof *f->buffers);
  f->buffer_dtype =
      sp_fsdp_xcalloc(f->model->n_buffers, sizeof *f->buffer_dtype);
  int rc = 0;
  if (!f->units || !f->order || !f->inflight || !f->reducing || !f->queue ||
      !f->buffers || !f->buffer_dtype)
    rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  /* the storage's home: before the first allocation. Device buffers need
   * communicators that take device pointers, i.e. have a CUDA stream; a
   * host backend would read device addresses on the host. */
  if (rc == 0 && staged) {
    f->mem = &sp_fsdp_staged_ops;
  } else if (rc == 0 && !on_cpu) {
    sp_comm *cs[3] = {f->world_comm, f->shard_comm, f->replica_comm};
    for (int i = 0; rc == 0 && i < 3; i++) {
      void *stream = NULL;
      if (cs[i] && sp_comm_cuda_stream(cs[i], &stream) < 0)
        rc = sp_diag_set(d, SP_EINVAL,
                         "device %s: the %s communicator "
                         "takes host memory; a runtime on a GPU needs NCCL "
                         "communicators (sp_fsdp_comms_open on a session "
                         "with a cuda device)",
                         opts->device,
                         i == 0   ? "world"
                         : i == 1 ? "shard-group"
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
    rc = sp_fsdp_alloc(f, SP_MEM_BUFFERS, n, es, &p, d);
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
    uint8_t *host = sp_fsdp_xcalloc(n, es);
    if (!host) {
      rc = sp_diag_set(d, SP_ENOMEM, "no host memory for buffer %s", bs->fqn);
      break;
    }
    f->opts.init_buffer(f->opts.user, f->model, (int32_t)b, host);
    rc = f->mem->from_host(f, f->buffers[b], host, n * es, d);
    free(host);
  }
  if (rc == 0 && f->q_on) rc = sp_fsdp_quorum_init(f, d);
  if (rc == 0) rc = sp_fsdp_comm_start(f, d);
  if (rc < 0) {
    sp_fsdp_free(f);
    return rc;
  }
  *out = f;
  return 0;
}

void sp_fsdp_free(sp_fsdp *f) {
  if (!f) return;
  sp_fsdp_comm_stop(f);
  sp_fsdp_quorum_free(f);
  sp_fsdp_optim_release(f);
  /* nothing may still run on the device when its memory goes */
  if (f->mem->device) {
    sp_diag ignored = {{0}};
    (void)f->mem->drain(f, SP_LANE_COMPUTE, &ignored);
    (void)f->mem->drain(f, SP_LANE_COMM, &ignored);
  }
  /* every block: the sharded state, the buffers, the pool's cache */
  sp_mem_pool_destroy(&f->pool);
  f->mem->destroy(f);
  free(f->buffers);
  free(f->buffer_dtype);
  free(f->units);
  free(f->order);
  free(f->inflight);
  free(f->reducing);
  free(f->queue);
  free(f->states);
  pthread_mutex_destroy(&f->mu);
  pthread_cond_destroy(&f->cv);
  free(f);
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
    int rc = sp_fsdp_alloc(f, SP_MEM_BUFFERS, n, sp_dtype_size(to), &nb, d);
    if (rc < 0)
      return sp_diag_prefix(d, rc, "buffer %s", f->model->buffers[b].fqn);
    rc = f->mem->cast(f, SP_LANE_COMPUTE, nb, to, f->buffers[b],
                      f->buffer_dtype[b], n, d);
    /* the old storage may still be read by the cast on the device */
    if (rc == 0) rc = f->mem->drain(f, SP_LANE_COMPUTE, d);
    if (rc < 0) {
      (void)sp_fsdp_release(f, SP_MEM_BUFFERS, nb);
      return sp_diag_set(d, rc, "casting buffer %s to %s",
                         f->model->buffers[b].fqn, sp_dtype_name(to));
    }
    (void)sp_fsdp_release(f, SP_MEM_BUFFERS, f->buffers[b]);
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
  if (!f || b < 0 || (size_t)b >= f->model->n_buffers) return SP_DTYPE_INVALID;
  return f->buffer_dtype[b];
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
  /* a frozen parameter takes no gradient (its .grad is None): its elements
   * stay zero, so they reduce to zero and no optimizer moves them */
  if (!fu || !fu->has_data || !fu->full_grad || !f->model->params[param].flag)
    return NULL;
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
  if (!f || ui >= f->n_units || !f->units[ui].has_data) return SP_DTYPE_INVALID;
  return f->units[ui].grad_dtype;
}

/* ---- device placement ---- */

/* true for GPU storage only: "cpu-staged" storage is host memory the
 * caller may use directly */
bool sp_fsdp_on_device(const sp_fsdp *f) { return f && f->dev != NULL; }

bool sp_fsdp_host_storage(const sp_fsdp *f) { return f && !f->mem->device; }

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
  if (!h)
    return sp_diag_set(d, SP_ENOMEM, "no host memory for %zu bytes", bytes);
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
  size_t bytes =
      (size_t)f->model->buffers[b].numel * sp_dtype_size(f->buffer_dtype[b]);
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
  int rc = commit(f, fu->shard, h, (size_t)fu->c * fu->esize, keep, d);
  /* a loaded shard: no unsharded copy of the old one may be served */
  if (rc == 0 && keep) rc = sp_fsdp_unit_stale(f, u, d);
  return rc;
}

uint8_t *sp_fsdp_buffer_stage(sp_fsdp *f, int32_t b, sp_diag *d) {
  size_t bytes =
      (size_t)f->model->buffers[b].numel * sp_dtype_size(f->buffer_dtype[b]);
  return stage(f, f->buffers[b], bytes, d);
}

int sp_fsdp_buffer_commit(sp_fsdp *f, int32_t b, uint8_t *h, bool keep,
                          sp_diag *d) {
  size_t bytes =
      (size_t)f->model->buffers[b].numel * sp_dtype_size(f->buffer_dtype[b]);
  return commit(f, f->buffers[b], h, bytes, keep, d);
}

void sp_fsdp_get_stats(const sp_fsdp *f, sp_fsdp_stats *out) {
  if (!f || !out) return;
  *out = f->stats;
  out->mem = f->pool.acct;
}

void sp_fsdp_reset_peak_memory(sp_fsdp *f) {
  if (f) sp_mem_pool_reset_peaks(&f->pool);
}

/* ---- communicators ---- */

int sp_fsdp_comm_opts(sp_session *s, uint64_t timeout_ms, sp_comm_opts *o,
                      char *host, size_t cap, sp_diag *d) {
  const sp_job *job = sp_session_job(s);
  /* A rank on a GPU moves device memory: NCCL, whatever the job says (its
   * backend names what CPU ranks use). */
  const char *device = sp_session_device(s);
  bool cuda = device && strncmp(device, "cuda", 4) == 0;
  *o = (sp_comm_opts){.backend = cuda ? SP_BACKEND_NCCL : job->backend,
                      .store = sp_session_comm_store(s),
                      .timeout_ms = timeout_ms,
                      .device = cuda ? device : NULL};
  /* Peers on other hosts reach this one on the network it reaches the
   * coordinator through (loopback for a local job); the variable
   * overrides it, for hosts whose collectives use another network. */
  const char *env_host = getenv(SP_GLOO_HOST_ENV);
  if (env_host != NULL && env_host[0] != '\0') return 0;
  sp_diag hd = {{0}};
  if (sp_local_addr_toward(sp_session_coordinator(s), host, cap, &hd) != 0)
    return sp_diag_set(d, SP_EIO,
                       "rank %u: cannot choose the address peers reach this "
                       "rank at (set " SP_GLOO_HOST_ENV "): %s",
                       sp_session_rank(s), hd.msg);
  o->host = host;
  return 0;
}

int sp_fsdp_comms_open(sp_session *s, uint64_t timeout_ms, sp_comm **world,
                       sp_comm **shard_group, sp_comm **replica_group,
                       sp_diag *d) {
  const sp_plan *pl = sp_session_plan(s);
  uint32_t r = sp_session_rank(s), w = pl->world_size;
  *world = *shard_group = *replica_group = NULL;
  sp_comm_opts o;
  char host[64];
  int rc = sp_fsdp_comm_opts(s, timeout_ms, &o, host, sizeof host, d);
  if (rc < 0) return rc;
  uint32_t g = pl->shard_world;
  /* under a replica quorum: the shard group alone, named by the group's
   * generation (a restarted group forms a new one beside the old keys) */
  uint32_t gen = 0;
  bool quorum = false;
  if (pl->strategy == SP_HYBRID_SHARD) {
    rc = sp_fsdp_quorum_probe(s, r / g, &quorum, &gen, d);
    if (rc < 0) return rc;
  }
  char prefix[64];
  if (!quorum) {
    o.prefix = "comm/world";
    o.rank = r;
    o.size = w;
    rc = sp_comm_new(&o, world, d);
    if (rc < 0 || pl->strategy != SP_HYBRID_SHARD) return rc;
  }
  if (quorum)
    snprintf(prefix, sizeof prefix, "comm/shard/%u/g%u", r / g, gen);
  else
    snprintf(prefix, sizeof prefix, "comm/shard/%u", r / g);
  o.prefix = prefix;
  o.rank = r % g;
  o.size = g;
  rc = sp_comm_new(&o, shard_group, d);
  if (rc == 0 && !quorum) {
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

int sp_fsdp_register_shard_state(sp_fsdp *f, const char *name, sp_dtype dt,
                                 uint8_t **per_unit, sp_diag *d) {
  if (!f || !name || !per_unit || !name[0] ||
      strlen(name) >= sizeof f->states[0].name)
    return sp_diag_set(d, SP_EINVAL, "shard state: bad name or storage");
  for (size_t i = 0; i < f->n_states; i++)
    if (strcmp(f->states[i].name, name) == 0)
      return sp_diag_set(d, SP_EEXIST, "shard state \"%s\" exists", name);
  if (f->n_states >= 8)
    return sp_diag_set(d, SP_ERANGE, "shard state \"%s\": at most 8", name);
  sp_fsdp_shard_state *n =
      realloc(f->states, (f->n_states + 1) * sizeof *f->states);
  if (!n) return sp_diag_set(d, SP_ENOMEM, "no memory");
  f->states = n;
  sp_fsdp_shard_state *st = &f->states[f->n_states++];
  snprintf(st->name, sizeof st->name, "%s", name);
  st->dtype = dt;
  st->per_unit = per_unit;
  return 0;
}
