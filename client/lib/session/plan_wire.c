/* Rebuilding a plan from the coordinator's Plan message.
 *
 * Why rebuild instead of printing the message directly: the offline plan
 * already has its tables and JSON written against sp_plan, and the shard
 * questions (a rank's range of a unit, the parameters in a rank's shard)
 * have exactly one implementation, common/plan/plan.c, which the coordinator
 * runs too. Those functions read only the units, entries, strategy,
 * shard_world and world_size, all of which the message carries, so a
 * rebuilt plan answers them as the coordinator's own plan does.
 *
 * The message comes from the network: every index is checked here, so a
 * malformed answer is an error message, never a bad read. */
#include "plan_wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

sp_dtype sp_wire_dtype(int v) {
  return sp_dtype_valid((sp_dtype)v) ? (sp_dtype)v : SP_DTYPE_INVALID;
}

int sp_wire_job(const Shardplane__V1__Job *m, sp_job *job) {
  job->world_size = m->world_size;
  job->strategy = (sp_strategy)m->strategy;
  job->shard_group_size = m->shard_group_size;
  job->backend = (sp_backend)m->backend;
  job->use_orig_params = m->use_orig_params;
  int rc = 0;
  for (size_t i = 0; i < m->n_wrap_modules && rc == 0; i++)
    rc = sp_strlist_add(&job->wrap_modules, m->wrap_modules[i]);
  for (size_t i = 0; i < m->n_wrap_types && rc == 0; i++)
    rc = sp_strlist_add(&job->wrap_types, m->wrap_types[i]);
  const Shardplane__V1__MixedPrecision *mp = m->mixed_precision;
  if (mp != NULL) {
    job->mp.enabled = mp->enabled;
    job->mp.param_dtype = sp_wire_dtype(mp->param_dtype);
    job->mp.reduce_dtype = sp_wire_dtype(mp->reduce_dtype);
    job->mp.buffer_dtype = sp_wire_dtype(mp->buffer_dtype);
    job->mp.keep_low_precision_grads = mp->keep_low_precision_grads;
    for (size_t i = 0; i < mp->n_full_precision_types && rc == 0; i++)
      rc = sp_strlist_add(&job->mp.full_precision_types,
                          mp->full_precision_types[i]);
    /* older coordinators send no flag: a non-empty list was explicit */
    job->mp.full_precision_types_set =
        mp->full_precision_types_set || mp->n_full_precision_types > 0;
  }
  return rc;
}

static int copy_shape(const int64_t *shape, size_t n, sp_tensor_spec *t) {
  if (n > SP_MAX_DIMS) return -1;
  t->ndim = (int32_t)n;
  for (size_t d = 0; d < n; d++) t->shape[d] = shape[d];
  return 0;
}

static const char *local_name(const char *fqn) {
  const char *dot = strrchr(fqn, '.');
  return dot ? dot + 1 : fqn;
}

static int fill_units(sp_wire_plan *wp, sp_diag *diag) {
  const Shardplane__V1__Plan *m = wp->msg;
  sp_plan *pl = &wp->plan;
  sp_model *md = &wp->model;
  size_t n_entries = 0, n_params = 0;
  for (size_t u = 0; u < m->n_units; u++) {
    const Shardplane__V1__Unit *x = m->units[u];
    if (x->index != u)
      return sp_diag_set(diag, SP_EFORMAT, "unit %u is listed at %zu", x->index,
                         u);
    if (x->parent < -1 || x->parent >= (int32_t)m->n_units)
      return sp_diag_set(diag, SP_EFORMAT, "unit %zu has parent %d", u,
                         x->parent);
    n_entries += x->n_entries;
    for (size_t e = 0; e < x->n_entries; e++)
      n_params += !x->entries[e]->padding;
  }
  md->modules = calloc(m->n_units, sizeof *md->modules);
  pl->units = calloc(m->n_units, sizeof *pl->units);
  pl->entries = calloc(n_entries + 1, sizeof *pl->entries);
  md->params = calloc(n_params + 1, sizeof *md->params);
  pl->param_unit = calloc(n_params + 1, sizeof *pl->param_unit);
  pl->param_entry = calloc(n_params + 1, sizeof *pl->param_entry);
  if (!md->modules || !pl->units || !pl->entries || !md->params ||
      !pl->param_unit || !pl->param_entry)
    return sp_diag_set(diag, SP_ENOMEM, "out of memory");
  for (size_t u = 0; u < m->n_units; u++) {
    const Shardplane__V1__Unit *x = m->units[u];
    sp_module *mod = &md->modules[u];
    mod->fqn = x->module_fqn;
    mod->type = x->module_type;
    mod->parent = -1; /* the module tree is not part of a plan */
    mod->subtree_end = (uint32_t)u + 1;
    sp_unit *su = &pl->units[u];
    su->module = (int32_t)u;
    su->parent = x->parent;
    su->first_entry = pl->n_entries;
    su->n_entries = x->n_entries;
    su->dtype = sp_wire_dtype(x->dtype);
    su->requires_grad = x->requires_grad;
    su->numel = x->numel;
    su->shard_numel = x->shard_numel;
    su->full_precision = x->full_precision;
    su->mixed_precision = x->mixed_precision;
    su->param_dtype = sp_wire_dtype(x->param_dtype);
    su->reduce_dtype = sp_wire_dtype(x->reduce_dtype);
    su->buffer_dtype = sp_wire_dtype(x->buffer_dtype);
    su->keep_low_precision_grads = x->keep_low_precision_grads;
    if (x->numel < 0 || x->shard_numel < 0)
      return sp_diag_set(diag, SP_EFORMAT, "unit %zu has a negative size", u);
    for (size_t e = 0; e < x->n_entries; e++) {
      const Shardplane__V1__FlatEntry *fe = x->entries[e];
      sp_flat_entry *se = &pl->entries[pl->n_entries];
      se->offset = fe->offset;
      se->numel = fe->numel;
      se->param = -1;
      if (!fe->padding) {
        size_t p = md->n_params++;
        sp_tensor_spec *t = &md->params[p];
        if (copy_shape(fe->shape, fe->n_shape, t) != 0)
          return sp_diag_set(diag, SP_EFORMAT,
                             "parameter \"%.200s\" has %zu "
                             "dimensions",
                             fe->fqn, fe->n_shape);
        t->fqn = fe->fqn;
        t->local_name = local_name(fe->fqn);
        t->module = (int32_t)u;
        t->numel = fe->numel;
        t->dtype = su->dtype;
        t->flag = x->requires_grad;
        se->param = (int32_t)p;
        se->fqn = fe->fqn;
        pl->param_unit[p] = (int32_t)u;
        pl->param_entry[p] = (int32_t)pl->n_entries;
        su->n_params++;
      }
      pl->n_entries++;
    }
  }
  pl->n_units = m->n_units;
  md->n_modules = m->n_units;
  return 0;
}

