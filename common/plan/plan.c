#include "plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/strmap.h"

/* Growable arrays used while building; the plan keeps the final pointers. */
typedef struct builder {
  const sp_model *m;
  const sp_job *job;
  sp_plan *plan;
  sp_diag *diag;
  int32_t *module_unit; /* per module: the unit module it sits in */
  int32_t *unit_of;     /* per module: unit index if it is a unit, else -1 */
  int32_t *mod_params;  /* params grouped by module (CSR) */
  uint32_t *mod_param_start;
  int32_t *mod_tied;
  uint32_t *mod_tied_start;
  size_t cap_entries, cap_aliases;
} builder;

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t c = *cap ? *cap : 64;
  while (c < need) c *= 2;
  void *q = realloc(*p, c * elem);
  if (q == NULL) return SP_ENOMEM;
  *p = q;
  *cap = c;
  return 0;
}

static int add_entry(builder *b, int32_t param, const char *fqn, int64_t offset,
                     int64_t numel) {
  sp_plan *pl = b->plan;
  if (grow((void **)&pl->entries, &b->cap_entries, pl->n_entries + 1,
           sizeof *pl->entries) != 0)
    return sp_diag_set(b->diag, SP_ENOMEM, "plan: out of memory");
  pl->entries[pl->n_entries++] = (sp_flat_entry){param, fqn, offset, numel};
  return 0;
}

static int add_alias(builder *b, const char *fqn, int32_t param) {
  sp_plan *pl = b->plan;
  if (grow((void **)&pl->aliases, &b->cap_aliases, pl->n_aliases + 1,
           sizeof *pl->aliases) != 0)
    return sp_diag_set(b->diag, SP_ENOMEM, "plan: out of memory");
  pl->aliases[pl->n_aliases++] = (sp_plan_alias){fqn, param};
  return 0;
}

/* Groups `count` items by their module index into CSR arrays. */
static int group_by_module(size_t n_modules, size_t count,
                           int32_t (*module_of)(const sp_model *, size_t),
                           const sp_model *m, int32_t **items,
                           uint32_t **start) {
  *start = calloc(n_modules + 1, sizeof **start);
  *items = malloc((count ? count : 1) * sizeof **items);
  if (*start == NULL || *items == NULL) return SP_ENOMEM;
  for (size_t i = 0; i < count; i++) (*start)[module_of(m, i) + 1]++;
  for (size_t i = 0; i < n_modules; i++) (*start)[i + 1] += (*start)[i];
  uint32_t *fill = malloc((n_modules + 1) * sizeof *fill);
  if (fill == NULL) return SP_ENOMEM;
  memcpy(fill, *start, (n_modules + 1) * sizeof *fill);
  for (size_t i = 0; i < count; i++)
    (*items)[fill[module_of(m, i)]++] = (int32_t)i;
  free(fill);
  return 0;
}

static int32_t param_module(const sp_model *m, size_t i) {
  return m->params[i].module;
}
static int32_t tied_module(const sp_model *m, size_t i) {
  return m->tied[i].module;
}

/* Needs u->dtype and u->full_precision. */
static void resolve_mixed_precision(const sp_job *job, sp_unit *u) {
  const sp_mixed_precision *mp = &job->mp;
  u->mixed_precision = mp->enabled && !u->full_precision;
  if (!u->mixed_precision) {
    u->param_dtype = u->dtype;
    u->reduce_dtype = u->dtype;
    u->buffer_dtype = SP_DTYPE_INVALID;
    u->keep_low_precision_grads = false;
    return;
  }
  /* FSDP1 (_init_param_reduce_dtypes): an unset reduce_dtype follows
   * param_dtype when that is set, else the original dtype. */
  u->param_dtype =
      mp->param_dtype != SP_DTYPE_INVALID ? mp->param_dtype : u->dtype;
  if (mp->reduce_dtype != SP_DTYPE_INVALID)
    u->reduce_dtype = mp->reduce_dtype;
  else
    u->reduce_dtype = u->param_dtype;
  u->buffer_dtype = mp->buffer_dtype;
  u->keep_low_precision_grads = mp->keep_low_precision_grads;
}

