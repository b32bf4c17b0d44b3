/* Plan and model queries: GetJob, GetPlan, LocateParam, ListModules,
 * ListBuffers, GetModelSpec. All answers come from the immutable plan, so handlers are
 * plain functions of the request. */
#include "coord_plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_alerts.h"
#include "coord_base.h"
#include "coord_ranks.h"
#include "coord_verdict.h"
#include "coord_quorum.h"
#include "plan/memory.h"

typedef Shardplane__V1__DType PDType;

/* Arena for the pointers a response message borrows: everything is freed
 * together once the message has been packed. */
typedef struct arena {
  void **p;
  size_t n, cap;
  bool failed;
} arena;

static void *arena_alloc(arena *a, size_t size) {
  if (a->failed) return NULL;
  if (a->n == a->cap) {
    size_t cap = a->cap ? a->cap * 2 : 64;
    void **p = realloc(a->p, cap * sizeof *p);
    if (p == NULL) {
      a->failed = true;
      return NULL;
    }
    a->p = p;
    a->cap = cap;
  }
  void *x = calloc(1, size ? size : 1);
  if (x == NULL) {
    a->failed = true;
    return NULL;
  }
  a->p[a->n++] = x;
  return x;
}

#define ANEW(a, T, n) ((T *)arena_alloc((a), sizeof(T) * (n)))

static void arena_free(arena *a) {
  for (size_t i = 0; i < a->n; i++) free(a->p[i]);
  free(a->p);
}

/* Answers with msg unless building it ran out of memory. */
static void reply(sp_rpc_call *call, arena *a, const ProtobufCMessage *msg) {
  if (a->failed)
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
  else
    sp_rpc_call_reply(call, msg);
}

static sp_coord *coord_of(sp_rpc_call *call) {
  return sp_rpc_call_method_user(call);
}

static int64_t *shape_of(arena *a, const sp_tensor_spec *t, size_t *n) {
  int64_t *s = ANEW(a, int64_t, t->ndim ? (size_t)t->ndim : 1);
  if (s != NULL)
    for (int d = 0; d < t->ndim; d++) s[d] = t->shape[d];
  *n = (size_t)t->ndim;
  return s;
}

static Shardplane__V1__Job *job_msg(arena *a, const sp_job *j) {
  Shardplane__V1__Job *m = ANEW(a, Shardplane__V1__Job, 1);
  Shardplane__V1__MixedPrecision *mp =
      ANEW(a, Shardplane__V1__MixedPrecision, 1);
  if (m == NULL || mp == NULL) return NULL;
  shardplane__v1__job__init(m);
  shardplane__v1__mixed_precision__init(mp);
  m->world_size = j->world_size;
  m->strategy = (Shardplane__V1__ShardingStrategy)j->strategy;
  m->shard_group_size = j->shard_group_size;
  m->n_wrap_modules = j->wrap_modules.n;
  m->wrap_modules = j->wrap_modules.items;
  m->n_wrap_types = j->wrap_types.n;
  m->wrap_types = j->wrap_types.items;
  m->backend = (Shardplane__V1__Backend)j->backend;
  m->use_orig_params = j->use_orig_params;
  mp->enabled = j->mp.enabled;
  mp->param_dtype = (PDType)j->mp.param_dtype;
  mp->reduce_dtype = (PDType)j->mp.reduce_dtype;
  mp->buffer_dtype = (PDType)j->mp.buffer_dtype;
  mp->keep_low_precision_grads = j->mp.keep_low_precision_grads;
  mp->n_full_precision_types = j->mp.full_precision_types.n;
  mp->full_precision_types = j->mp.full_precision_types.items;
  /* an explicit empty list differs from the default one */
  mp->full_precision_types_set = j->mp.full_precision_types_set;
  m->mixed_precision = mp;
  return m;
}