static int fill_buffers(sp_wire_plan *wp, sp_diag *diag) {
  const Shardplane__V1__Plan *m = wp->msg;
  sp_plan *pl = &wp->plan;
  sp_model *md = &wp->model;
  md->buffers = calloc(m->n_buffers + 1, sizeof *md->buffers);
  pl->buffers = calloc(m->n_buffers + 1, sizeof *pl->buffers);
  if (md->buffers == NULL || pl->buffers == NULL)
    return sp_diag_set(diag, SP_ENOMEM, "out of memory");
  for (size_t i = 0; i < m->n_buffers; i++) {
    const Shardplane__V1__BufferInfo *b = m->buffers[i];
    sp_tensor_spec *t = &md->buffers[i];
    if (copy_shape(b->shape, b->n_shape, t) != 0 ||
        b->owner_unit >= pl->n_units)
      return sp_diag_set(diag, SP_EFORMAT, "buffer \"%.200s\" is malformed",
                         b->fqn);
    t->fqn = b->fqn;
    t->local_name = local_name(b->fqn);
    t->module = (int32_t)b->owner_unit;
    t->dtype = sp_wire_dtype(b->original_dtype);
    t->flag = b->persistent;
    t->numel = 1;
    for (size_t d = 0; d < b->n_shape; d++) t->numel *= b->shape[d];
    pl->buffers[i] =
        (sp_plan_buffer){(int32_t)i, t->dtype, sp_wire_dtype(b->compute_dtype),
                         (int32_t)b->owner_unit, b->persistent};
  }
  md->n_buffers = pl->n_buffers = m->n_buffers;
  return 0;
}

static int fill_aliases(sp_wire_plan *wp, sp_diag *diag) {
  const Shardplane__V1__Plan *m = wp->msg;
  sp_plan *pl = &wp->plan;
  pl->aliases = calloc(m->n_aliases + 1, sizeof *pl->aliases);
  if (pl->aliases == NULL) return sp_diag_set(diag, SP_ENOMEM, "out of memory");
  for (size_t a = 0; a < m->n_aliases; a++) {
    const Shardplane__V1__Alias *al = m->aliases[a];
    /* a handful of tied names per model: a linear search is enough */
    int32_t param = -1;
    for (size_t p = 0; p < wp->model.n_params && param < 0; p++)
      if (strcmp(wp->model.params[p].fqn, al->flattened_as) == 0)
        param = (int32_t)p;
    if (param < 0)
      return sp_diag_set(diag, SP_EFORMAT,
                         "\"%.200s\" is shared with \"%.200s\""
                         ", which is not in the plan",
                         al->fqn, al->flattened_as);
    pl->aliases[pl->n_aliases++] = (sp_plan_alias){al->fqn, param};
  }
  return 0;
}