/* Adds one parameter occurrence (its own name or a tied alias) to unit u. */
static int flatten_param(builder *b, uint32_t u, int32_t p, const char *fqn,
                         int32_t *claimed, int64_t *total) {
  sp_plan *pl = b->plan;
  sp_unit *unit = &pl->units[u];
  const sp_tensor_spec *t = &b->m->params[p];
  if (claimed[p] >= 0) return add_alias(b, fqn, p); /* shared, flattened once */
  if (unit->n_params == 0) {
    unit->dtype = t->dtype;
    unit->requires_grad = t->flag;
    resolve_mixed_precision(b->job, unit);
  } else {
    const sp_flat_entry *first = NULL;
    for (size_t e = unit->first_entry; e < pl->n_entries; e++)
      if (pl->entries[e].param >= 0) {
        first = &pl->entries[e];
        break;
      }
    if (t->dtype != unit->dtype)
      return sp_diag_set(
          b->diag, SP_EFORMAT,
          "unit \"%s\": cannot flatten %s (%s) with %s (%s): a unit needs "
          "one dtype; wrap one of them as its own unit",
          b->m->modules[unit->module].fqn, fqn, sp_dtype_name(t->dtype),
          first->fqn, sp_dtype_name(unit->dtype));
    if (t->flag != unit->requires_grad && !pl->use_orig_params)
      return sp_diag_set(
          b->diag, SP_EFORMAT,
          "unit \"%s\": %s has requires_grad=%s but %s has %s; FSDP needs "
          "uniform requires_grad per unit unless use_orig_params",
          b->m->modules[unit->module].fqn, fqn, t->flag ? "true" : "false",
          first->fqn, unit->requires_grad ? "true" : "false");
    /* use_orig_params lets frozen and trainable parameters share a flat
     * parameter (FSDP's _FlatParameter with requires_grad mixed): the unit
     * takes gradients when any of them does, or the trainable ones would
     * never be reduced nor stepped */
    if (t->flag) unit->requires_grad = true;
    if (pl->use_orig_params) {
      /* _flat_param.py: pad so each param starts 16-byte aligned in the
       * dtype it is all-gathered in. */
      int64_t aligned = 16 / (int64_t)sp_dtype_size(unit->param_dtype);
      int64_t pad = aligned - *total % aligned;
      if (pad > 0 && pad < aligned) {
        int rc = add_entry(b, -1, NULL, *total, pad);
        if (rc != 0) return rc;
        *total += pad;
      }
    }
  }
  claimed[p] = (int32_t)u;
  pl->param_unit[p] = (int32_t)u;
  pl->param_entry[p] = (int32_t)pl->n_entries;
  int rc = add_entry(b, p, fqn, *total, t->numel);
  if (rc != 0) return rc;
  *total += t->numel;
  unit->n_params++;
  return 0;
}

static int flatten_unit(builder *b, uint32_t u, int32_t *claimed,
                        uint32_t pad_world) {
  sp_plan *pl = b->plan;
  sp_unit *unit = &pl->units[u];
  const sp_model *m = b->m;
  unit->first_entry = pl->n_entries;
  int64_t total = 0;
  int32_t root = unit->module;
  for (uint32_t j = (uint32_t)root; j < m->modules[root].subtree_end; j++) {
    if ((int32_t)j != root && b->unit_of[j] >= 0) {
      j = m->modules[j].subtree_end - 1; /* a nested unit owns that subtree */
      continue;
    }
    for (uint32_t k = b->mod_param_start[j]; k < b->mod_param_start[j + 1];
         k++) {
      int32_t p = b->mod_params[k];
      int rc = flatten_param(b, u, p, m->params[p].fqn, claimed, &total);
      if (rc != 0) return rc;
    }
    for (uint32_t k = b->mod_tied_start[j]; k < b->mod_tied_start[j + 1]; k++) {
      const sp_tied *t = &m->tied[b->mod_tied[k]];
      int rc = flatten_param(b, u, t->target, t->fqn, claimed, &total);
      if (rc != 0) return rc;
    }
  }
  if (pl->use_orig_params && total > 0) {
    int64_t pad = (int64_t)pad_world - total % (int64_t)pad_world;
    if (pad > 0 && pad < (int64_t)pad_world) {
      int rc = add_entry(b, -1, NULL, total, pad);
      if (rc != 0) return rc;
      total += pad;
    }
  }
  unit->n_entries = pl->n_entries - unit->first_entry;
  unit->numel = total;
  if (pl->strategy == SP_NO_SHARD)
    unit->shard_numel = total;
  else
    unit->shard_numel = (total + pl->shard_world - 1) / pl->shard_world;
  if (unit->n_params == 0) resolve_mixed_precision(b->job, unit);
  return 0;
}

/* FSDP's recursive auto-wrap wraps children before parents, left to right:
 * post-order. Ordering by (end of subtree, deeper first) gives it. */
static int cmp_postorder(const void *a, const void *b, void *model) {
  const sp_model *m = model;
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  uint32_t ex = m->modules[x].subtree_end, ey = m->modules[y].subtree_end;
  if (ex != ey) return ex < ey ? -1 : 1;
  return x > y ? -1 : (x < y);
}