static void on_get_job(sp_rpc_call *call, const ProtobufCMessage *msg,
                       const uint8_t *raw, size_t len) {
  (void)msg;
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const sp_plan *pl = c->plan;
  arena a = {0};
  Shardplane__V1__GetJobResponse r = SHARDPLANE__V1__GET_JOB_RESPONSE__INIT;
  Shardplane__V1__RankSummary rs = SHARDPLANE__V1__RANK_SUMMARY__INIT;
  uint32_t by_state[SP_STATE_MAX + 1] = {0};
  sp_coord_ranks_summary(c, &rs, by_state, SP_ROOT_SUMMON_FULL_PARAMS + 1);
  r.model_name = c->model->name;
  r.plan_version = (char *)pl->version_hex;
  r.job = job_msg(&a, &c->job);
  r.effective_strategy = (Shardplane__V1__ShardingStrategy)pl->strategy;
  r.n_modules = (uint32_t)c->model->n_modules;
  r.n_params = (uint32_t)c->model->n_params;
  r.n_buffers = (uint32_t)c->model->n_buffers;
  r.n_units = (uint32_t)pl->n_units;
  for (size_t i = 0; i < c->model->n_params; i++)
    r.total_numel += c->model->params[i].numel;
  r.ranks = &rs;
  r.alerts = (uint32_t)sp_coord_alerts_total(c);
  Shardplane__V1__Alert *recent[SP_COORD_ALERTS_RECENT];
  r.n_recent_alerts = sp_coord_alerts_recent(c, recent, SP_COORD_ALERTS_RECENT);
  r.recent_alerts = recent;
  r.uptime_ms = sp_coord_base_now_ms(c);
  Shardplane__V1__Progress progress;
  sp_coord_verdict_job(c, &r, &progress);
  r.quorum = sp_coord_quorum_report(c);
  reply(call, &a, &r.base);
  free(r.quorum);
  arena_free(&a);
}

static Shardplane__V1__Unit *unit_msg(arena *a, const sp_plan *pl, uint32_t u) {
  const sp_unit *x = &pl->units[u];
  const sp_model *m = pl->model;
  Shardplane__V1__Unit *um = ANEW(a, Shardplane__V1__Unit, 1);
  Shardplane__V1__FlatEntry **ents =
      ANEW(a, Shardplane__V1__FlatEntry *, x->n_entries + 1);
  Shardplane__V1__FlatEntry *ev =
      ANEW(a, Shardplane__V1__FlatEntry, x->n_entries + 1);
  if (um == NULL || ents == NULL || ev == NULL) return NULL;
  shardplane__v1__unit__init(um);
  um->index = u;
  um->module_fqn = (char *)m->modules[x->module].fqn;
  um->module_type = (char *)m->modules[x->module].type;
  um->parent = x->parent;
  um->dtype = (PDType)x->dtype;
  um->requires_grad = x->requires_grad;
  um->numel = x->numel;
  um->shard_numel = x->shard_numel;
  um->full_precision = x->full_precision;
  um->mixed_precision = x->mixed_precision;
  um->param_dtype = (PDType)x->param_dtype;
  um->reduce_dtype = (PDType)x->reduce_dtype;
  um->buffer_dtype = (PDType)x->buffer_dtype;
  um->keep_low_precision_grads = x->keep_low_precision_grads;
  for (size_t i = 0; i < x->n_entries; i++) {
    const sp_flat_entry *fe = &pl->entries[x->first_entry + i];
    Shardplane__V1__FlatEntry *e = &ev[i];
    shardplane__v1__flat_entry__init(e);
    e->offset = fe->offset;
    e->numel = fe->numel;
    if (fe->param >= 0) {
      e->fqn = (char *)fe->fqn;
      e->shape = shape_of(a, &m->params[fe->param], &e->n_shape);
    } else {
      e->padding = true;
    }
    ents[i] = e;
  }
  um->n_entries = x->n_entries;
  um->entries = ents;
  return um;
}

void sp_coord_plan_buffer_row(const sp_plan *pl, size_t i,
                              sp_coord_buffer_row *r) {
  const sp_plan_buffer *b = &pl->buffers[i];
  r->spec = &pl->model->buffers[b->buffer];
  r->fqn = r->spec->fqn;
  r->orig_dtype = b->orig_dtype;
  r->compute_dtype = b->compute_dtype;
  r->owner_unit = (uint32_t)b->unit;
  r->persistent = b->persistent;
}

size_t sp_coord_plan_buffer_page(const sp_plan *pl, const char *prefix,
                                 size_t start, size_t cap, size_t *idx,
                                 size_t *n) {
  size_t prefix_len = prefix != NULL ? strlen(prefix) : 0, matched = 0;
  *n = 0;
  for (size_t i = 0; i < pl->n_buffers; i++) {
    const char *fqn = pl->model->buffers[pl->buffers[i].buffer].fqn;
    if (prefix_len && strncmp(fqn, prefix, prefix_len) != 0) continue;
    if (matched++ >= start && *n < cap) idx[(*n)++] = i;
  }
  return matched;
}