int sp_wire_plan_new(Shardplane__V1__Plan *msg, sp_wire_plan **out,
                     sp_diag *diag) {
  sp_wire_plan *wp = calloc(1, sizeof *wp);
  if (wp == NULL) {
    protobuf_c_message_free_unpacked(&msg->base, NULL);
    return sp_diag_set(diag, SP_ENOMEM, "out of memory");
  }
  wp->msg = msg;
  sp_job_init(&wp->job);
  sp_plan *pl = &wp->plan;
  wp->model.name = msg->model_name;
  pl->model = &wp->model;
  int rc;
  if (msg->job == NULL || msg->job->world_size == 0 ||
      msg->job->world_size > SP_JOB_MAX_WORLD || msg->n_units == 0) {
    rc = sp_diag_set(diag, SP_EFORMAT, "the plan has no job or no units");
    goto fail;
  }
  if ((rc = sp_wire_job(msg->job, &wp->job)) != 0) {
    sp_diag_set(diag, rc, "the plan's job: %s", sp_strerror(rc));
    goto fail;
  }
  pl->world_size = msg->job->world_size;
  pl->use_orig_params = msg->job->use_orig_params;
  pl->strategy = (sp_strategy)msg->effective_strategy;
  pl->shard_world = msg->shard_world;
  /* the shard math divides by shard_world and indexes shards by it */
  if (pl->strategy < SP_FULL_SHARD || pl->strategy > SP_HYBRID_SHARD ||
      pl->shard_world == 0 || pl->shard_world > pl->world_size) {
    rc = sp_diag_set(diag, SP_EFORMAT, "strategy %d over %u of %u ranks",
                     (int)msg->effective_strategy, msg->shard_world,
                     pl->world_size);
    goto fail;
  }
  snprintf(pl->version_hex, sizeof pl->version_hex, "%s", msg->version);
  if ((rc = fill_units(wp, diag)) != 0 || (rc = fill_buffers(wp, diag)) != 0 ||
      (rc = fill_aliases(wp, diag)) != 0)
    goto fail;
  *out = wp;
  return 0;
fail:
  sp_wire_plan_free(wp);
  return rc;
}

void sp_wire_plan_free(sp_wire_plan *wp) {
  if (wp == NULL) return;
  free(wp->model.modules);
  free(wp->model.params);
  free(wp->model.buffers);
  free(wp->plan.units);
  free(wp->plan.entries);
  free(wp->plan.buffers);
  free(wp->plan.aliases);
  free(wp->plan.param_unit);
  free(wp->plan.param_entry);
  sp_job_clear(&wp->job);
  protobuf_c_message_free_unpacked(&wp->msg->base, NULL);
  free(wp);
}

static int wire_bytes(const Shardplane__V1__MemoryBytes *b, const char *what,
                      sp_mem_bytes *out, sp_diag *diag) {
  if (b == NULL)
    return sp_diag_set(diag, SP_EFORMAT, "memory: no %s bytes", what);
  out->peak = b->peak;
  out->current = b->current;
  return 0;
}

int sp_wire_memory(const Shardplane__V1__MemoryEstimate *m,
                   sp_mem_estimate *out, sp_diag *diag) {
  memset(out, 0, sizeof *out);
  if (m == NULL)
    return sp_diag_set(diag, SP_EFORMAT,
                       "no memory estimate in the answer "
                       "(a coordinator older than GetPlan.with_memory?)");
  if (m->n_categories != SP_MEM_N_CATS)
    return sp_diag_set(diag, SP_EFORMAT,
                       "memory: %zu categories, this "
                       "build has %d",
                       m->n_categories, SP_MEM_N_CATS);
  for (int k = 0; k < SP_MEM_N_CATS; k++) {
    const Shardplane__V1__MemoryBytes *b = m->categories[k];
    const char *want = sp_mem_cat_name((sp_mem_cat)k);
    if (b == NULL || b->category == NULL || strcmp(b->category, want) != 0)
      return sp_diag_set(diag, SP_EFORMAT,
                         "memory: category %d is \"%.64s\""
                         ", this build's is \"%s\"",
                         k, b && b->category ? b->category : "", want);
    wire_bytes(b, want, &out->acct.cat[k], diag);
  }
  int rc = wire_bytes(m->total, "total", &out->acct.total, diag);
  if (rc == 0)
    rc = wire_bytes(m->reserved, "reserved", &out->acct.reserved, diag);
  if (rc < 0) return rc;
  const Shardplane__V1__MemoryOptions *o = m->options;
  sp_mem_opts_default(&out->opts);
  if (o != NULL) {
    int opt = (int)o->optimizer;
    if (opt != 0 && (opt < SP_MEM_OPT_NONE || opt > SP_MEM_OPT_ADAMW))
      return sp_diag_set(diag, SP_EFORMAT, "memory: optimizer %d", opt);
    if (opt != 0) out->opts.optimizer = (sp_mem_optimizer)opt;
    if (o->max_inflight_gathers)
      out->opts.max_inflight = o->max_inflight_gathers;
    out->opts.backward_prefetch = !o->no_backward_prefetch;
    out->opts.no_sync = o->no_sync;
  }
  out->acct.allocs = m->allocs;
  out->sharded_state = m->sharded_state;
  out->in_flight_floor = m->in_flight_floor;
  return 0;
}