typedef struct hasher {
  uint64_t h;
} hasher;

static void hash_bytes(hasher *h, const void *p, size_t n) {
  h->h = sp_fnv1a64(h->h, p, n);
}
static void hash_i64(hasher *h, int64_t v) { hash_bytes(h, &v, sizeof v); }
static void hash_str(hasher *h, const char *s) {
  /* include the NUL so "ab"+"c" and "a"+"bc" differ */
  hash_bytes(h, s != NULL ? s : "", s != NULL ? strlen(s) + 1 : 1);
}

static void compute_version(sp_plan *pl) {
  const sp_model *m = pl->model;
  hasher h = {SP_FNV1A64_INIT};
  hash_str(&h, "shardplane.plan/v1");
  hash_i64(&h, pl->world_size);
  hash_i64(&h, pl->strategy);
  hash_i64(&h, pl->shard_world);
  hash_i64(&h, pl->use_orig_params);
  for (size_t u = 0; u < pl->n_units; u++) {
    const sp_unit *x = &pl->units[u];
    hash_str(&h, m->modules[x->module].fqn);
    hash_i64(&h, x->parent);
    hash_i64(&h, x->dtype);
    hash_i64(&h, x->numel);
    hash_i64(&h, x->shard_numel);
    hash_i64(&h, x->mixed_precision);
    hash_i64(&h, x->param_dtype);
    hash_i64(&h, x->reduce_dtype);
    hash_i64(&h, x->buffer_dtype);
    hash_i64(&h, x->keep_low_precision_grads);
    for (size_t e = x->first_entry; e < x->first_entry + x->n_entries; e++) {
      const sp_flat_entry *fe = &pl->entries[e];
      hash_str(&h, fe->fqn);
      hash_i64(&h, fe->offset);
      hash_i64(&h, fe->numel);
      if (fe->param >= 0) {
        const sp_tensor_spec *t = &m->params[fe->param];
        hash_i64(&h, t->ndim);
        for (int d = 0; d < t->ndim; d++) hash_i64(&h, t->shape[d]);
      }
    }
  }
  for (size_t a = 0; a < pl->n_aliases; a++) {
    hash_str(&h, pl->aliases[a].fqn);
    hash_str(&h, m->params[pl->aliases[a].param].fqn);
  }
  for (size_t i = 0; i < pl->n_buffers; i++) {
    const sp_plan_buffer *b = &pl->buffers[i];
    const sp_tensor_spec *t = &m->buffers[b->buffer];
    hash_str(&h, t->fqn);
    hash_i64(&h, t->ndim);
    for (int d = 0; d < t->ndim; d++) hash_i64(&h, t->shape[d]);
    hash_i64(&h, b->orig_dtype);
    hash_i64(&h, b->compute_dtype);
    hash_i64(&h, b->unit);
    hash_i64(&h, b->persistent);
  }
  pl->version = h.h;
  snprintf(pl->version_hex, sizeof pl->version_hex, "%016llx",
           (unsigned long long)h.h);
}

static bool is_wrap_target(const sp_job *job, const sp_module *mod) {
  return sp_strlist_contains(&job->wrap_modules, mod->fqn) ||
         sp_strlist_contains(&job->wrap_types, mod->type) ||
         sp_job_full_precision_type(job, mod->type);
}

static int build_units(builder *b) {
  sp_plan *pl = b->plan;
  const sp_model *m = b->m;
  size_t nm = m->n_modules;
  b->unit_of = malloc(nm * sizeof *b->unit_of);
  b->module_unit = malloc(nm * sizeof *b->module_unit);
  pl->units = calloc(nm, sizeof *pl->units);
  if (b->unit_of == NULL || b->module_unit == NULL || pl->units == NULL)
    return sp_diag_set(b->diag, SP_ENOMEM, "plan: out of memory");
  for (size_t i = 0; i < nm; i++) {
    bool unit = i == 0 || is_wrap_target(b->job, &m->modules[i]);
    b->unit_of[i] = unit ? (int32_t)pl->n_units : -1;
    if (unit) {
      sp_unit *u = &pl->units[pl->n_units++];
      u->module = (int32_t)i;
      u->parent = i == 0 ? -1 : b->module_unit[m->modules[i].parent];
      u->full_precision =
          sp_job_full_precision_type(b->job, m->modules[i].type);
    }
    b->module_unit[i] =
        unit ? b->unit_of[i] : b->module_unit[m->modules[i].parent];
  }
  return 0;
}