static Shardplane__V1__BufferInfo *buffer_msg(arena *a, const sp_plan *pl,
                                              size_t i) {
  sp_coord_buffer_row b;
  sp_coord_plan_buffer_row(pl, i, &b);
  Shardplane__V1__BufferInfo *bm = ANEW(a, Shardplane__V1__BufferInfo, 1);
  if (bm == NULL) return NULL;
  shardplane__v1__buffer_info__init(bm);
  bm->fqn = (char *)b.fqn;
  bm->shape = shape_of(a, b.spec, &bm->n_shape);
  bm->original_dtype = (PDType)b.orig_dtype;
  bm->compute_dtype = (PDType)b.compute_dtype;
  bm->owner_unit = b.owner_unit;
  bm->persistent = b.persistent;
  return bm;
}

/* One rank's shard of every unit, parameter by parameter. */
static int rank_shards(arena *a, const sp_plan *pl, uint32_t rank,
                       Shardplane__V1__Plan *p) {
  p->shards = ANEW(a, Shardplane__V1__RankShard *, pl->n_units + 1);
  if (p->shards == NULL) return SP_ENOMEM;
  for (uint32_t u = 0; u < pl->n_units; u++) {
    size_t n;
    sp_plan_shard_params(pl, u, rank, NULL, 0, &n);
    sp_shard_param *sp = ANEW(a, sp_shard_param, n + 1);
    Shardplane__V1__RankShard *rs = ANEW(a, Shardplane__V1__RankShard, 1);
    Shardplane__V1__ShardParam *pv = ANEW(a, Shardplane__V1__ShardParam, n + 1);
    Shardplane__V1__ShardParam **pp =
        ANEW(a, Shardplane__V1__ShardParam *, n + 1);
    if (sp == NULL || rs == NULL || pv == NULL || pp == NULL) return SP_ENOMEM;
    sp_plan_shard_params(pl, u, rank, sp, n, &n);
    shardplane__v1__rank_shard__init(rs);
    rs->rank = rank;
    rs->unit = u;
    sp_plan_rank_range(pl, u, rank, &rs->start, &rs->end, &rs->padding);
    for (size_t i = 0; i < n; i++) {
      shardplane__v1__shard_param__init(&pv[i]);
      pv[i].fqn = (char *)pl->entries[sp[i].entry].fqn;
      pv[i].offset_in_shard = sp[i].offset_in_shard;
      pv[i].numel_in_shard = sp[i].numel_in_shard;
      pv[i].intra_start = sp[i].intra_start;
      pv[i].intra_end = sp[i].intra_end;
      pp[i] = &pv[i];
    }
    rs->n_params = n;
    rs->params = pp;
    p->shards[p->n_shards++] = rs;
  }
  return 0;
}

static long find_unit(const sp_plan *pl,
                      const Shardplane__V1__GetPlanRequest *q) {
  if (q->unit_fqn != NULL && q->unit_fqn[0] != '\0') {
    for (uint32_t u = 0; u < pl->n_units; u++)
      if (strcmp(sp_plan_unit_fqn(pl, u), q->unit_fqn) == 0) return (long)u;
    return -1;
  }
  return q->unit < pl->n_units ? (long)q->unit : -1;
}

/* ---- the memory model ---- */

/* The options of a GetPlan request as the model takes them, or -1 with
 * the INVALID_ARGUMENT message in err naming the field and value. */
static int memory_opts(const Shardplane__V1__MemoryOptions *m, sp_mem_opts *o,
                       char *err, size_t cap) {
  sp_mem_opts_default(o);
  if (m == NULL) return 0;
  int opt = (int)m->optimizer;
  if (opt != 0 && (opt < SP_MEM_OPT_NONE || opt > SP_MEM_OPT_ADAMW)) {
    snprintf(err, cap,
             "memory.optimizer %d: expected OPTIMIZER_NONE (1), "
             "OPTIMIZER_SGD (2), OPTIMIZER_SGD_MOMENTUM (3) or "
             "OPTIMIZER_ADAMW (4)",
             opt);
    return -1;
  }
  if (m->max_inflight_gathers > SP_MEM_MAX_INFLIGHT) {
    snprintf(err, cap, "memory.max_inflight_gathers %u: at most %u",
             m->max_inflight_gathers, SP_MEM_MAX_INFLIGHT);
    return -1;
  }
  if (opt != 0) o->optimizer = (sp_mem_optimizer)opt;
  if (m->max_inflight_gathers) o->max_inflight = m->max_inflight_gathers;
  o->backward_prefetch = !m->no_backward_prefetch;
  o->no_sync = m->no_sync;
  return 0;
}

static Shardplane__V1__MemoryBytes *mem_bytes(arena *a, const char *cat,
                                              const sp_mem_bytes *b) {
  Shardplane__V1__MemoryBytes *m = ANEW(a, Shardplane__V1__MemoryBytes, 1);
  if (m == NULL) return NULL;
  shardplane__v1__memory_bytes__init(m);
  m->category = (char *)cat;
  m->peak = b->peak;
  m->current = b->current;
  return m;
}

static Shardplane__V1__MemoryEstimate *memory_msg(arena *a,
                                                  const sp_mem_estimate *e) {
  Shardplane__V1__MemoryEstimate *m =
      ANEW(a, Shardplane__V1__MemoryEstimate, 1);
  Shardplane__V1__MemoryOptions *o = ANEW(a, Shardplane__V1__MemoryOptions, 1);
  Shardplane__V1__MemoryBytes **cats =
      ANEW(a, Shardplane__V1__MemoryBytes *, SP_MEM_N_CATS);
  if (m == NULL || o == NULL || cats == NULL) return NULL;
  shardplane__v1__memory_estimate__init(m);
  shardplane__v1__memory_options__init(o);
  o->optimizer = (Shardplane__V1__Optimizer)e->opts.optimizer;
  o->max_inflight_gathers = e->opts.max_inflight;
  o->no_backward_prefetch = !e->opts.backward_prefetch;
  o->no_sync = e->opts.no_sync;
  m->options = o;
  m->categories = cats;
  for (int k = 0; k < SP_MEM_N_CATS; k++)
    if ((cats[m->n_categories] = mem_bytes(a, sp_mem_cat_name((sp_mem_cat)k),
                                           &e->acct.cat[k])) != NULL)
      m->n_categories++;
  m->total = mem_bytes(a, "total", &e->acct.total);
  m->reserved = mem_bytes(a, "reserved", &e->acct.reserved);
  m->allocs = e->acct.allocs;
  m->sharded_state = e->sharded_state;
  m->in_flight_floor = e->in_flight_floor;
  return m;
}