static int build_flat_params(builder *b) {
  sp_plan *pl = b->plan;
  const sp_model *m = b->m;
  size_t np = m->n_params ? m->n_params : 1;
  int32_t *claimed = malloc(np * sizeof *claimed);
  int32_t *order = malloc(pl->n_units * sizeof *order);
  pl->param_unit = malloc(np * sizeof *pl->param_unit);
  pl->param_entry = malloc(np * sizeof *pl->param_entry);
  int rc = 0;
  if (claimed == NULL || order == NULL || pl->param_unit == NULL ||
      pl->param_entry == NULL ||
      group_by_module(m->n_modules, m->n_params, param_module, m,
                      &b->mod_params, &b->mod_param_start) != 0 ||
      group_by_module(m->n_modules, m->n_tied, tied_module, m, &b->mod_tied,
                      &b->mod_tied_start) != 0)
    rc = sp_diag_set(b->diag, SP_ENOMEM, "plan: out of memory");
  if (rc == 0) {
    for (size_t i = 0; i < m->n_params; i++) claimed[i] = -1;
    for (size_t u = 0; u < pl->n_units; u++) order[u] = pl->units[u].module;
    qsort_r(order, pl->n_units, sizeof *order, cmp_postorder, (void *)m);
    uint32_t pad_world =
        pl->strategy == SP_NO_SHARD ? pl->world_size : pl->shard_world;
    for (size_t k = 0; k < pl->n_units && rc == 0; k++) {
      uint32_t u = (uint32_t)b->unit_of[order[k]];
      rc = flatten_unit(b, u, claimed, pad_world);
    }
  }
  free(claimed);
  free(order);
  return rc;
}

static int build_buffers(builder *b) {
  sp_plan *pl = b->plan;
  const sp_model *m = b->m;
  pl->buffers = calloc(m->n_buffers ? m->n_buffers : 1, sizeof *pl->buffers);
  if (pl->buffers == NULL)
    return sp_diag_set(b->diag, SP_ENOMEM, "plan: out of memory");
  for (size_t i = 0; i < m->n_buffers; i++) {
    const sp_tensor_spec *t = &m->buffers[i];
    sp_plan_buffer *pb = &pl->buffers[pl->n_buffers++];
    pb->buffer = (int32_t)i;
    pb->orig_dtype = t->dtype;
    pb->unit = b->module_unit[t->module];
    pb->persistent = t->flag;
    sp_dtype want = pl->units[pb->unit].buffer_dtype;
    /* integer and bool buffers never change dtype */
    pb->compute_dtype =
        sp_dtype_is_floating(t->dtype) && want != SP_DTYPE_INVALID ? want
                                                                   : t->dtype;
  }
  return 0;
}

int sp_plan_build(const sp_model *model, const sp_job *job, sp_plan **out,
                  sp_diag *diag) {
  if (model == NULL || job == NULL || out == NULL) return SP_EINVAL;
  int rc = sp_job_validate(job, model, diag);
  if (rc != 0) return rc;
  sp_plan *pl = calloc(1, sizeof *pl);
  if (pl == NULL) return sp_diag_set(diag, SP_ENOMEM, "plan: out of memory");
  pl->model = model;
  pl->world_size = job->world_size;
  pl->use_orig_params = job->use_orig_params;
  pl->strategy = job->strategy;
  /* FSDP switches every strategy to NO_SHARD when the world is one rank */
  if (job->world_size == 1) pl->strategy = SP_NO_SHARD;
  switch (pl->strategy) {
    case SP_NO_SHARD: pl->shard_world = 1; break;
    case SP_HYBRID_SHARD: pl->shard_world = job->shard_group_size; break;
    default: pl->shard_world = job->world_size; break;
  }
  builder b = {.m = model, .job = job, .plan = pl, .diag = diag};
  if ((rc = build_units(&b)) == 0 && (rc = build_flat_params(&b)) == 0 &&
      (rc = build_buffers(&b)) == 0)
    compute_version(pl);
  free(b.module_unit);
  free(b.unit_of);
  free(b.mod_params);
  free(b.mod_param_start);
  free(b.mod_tied);
  free(b.mod_tied_start);
  if (rc != 0) {
    sp_plan_free(pl);
    return rc;
  }
  *out = pl;
  return 0;
}

void sp_plan_free(sp_plan *pl) {
  if (pl == NULL) return;
  free(pl->units);
  free(pl->entries);
  free(pl->buffers);
  free(pl->aliases);
  free(pl->param_unit);
  free(pl->param_entry);
  free(pl);
}