static void on_get_plan(sp_rpc_call *call, const ProtobufCMessage *msg,
                        const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const sp_plan *pl = c->plan;
  const Shardplane__V1__GetPlanRequest *q =
      (const Shardplane__V1__GetPlanRequest *)msg;
  if (!sp_coord_base_text_ok(call, "GetPlanRequest", "unit_fqn", q->unit_fqn,
                             SP_COORD_MAX_NAME))
    return;
  if (q->by_rank && q->rank >= pl->world_size) {
    sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                        "rank %u is out of range: the world has ranks 0-%u",
                        q->rank, pl->world_size - 1);
    return;
  }
  long unit = -1;
  if (q->by_unit && (unit = find_unit(pl, q)) < 0) {
    if (q->unit_fqn != NULL && q->unit_fqn[0] != '\0')
      sp_rpc_call_finishf(call, SP_RPC_NOT_FOUND,
                          "no unit wraps module \"%.200s\"", q->unit_fqn);
    else
      sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                          "unit %u is out of range: the plan has units 0-%zu",
                          q->unit, pl->n_units - 1);
    return;
  }
  sp_mem_estimate mem;
  if (q->with_memory) {
    sp_mem_opts mo;
    char err[256];
    if (memory_opts(q->memory, &mo, err, sizeof err) < 0) {
      sp_rpc_call_finish(call, SP_RPC_INVALID_ARGUMENT, err);
      return;
    }
    sp_diag d = {""};
    int rc = sp_mem_estimate_plan(pl, &mo, &mem, &d);
    if (rc < 0) {
      sp_rpc_call_finishf(
          call,
          rc == SP_ENOMEM ? SP_RPC_RESOURCE_EXHAUSTED : SP_RPC_INVALID_ARGUMENT,
          "memory model: %.300s", d.msg);
      return;
    }
  }
  arena a = {0};
  Shardplane__V1__Plan p = SHARDPLANE__V1__PLAN__INIT;
  p.version = (char *)pl->version_hex;
  if (q->with_memory && (p.memory = memory_msg(&a, &mem)) == NULL)
    a.failed = true;
  p.model_name = c->model->name;
  p.job = job_msg(&a, &c->job);
  p.effective_strategy = (Shardplane__V1__ShardingStrategy)pl->strategy;
  p.shard_world = pl->shard_world;
  p.units = ANEW(&a, Shardplane__V1__Unit *, pl->n_units);
  if (p.units != NULL) {
    for (uint32_t u = 0; u < pl->n_units; u++)
      if (unit < 0 || (long)u == unit)
        p.units[p.n_units++] = unit_msg(&a, pl, u);
  }
  if (!q->by_unit && !q->by_rank) {
    /* the whole plan: buffers and aliases too */
    p.buffers = ANEW(&a, Shardplane__V1__BufferInfo *, pl->n_buffers + 1);
    if (p.buffers != NULL)
      for (size_t i = 0; i < pl->n_buffers; i++)
        p.buffers[p.n_buffers++] = buffer_msg(&a, pl, i);
    p.aliases = ANEW(&a, Shardplane__V1__Alias *, pl->n_aliases + 1);
    Shardplane__V1__Alias *av =
        ANEW(&a, Shardplane__V1__Alias, pl->n_aliases + 1);
    if (p.aliases != NULL && av != NULL)
      for (size_t i = 0; i < pl->n_aliases; i++) {
        shardplane__v1__alias__init(&av[i]);
        av[i].fqn = (char *)pl->aliases[i].fqn;
        av[i].flattened_as =
            (char *)pl->entries[pl->param_entry[pl->aliases[i].param]].fqn;
        p.aliases[p.n_aliases++] = &av[i];
      }
  }
  if (q->by_rank && rank_shards(&a, pl, q->rank, &p) != 0) a.failed = true;
  reply(call, &a, &p.base);
  arena_free(&a);
}

static void on_locate(sp_rpc_call *call, const ProtobufCMessage *msg,
                      const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const sp_plan *pl = c->plan;
  const Shardplane__V1__LocateParamRequest *q =
      (const Shardplane__V1__LocateParamRequest *)msg;
  if (!sp_coord_base_text_ok(call, "LocateParamRequest", "fqn", q->fqn,
                             SP_COORD_MAX_NAME))
    return;
  sp_param_location loc;
  if (sp_plan_locate(pl, q->fqn, &loc) != 0) {
    sp_rpc_call_finishf(call, SP_RPC_NOT_FOUND, "no parameter \"%.300s\"",
                        q->fqn);
    return;
  }
  arena a = {0};
  const sp_tensor_spec *t = &pl->model->params[loc.param];
  Shardplane__V1__ParamLocation r = SHARDPLANE__V1__PARAM_LOCATION__INIT;
  r.fqn = q->fqn;
  r.flattened_as = (char *)pl->entries[loc.entry].fqn;
  r.is_alias = loc.is_alias;
  r.unit = (uint32_t)loc.unit;
  r.unit_fqn = (char *)sp_plan_unit_fqn(pl, (uint32_t)loc.unit);
  r.shape = shape_of(&a, t, &r.n_shape);
  r.dtype = (PDType)t->dtype;
  r.offset = loc.offset;
  r.numel = loc.numel;
  r.strategy = (Shardplane__V1__ShardingStrategy)pl->strategy;
  r.shard_world = pl->shard_world;
  r.world_size = pl->world_size;
  size_t n = loc.last_shard - loc.first_shard + 1;
  r.slices = ANEW(&a, Shardplane__V1__ParamSlice *, n);
  Shardplane__V1__ParamSlice *sv = ANEW(&a, Shardplane__V1__ParamSlice, n);
  sp_shard_param *sp =
      ANEW(&a, sp_shard_param, pl->units[loc.unit].n_entries + 1);
  if (r.slices != NULL && sv != NULL && sp != NULL) {
    /* the slice of this param in each shard index that holds part of it */
    for (uint32_t s = loc.first_shard; s <= loc.last_shard; s++) {
      size_t k;
      sp_plan_shard_params(pl, (uint32_t)loc.unit, s, sp,
                           pl->units[loc.unit].n_entries, &k);
      for (size_t i = 0; i < k; i++) {
        if (sp[i].entry != loc.entry) continue;
        Shardplane__V1__ParamSlice *ps = &sv[r.n_slices];
        shardplane__v1__param_slice__init(ps);
        ps->shard = s;
        ps->offset_in_shard = sp[i].offset_in_shard;
        ps->numel = sp[i].numel_in_shard;
        ps->intra_start = sp[i].intra_start;
        ps->intra_end = sp[i].intra_end;
        r.slices[r.n_slices++] = ps;
      }
    }
  }
  reply(call, &a, &r.base);
  arena_free(&a);
}

/* Page tokens are decimal start indices; anything else is refused. */
static int parse_page(sp_rpc_call *call, const char *token, uint32_t size,
                      size_t total, size_t *start, size_t *count) {
  *start = 0;
  if (token != NULL && token[0] != '\0') {
    char *end;
    unsigned long long v = strtoull(token, &end, 10);
    if (*end != '\0' || v > total) {
      sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                          "bad page_token \"%.40s\"", token);
      return -1;
    }
    *start = (size_t)v;
  }
  *count = size == 0 || size > 1000 ? 1000 : size;
  return 0;
}

static void on_list_modules(sp_rpc_call *call, const ProtobufCMessage *msg,
                            const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const sp_model *m = c->model;
  const sp_plan *pl = c->plan;
  const Shardplane__V1__ListModulesRequest *q =
      (const Shardplane__V1__ListModulesRequest *)msg;
  size_t start, count;
  if (!sp_coord_base_text_ok(call, "ListModulesRequest", "prefix", q->prefix,
                             SP_COORD_MAX_NAME) ||
      !sp_coord_base_text_ok(call, "ListModulesRequest", "page_token",
                             q->page_token, SP_COORD_MAX_PAGE_TOKEN))
    return;
  if (parse_page(call, q->page_token, q->page_size, m->n_modules, &start,
                 &count) != 0)
    return;
  arena a = {0};
  Shardplane__V1__ListModulesResponse r =
      SHARDPLANE__V1__LIST_MODULES_RESPONSE__INIT;
  r.modules = ANEW(&a, Shardplane__V1__ModuleInfo *, count);
  Shardplane__V1__ModuleInfo *mv = ANEW(&a, Shardplane__V1__ModuleInfo, count);
  /* unit index per module and innermost owner, from the plan */
  int32_t *unit_of = ANEW(&a, int32_t, m->n_modules);
  int32_t *owner = ANEW(&a, int32_t, m->n_modules);
  char *next = ANEW(&a, char, 24);
  if (r.modules && mv && unit_of && owner && next) {
    for (size_t i = 0; i < m->n_modules; i++) unit_of[i] = -1;
    for (uint32_t u = 0; u < pl->n_units; u++)
      unit_of[pl->units[u].module] = (int32_t)u;
    size_t prefix_len = strlen(q->prefix);
    size_t matched = 0;
    for (size_t i = 0; i < m->n_modules; i++) {
      owner[i] = unit_of[i] >= 0 ? unit_of[i] : owner[m->modules[i].parent];
      if (strncmp(m->modules[i].fqn, q->prefix, prefix_len) != 0) continue;
      if (matched++ < start) continue;
      if (r.n_modules == count) {
        if (r.next_page_token == NULL || r.next_page_token[0] == '\0') {
          snprintf(next, 24, "%zu", matched - 1);
          r.next_page_token = next;
        }
        continue;
      }
      Shardplane__V1__ModuleInfo *mi = &mv[r.n_modules];
      shardplane__v1__module_info__init(mi);
      mi->fqn = (char *)m->modules[i].fqn;
      mi->type = (char *)m->modules[i].type;
      mi->parent = m->modules[i].parent >= 0
                       ? (char *)m->modules[m->modules[i].parent].fqn
                       : (char *)"";
      mi->unit = unit_of[i];
      mi->owner_unit = (uint32_t)owner[i];
      r.modules[r.n_modules++] = mi;
    }
    r.total = (uint32_t)matched;
  }
  reply(call, &a, &r.base);
  arena_free(&a);
}