uint32_t sp_plan_shard_index(const sp_plan *pl, uint32_t rank) {
  if (pl->strategy == SP_NO_SHARD) return 0;
  if (pl->strategy == SP_HYBRID_SHARD) return rank % pl->shard_world;
  return rank;
}

int sp_plan_rank_range(const sp_plan *pl, uint32_t unit, uint32_t rank,
                       int64_t *start, int64_t *end, int64_t *padding) {
  if (unit >= pl->n_units || rank >= pl->world_size) return SP_ERANGE;
  const sp_unit *u = &pl->units[unit];
  int64_t c = u->shard_numel;
  int64_t s = (int64_t)sp_plan_shard_index(pl, rank) * c;
  int64_t e = s + c;
  if (s > u->numel) s = u->numel;
  if (e > u->numel) e = u->numel;
  if (start) *start = s;
  if (end) *end = e;
  if (padding) *padding = c - (e - s);
  return 0;
}

int sp_plan_shard_params(const sp_plan *pl, uint32_t unit, uint32_t rank,
                         sp_shard_param *out, size_t cap, size_t *n) {
  if (unit >= pl->n_units || rank >= pl->world_size || n == NULL)
    return SP_ERANGE;
  const sp_unit *u = &pl->units[unit];
  *n = 0;
  if (u->shard_numel == 0) return 0;
  /* FSDP's _get_shard_metadata, with its inclusive coordinates */
  int64_t s = (int64_t)sp_plan_shard_index(pl, rank) * u->shard_numel;
  int64_t e = s + u->shard_numel - 1;
  /* entries are contiguous, so p_end is non-decreasing: binary search the
   * first entry with p_end >= s */
  size_t lo = u->first_entry, hi = u->first_entry + u->n_entries;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const sp_flat_entry *fe = &pl->entries[mid];
    if (fe->offset + fe->numel - 1 < s)
      lo = mid + 1;
    else
      hi = mid;
  }
  size_t count = 0;
  for (size_t i = lo; i < u->first_entry + u->n_entries; i++) {
    const sp_flat_entry *fe = &pl->entries[i];
    int64_t p_start = fe->offset, p_end = fe->offset + fe->numel - 1;
    if (p_start > e) break;
    if (fe->param < 0) continue;
    if (!(s <= p_end && e >= p_start)) continue;
    if (count < cap) {
      sp_shard_param *sp = &out[count];
      sp->entry = i;
      sp->intra_start = s <= p_start ? 0 : s - p_start;
      sp->offset_in_shard = s <= p_start ? p_start - s : 0;
      sp->intra_end = (p_end < e ? p_end : e) - p_start;
      sp->numel_in_shard = sp->intra_end - sp->intra_start + 1;
    }
    count++;
  }
  *n = count;
  return 0;
}

int sp_plan_locate(const sp_plan *pl, const char *fqn, sp_param_location *out) {
  if (pl == NULL || fqn == NULL || out == NULL) return SP_EINVAL;
  int32_t p = sp_model_find_param(pl->model, fqn);
  if (p < 0) {
    int32_t t = sp_model_find_tied(pl->model, fqn);
    if (t < 0) return SP_ENOENT;
    p = pl->model->tied[t].target;
  }
  const sp_unit *u = &pl->units[pl->param_unit[p]];
  const sp_flat_entry *fe = &pl->entries[pl->param_entry[p]];
  out->param = p;
  out->unit = pl->param_unit[p];
  out->entry = (size_t)pl->param_entry[p];
  out->offset = fe->offset;
  out->numel = fe->numel;
  /* whichever name FSDP met first is the flattened one */
  out->is_alias = strcmp(fe->fqn, fqn) != 0;
  out->first_shard = out->last_shard = 0;
  if (pl->strategy != SP_NO_SHARD && u->shard_numel > 0) {
    int64_t last = fe->numel > 0 ? fe->offset + fe->numel - 1 : fe->offset;
    out->first_shard = (uint32_t)(fe->offset / u->shard_numel);
    out->last_shard = (uint32_t)(last / u->shard_numel);
    if (out->last_shard >= pl->shard_world)
      out->last_shard = pl->shard_world - 1;
    if (out->first_shard > out->last_shard) out->first_shard = out->last_shard;
  }
  return 0;
}

int32_t sp_plan_find_buffer(const sp_plan *pl, const char *fqn) {
  /* plan buffers are in model order, so the model's index is the answer */
  return sp_model_find_buffer(pl->model, fqn);
}

const char *sp_plan_unit_fqn(const sp_plan *pl, uint32_t unit) {
  if (unit >= pl->n_units) return NULL;
  return pl->model->modules[pl->units[unit].module].fqn;
}