static void on_list_buffers(sp_rpc_call *call, const ProtobufCMessage *msg,
                            const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const sp_plan *pl = c->plan;
  const Shardplane__V1__ListBuffersRequest *q =
      (const Shardplane__V1__ListBuffersRequest *)msg;
  size_t start, count;
  if (!sp_coord_base_text_ok(call, "ListBuffersRequest", "prefix", q->prefix,
                             SP_COORD_MAX_NAME) ||
      !sp_coord_base_text_ok(call, "ListBuffersRequest", "page_token",
                             q->page_token, SP_COORD_MAX_PAGE_TOKEN))
    return;
  if (parse_page(call, q->page_token, q->page_size, pl->n_buffers, &start,
                 &count) != 0)
    return;
  arena a = {0};
  Shardplane__V1__ListBuffersResponse r =
      SHARDPLANE__V1__LIST_BUFFERS_RESPONSE__INIT;
  r.buffers = ANEW(&a, Shardplane__V1__BufferInfo *, count);
  size_t *idx = ANEW(&a, size_t, count);
  char *next = ANEW(&a, char, 24);
  if (r.buffers != NULL && idx != NULL && next != NULL) {
    size_t n, matched = sp_coord_plan_buffer_page(pl, q->prefix, start, count,
                                                  idx, &n);
    for (size_t i = 0; i < n; i++)
      r.buffers[r.n_buffers++] = buffer_msg(&a, pl, idx[i]);
    if (start + n < matched) {
      snprintf(next, 24, "%zu", start + n);
      r.next_page_token = next;
    }
    r.total = (uint32_t)matched;
  }
  reply(call, &a, &r.base);
  arena_free(&a);
}

/* The spec bytes the plan was built from, in pieces of at most
 * SP_COORD_SPEC_CHUNK_MAX (see GetModelSpecRequest). */
static void on_get_model_spec(sp_rpc_call *call, const ProtobufCMessage *msg,
                              const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const Shardplane__V1__GetModelSpecRequest *q =
      (const Shardplane__V1__GetModelSpecRequest *)msg;
  if (q->offset > c->spec_len) {
    sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                        "offset %llu is past the end of the %zu-byte spec",
                        (unsigned long long)q->offset, c->spec_len);
    return;
  }
  size_t want = q->max_bytes ? q->max_bytes : SP_COORD_SPEC_CHUNK;
  if (want > SP_COORD_SPEC_CHUNK_MAX) want = SP_COORD_SPEC_CHUNK_MAX;
  size_t left = c->spec_len - (size_t)q->offset;
  Shardplane__V1__GetModelSpecResponse r =
      SHARDPLANE__V1__GET_MODEL_SPEC_RESPONSE__INIT;
  r.model_name = c->model->name;
  r.plan_version = (char *)c->plan->version_hex;
  r.total_bytes = c->spec_len;
  r.offset = q->offset;
  r.spec_json.len = left < want ? left : want;
  /* borrowed: packing copies it */
  r.spec_json.data = (uint8_t *)c->spec_json + q->offset;
  sp_rpc_call_reply(call, &r.base);
}

#define M(name, kind, req, fn)                                                 \
  {                                                                            \
    SP_COORD_PATH(name), kind, &shardplane__v1__##req##__descriptor, fn, NULL, \
        NULL, NULL                                                             \
  }

static const sp_rpc_method k_methods[] = {
    M("GetJob", SP_RPC_UNARY, get_job_request, on_get_job),
    M("GetPlan", SP_RPC_UNARY, get_plan_request, on_get_plan),
    M("LocateParam", SP_RPC_UNARY, locate_param_request, on_locate),
    M("ListModules", SP_RPC_UNARY, list_modules_request, on_list_modules),
    M("ListBuffers", SP_RPC_UNARY, list_buffers_request, on_list_buffers),
    M("GetModelSpec", SP_RPC_UNARY, get_model_spec_request, on_get_model_spec),
};

int sp_coord_plan_register(sp_coord *c) {
  return sp_coord_base_add_methods(c, k_methods,
                                   sizeof k_methods / sizeof k_methods[0]);
}
