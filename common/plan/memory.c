/* The FSDP runtime's memory: categories, the caching pool, and the memory
 * model that replays the runtime's schedule through a pool of tokens
 * (memory.h; the rules: docs/fsdp.md, "Memory"). */
#include "plan/memory.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

struct sp_mem_block {
  void *ptr;
  uint64_t bytes;
  sp_mem_cat cat; /* while in use */
  bool pooled;    /* made by a take: goes back to the cache */
  bool in_use;
};

static const char *const k_cat_names[SP_MEM_N_CATS] = {
    "sharded_params",  "sharded_grads", "optimizer", "unsharded_params",
    "unsharded_grads", "reduce",        "buffers"};
static const char *const k_cat_labels[SP_MEM_N_CATS] = {
    "sharded params",  "sharded grads",  "optimizer state", "unsharded params",
    "unsharded grads", "reduce buffers", "buffers"};

const char *sp_mem_cat_name(sp_mem_cat c) {
  return (unsigned)c < SP_MEM_N_CATS ? k_cat_names[c] : "invalid";
}

const char *sp_mem_cat_label(sp_mem_cat c) {
  return (unsigned)c < SP_MEM_N_CATS ? k_cat_labels[c] : "invalid";
}

/* ---- accounting ---- */

static void bump(sp_mem_bytes *b, uint64_t add) {
  b->current += add;
  if (b->current > b->peak) b->peak = b->current;
}

static void drop(sp_mem_bytes *b, uint64_t sub) {
  b->current = b->current >= sub ? b->current - sub : 0;
}

static void use(sp_mem_account *a, sp_mem_cat cat, uint64_t bytes) {
  bump(&a->cat[cat], bytes);
  bump(&a->total, bytes);
}

static void unuse(sp_mem_account *a, sp_mem_cat cat, uint64_t bytes) {
  drop(&a->cat[cat], bytes);
  drop(&a->total, bytes);
}

/* ---- the pool ---- */

void sp_mem_pool_init(sp_mem_pool *p, sp_mem_alloc_fn alloc,
                      sp_mem_release_fn release, void *user) {
  memset(p, 0, sizeof *p);
  p->alloc = alloc;
  p->release = release;
  p->user = user;
}

void sp_mem_pool_destroy(sp_mem_pool *p) {
  if (!p) return;
  for (size_t i = 0; i < p->n_blocks; i++)
    if (p->release) p->release(p->user, p->blocks[i].ptr);
  free(p->blocks);
  p->blocks = NULL;
  p->n_blocks = p->cap_blocks = 0;
  memset(&p->acct.cat, 0, sizeof p->acct.cat);
  p->acct.total.current = p->acct.reserved.current = 0;
}

static int check_size(sp_mem_cat cat, size_t n, size_t esize, uint64_t *bytes,
                      sp_diag *d) {
  if ((unsigned)cat >= SP_MEM_N_CATS)
    return sp_diag_set(d, SP_EINVAL,
                       "memory category %d is not one of the "
                       "%d",
                       (int)cat, SP_MEM_N_CATS);
  if (esize && n > SIZE_MAX / esize)
    return sp_diag_set(d, SP_ETOOBIG,
                       "%s: %zu elements of %zu bytes "
                       "overflow",
                       sp_mem_cat_label(cat), n, esize);
  *bytes = (uint64_t)n * esize;
  return 0;
}

/* A new block from the allocator, registered. */
static int new_block(sp_mem_pool *p, sp_mem_cat cat, size_t n, size_t esize,
                     uint64_t bytes, bool pooled, void **out, sp_diag *d) {
  if (p->n_blocks == p->cap_blocks) {
    /* the registry grows before the allocation, so a block is never made
     * that cannot be recorded (and would leak) */
    size_t cap = p->cap_blocks ? p->cap_blocks * 2 : 16;
    if (cap > SIZE_MAX / sizeof *p->blocks)
      return sp_diag_set(d, SP_ETOOBIG, "%s: more than %zu blocks",
                         sp_mem_cat_label(cat), p->cap_blocks);
    sp_mem_block *nb = realloc(p->blocks, cap * sizeof *nb);
    if (!nb)
      return sp_diag_set(d, SP_ENOMEM,
                         "%s: no memory for the block "
                         "registry",
                         sp_mem_cat_label(cat));
    p->blocks = nb;
    p->cap_blocks = cap;
  }
  void *ptr = NULL;
  int rc = p->alloc(p->user, n, esize, &ptr, d);
  if (rc < 0)
    return sp_diag_prefix(d, rc, "%s (%zu elements of %zu bytes)",
                          sp_mem_cat_label(cat), n, esize);
  p->blocks[p->n_blocks++] = (sp_mem_block){
      .ptr = ptr, .bytes = bytes, .cat = cat, .pooled = pooled, .in_use = true};
  p->acct.allocs++;
  bump(&p->acct.reserved, bytes);
  use(&p->acct, cat, bytes);
  *out = ptr;
  return 0;
}

int sp_mem_pool_alloc(sp_mem_pool *p, sp_mem_cat cat, size_t n, size_t esize,
                      void **out, sp_diag *d) {
  uint64_t bytes = 0;
  *out = NULL;
  int rc = check_size(cat, n, esize, &bytes, d);
  return rc < 0 ? rc : new_block(p, cat, n, esize, bytes, false, out, d);
}

int sp_mem_pool_take(sp_mem_pool *p, sp_mem_cat cat, size_t n, size_t esize,
                     void **out, sp_diag *d) {
  uint64_t bytes = 0;
  *out = NULL;
  int rc = check_size(cat, n, esize, &bytes, d);
  if (rc < 0) return rc;
  /* any free block of the size will do: they are interchangeable for
   * every count (the newest first, as a cache would) */
  for (size_t i = p->n_blocks; i-- > 0;) {
    sp_mem_block *b = &p->blocks[i];
    if (!b->pooled || b->in_use || b->bytes != bytes) continue;
    b->in_use = true;
    b->cat = cat;
    use(&p->acct, cat, bytes);
    p->acct.reuses++;
    *out = b->ptr;
    return 0;
  }
  return new_block(p, cat, n, esize, bytes, true, out, d);
}

int sp_mem_pool_release(sp_mem_pool *p, sp_mem_cat cat, void *ptr, sp_diag *d) {
  if (!ptr) return 0;
  for (size_t i = 0; i < p->n_blocks; i++) {
    sp_mem_block *b = &p->blocks[i];
    if (b->ptr != ptr) continue;
    if (!b->in_use)
      return sp_diag_set(d, SP_EINVAL, "%s: block released twice",
                         sp_mem_cat_label(cat));
    sp_mem_cat was = b->cat;
    unuse(&p->acct, was, b->bytes);
    if (b->pooled) {
      b->in_use = false;
    } else {
      drop(&p->acct.reserved, b->bytes);
      if (p->release) p->release(p->user, b->ptr);
      p->blocks[i] = p->blocks[--p->n_blocks];
    }
    if (was != cat)
      return sp_diag_set(d, SP_EINVAL, "a block of %s released as %s",
                         sp_mem_cat_label(was), sp_mem_cat_label(cat));
    return 0;
  }
  return sp_diag_set(d, SP_EINVAL,
                     "%s: released a block the pool does not "
                     "hold",
                     sp_mem_cat_label(cat));
}

void sp_mem_pool_reset_peaks(sp_mem_pool *p) {
  for (int c = 0; c < SP_MEM_N_CATS; c++)
    p->acct.cat[c].peak = p->acct.cat[c].current;
  p->acct.total.peak = p->acct.total.current;
  p->acct.reserved.peak = p->acct.reserved.current;
}

/* ---- options ---- */

static const char *const k_opt_names[] = {"invalid", "none", "sgd",
                                          "sgd-momentum", "adamw"};

int sp_mem_optimizer_parse(const char *s, sp_mem_optimizer *out) {
  for (int i = SP_MEM_OPT_NONE; s && i <= SP_MEM_OPT_ADAMW; i++)
    if (strcasecmp(s, k_opt_names[i]) == 0) {
      *out = (sp_mem_optimizer)i;
      return 0;
    }
  return SP_EINVAL;
}

const char *sp_mem_optimizer_name(sp_mem_optimizer o) {
  return o >= SP_MEM_OPT_NONE && o <= SP_MEM_OPT_ADAMW ? k_opt_names[o]
                                                       : "invalid";
}

uint32_t sp_mem_optimizer_states(sp_mem_optimizer o) {
  return o == SP_MEM_OPT_ADAMW ? 2 : o == SP_MEM_OPT_SGD_MOMENTUM ? 1 : 0;
}

void sp_mem_opts_default(sp_mem_opts *o) {
  memset(o, 0, sizeof *o);
  o->optimizer = SP_MEM_OPT_SGD;
  o->max_inflight = 2;
  o->backward_prefetch = true;
}

/* ---- the model: the runtime's schedule, replayed through a pool ----
 * Every function below mirrors the one of client/lib/fsdp/fsdp_schedule.c (or
 * fsdp.c) named in its comment, taking and releasing the same blocks in
 * the same order; test_memory_model_exact (tests/test_fsdp.c) checks that
 * the runtime's counters equal the prediction on every strategy. */

typedef struct sim_unit {
  bool has_data, reduces;
  size_t c, padded; /* elements */
  size_t esize, psize, gsize, rsize;
  bool red_in;      /* reduce_dtype differs from param_dtype */
  size_t red_out_n; /* c; 0 for a flat unit, which reduces in place */
  /* a flat unit's unsharded parameter is its master, its unsharded
   * gradient its shard gradient (the runtime's full_is_shard and
   * grad_is_shard): nothing of their own */
  bool full_is_shard, grad_is_shard;
  void *full, *full_grad, *rin, *rout;
  bool unsharded, prefetched, gather_pending, idle;
  int32_t pf_index;
} sim_unit;

typedef struct sim {
  const sp_plan *pl;
  sp_mem_opts o;
  bool flat; /* the shard group is one rank: NO_SHARD's schedule */
  sp_mem_pool pool;
  sim_unit *u;
  size_t n;
  uint32_t *order;
  size_t n_order;
  uint32_t *pending; /* reductions in flight, oldest first */
  size_t n_pending;
  void **buf; /* per model buffer */
  sp_dtype *buf_dt;
  bool lazy_done;
  bool accumulate; /* a no_sync micro-batch: no reduction */
  int rc;          /* first failure */
  sp_diag *d;
} sim;

/* the counting allocator: distinct non-NULL tokens, no memory */
static int token_alloc(void *user, size_t n, size_t esize, void **out,
                       sp_diag *d) {
  (void)n, (void)esize, (void)d;
  uintptr_t *next = user;
  *out = (void *)++*next;
  return 0;
}

static void take(sim *s, sp_mem_cat cat, size_t n, size_t esize, void **p) {
  if (s->rc == 0) s->rc = sp_mem_pool_take(&s->pool, cat, n, esize, p, s->d);
}

static void own(sim *s, sp_mem_cat cat, size_t n, size_t esize, void **p) {
  if (s->rc == 0) s->rc = sp_mem_pool_alloc(&s->pool, cat, n, esize, p, s->d);
}

static void give(sim *s, sp_mem_cat cat, void **p) {
  if (*p && s->rc == 0) s->rc = sp_mem_pool_release(&s->pool, cat, *p, s->d);
  *p = NULL;
}

/* alloc_unit and the buffers of sp_fsdp_new; then the optimizer's state,
 * which the optimizer allocates before its first step (its place among
 * persistent blocks changes no peak) */
static void sim_new(sim *s) {
  const sp_plan *pl = s->pl;
  for (size_t i = 0; i < s->n; i++) {
    const sp_unit *u = &pl->units[i];
    sim_unit *su = &s->u[i];
    su->pf_index = -1;
    su->idle = true;
    su->has_data = u->n_params > 0 && u->numel > 0;
    if (!su->has_data) continue;
    su->reduces = u->requires_grad;
    su->c = (size_t)u->shard_numel;
    su->padded = s->flat ? su->c : su->c * pl->shard_world;
    su->esize = sp_dtype_size(u->dtype);
    su->psize = sp_dtype_size(u->param_dtype);
    su->gsize =
        sp_dtype_size(u->keep_low_precision_grads ? u->param_dtype : u->dtype);
    su->rsize = sp_dtype_size(u->reduce_dtype);
    su->red_in = u->reduce_dtype != u->param_dtype;
    su->red_out_n = s->flat ? 0 : su->c;
    su->full_is_shard = s->flat && u->param_dtype == u->dtype;
    su->grad_is_shard =
        s->flat && (u->keep_low_precision_grads || u->param_dtype == u->dtype);
    void *shard, *grad;
    own(s, SP_MEM_SHARD_PARAMS, su->c, su->esize, &shard);
    own(s, SP_MEM_SHARD_GRADS, su->c, su->gsize, &grad);
    if (s->flat) {
      if (su->full_is_shard)
        su->full = shard;
      else
        own(s, SP_MEM_PARAMS, su->padded, su->psize, &su->full);
    }
    if (su->grad_is_shard) su->full_grad = grad;
  }
  for (size_t b = 0; b < pl->model->n_buffers; b++) {
    const sp_tensor_spec *t = &pl->model->buffers[b];
    s->buf_dt[b] = t->dtype;
    own(s, SP_MEM_BUFFERS, (size_t)t->numel, sp_dtype_size(t->dtype),
        &s->buf[b]);
  }
  uint32_t k = sp_mem_optimizer_states(s->o.optimizer);
  for (size_t i = 0; i < s->n; i++)
    for (uint32_t j = 0; s->u[i].reduces && j < k; j++) {
      void *st;
      own(s, SP_MEM_OPTIMIZER, s->u[i].c, sizeof(float), &st);
    }
}

/* sp_fsdp_lazy_init */
static void sim_lazy_init(sim *s) {
  if (s->lazy_done) return;
  for (size_t i = 0; i < s->pl->n_buffers; i++) {
    const sp_plan_buffer *pb = &s->pl->buffers[i];
    int32_t b = pb->buffer;
    sp_dtype to = pb->compute_dtype;
    if (to == s->buf_dt[b] || !sp_dtype_is_floating(to)) continue;
    void *nb;
    own(s, SP_MEM_BUFFERS, (size_t)s->pl->model->buffers[b].numel,
        sp_dtype_size(to), &nb);
    give(s, SP_MEM_BUFFERS, &s->buf[b]);
    s->buf[b] = nb;
    s->buf_dt[b] = to;
  }
  s->lazy_done = true;
}

/* issue_gather: the slot is taken when the all-gather is queued */
static void sim_issue_gather(sim *s, uint32_t i) {
  sim_unit *su = &s->u[i];
  if (!su->full) take(s, SP_MEM_PARAMS, su->padded, su->psize, &su->full);
  su->gather_pending = true;
}

/* unshard */
static void sim_unshard(sim *s, uint32_t i) {
  sim_unit *su = &s->u[i];
  if (!su->has_data || su->unsharded) return;
  if (!su->gather_pending) sim_issue_gather(s, i);
  su->gather_pending = false;
  su->unsharded = true;
}

/* reshard */
static void sim_reshard(sim *s, uint32_t i) {
  sim_unit *su = &s->u[i];
  su->gather_pending = false;
  su->unsharded = su->prefetched = false;
  if (!s->flat) give(s, SP_MEM_PARAMS, &su->full);
}

/* retire_oldest: the oldest reduction's buffers back to the pool */
static void sim_retire_oldest(sim *s) {
  uint32_t i = s->pending[0];
  memmove(s->pending, s->pending + 1, (s->n_pending - 1) * sizeof *s->pending);
  s->n_pending--;
  sim_unit *su = &s->u[i];
  give(s, SP_MEM_REDUCE, &su->rin);
  give(s, SP_MEM_REDUCE, &su->rout);
  if (!su->grad_is_shard) give(s, SP_MEM_GRADS, &su->full_grad);
}

static void sim_limit_reductions(sim *s) {
  uint32_t limit = s->o.max_inflight;
  while (s->n_pending >= limit) sim_retire_oldest(s);
}

static void sim_pre_forward(sim *s, uint32_t i) {
  sim_unshard(s, i);
  s->u[i].idle = false;
}

static bool reshards_after_forward(const sim *s, uint32_t i) {
  return i != 0 && !s->flat &&
         (s->pl->strategy == SP_FULL_SHARD ||
          s->pl->strategy == SP_HYBRID_SHARD);
}

static void sim_post_forward(sim *s, uint32_t i) {
  sim_unit *su = &s->u[i];
  su->idle = true;
  if (su->pf_index < 0 && s->n_order < s->n) {
    su->pf_index = (int32_t)s->n_order;
    s->order[s->n_order++] = i;
  }
  if (reshards_after_forward(s, i)) sim_reshard(s, i);
}

/* prefetch (BACKWARD_PRE) */
static void sim_prefetch(sim *s, uint32_t i) {
  int32_t idx = s->u[i].pf_index;
  if (!s->o.backward_prefetch || idx <= 0) return;
  uint32_t t = s->order[idx - 1];
  sim_unit *tu = &s->u[t];
  if (!tu->has_data || tu->full_is_shard || tu->unsharded ||
      tu->gather_pending || tu->prefetched || !tu->idle)
    return;
  sim_issue_gather(s, t);
  tu->prefetched = true;
}

static void sim_pre_backward(sim *s, uint32_t i) {
  sim_unit *su = &s->u[i];
  sim_unshard(s, i);
  su->idle = false;
  if (su->has_data && !su->full_grad) {
    sim_limit_reductions(s);
    take(s, SP_MEM_GRADS, su->padded, su->psize, &su->full_grad);
  }
  sim_prefetch(s, i);
}

static void sim_post_backward(sim *s, uint32_t i) {
  sim_unit *su = &s->u[i];
  if (su->reduces && !s->accumulate) {
    sim_limit_reductions(s);
    if (su->red_in) take(s, SP_MEM_REDUCE, su->padded, su->rsize, &su->rin);
    if (!s->flat) take(s, SP_MEM_REDUCE, su->red_out_n, su->rsize, &su->rout);
    s->pending[s->n_pending++] = i;
  } else if (su->has_data && !su->reduces && !su->grad_is_shard) {
    give(s, SP_MEM_GRADS, &su->full_grad);
  }
  if (!s->flat) sim_reshard(s, i);
}

static void sim_finish_backward(sim *s) {
  while (s->n_pending) sim_retire_oldest(s);
  for (uint32_t i = 0; i < s->n; i++) {
    sim_unit *su = &s->u[i];
    su->gather_pending = false;
    su->idle = true;
    if (!s->flat) sim_reshard(s, i);
    if (!su->grad_is_shard && !(s->accumulate && su->reduces))
      give(s, SP_MEM_GRADS, &su->full_grad);
    su->pf_index = -1;
  }
  s->n_order = 0;
}

/* One forward and backward in the order shardplane-worker runs them. */
static void sim_micro_batch(sim *s) {
  uint32_t n = (uint32_t)s->n;
  sim_lazy_init(s);
  sim_pre_forward(s, 0);
  for (uint32_t i = 1; i < n; i++) {
    sim_pre_forward(s, i);
    sim_post_forward(s, i);
  }
  sim_post_forward(s, 0);
  sim_pre_backward(s, 0);
  for (uint32_t i = n; i-- > 1;) {
    sim_pre_backward(s, i);
    sim_post_backward(s, i);
  }
  sim_post_backward(s, 0);
  sim_finish_backward(s);
}

/* sp_fsdp_sgd_step (and any optimizer step): stale unsharded copies are
 * dropped; nothing is allocated */
static void sim_optimizer_step(sim *s) {
  for (uint32_t i = 0; i < s->n; i++)
    if (s->u[i].reduces) sim_reshard(s, i);
}

int sp_mem_estimate_plan(const sp_plan *plan, const sp_mem_opts *opts,
                         sp_mem_estimate *out, sp_diag *d) {
  if (!plan || !out)
    return sp_diag_set(d, SP_EINVAL, "sp_mem_estimate_plan: NULL argument");
  memset(out, 0, sizeof *out);
  sp_mem_opts o;
  if (opts) {
    o = *opts;
  } else {
    sp_mem_opts_default(&o);
  }
  if (o.optimizer == SP_MEM_OPT_INVALID) o.optimizer = SP_MEM_OPT_SGD;
  if (o.optimizer < SP_MEM_OPT_NONE || o.optimizer > SP_MEM_OPT_ADAMW)
    return sp_diag_set(d, SP_EINVAL,
                       "optimizer %d: expected none, sgd, "
                       "sgd-momentum or adamw",
                       (int)o.optimizer);
  if (o.max_inflight == 0) o.max_inflight = 2;
  if (o.max_inflight > SP_MEM_MAX_INFLIGHT)
    return sp_diag_set(d, SP_EINVAL, "max_inflight %u: at most %u",
                       o.max_inflight, SP_MEM_MAX_INFLIGHT);
  sim s = {.pl = plan,
           .o = o,
           .flat = plan->shard_world == 1,
           .n = plan->n_units,
           .d = d};
  uintptr_t tokens = 0;
  sp_mem_pool_init(&s.pool, token_alloc, NULL, &tokens);
  size_t nb = plan->model->n_buffers;
  s.u = calloc(s.n ? s.n : 1, sizeof *s.u);
  s.order = calloc(s.n ? s.n : 1, sizeof *s.order);
  s.pending = calloc(s.n + 1, sizeof *s.pending);
  s.buf = calloc(nb ? nb : 1, sizeof *s.buf);
  s.buf_dt = calloc(nb ? nb : 1, sizeof *s.buf_dt);
  if (!s.u || !s.order || !s.pending || !s.buf || !s.buf_dt)
    s.rc =
        sp_diag_set(d, SP_ENOMEM, "memory model: no memory for %zu units", s.n);
  if (s.rc == 0) sim_new(&s);
  for (int step = 0; s.rc == 0 && step < 2; step++) {
    if (o.no_sync) {
      s.accumulate = true;
      sim_micro_batch(&s);
      s.accumulate = false;
    }
    sim_micro_batch(&s);
    sim_optimizer_step(&s);
  }
  if (s.rc == 0) {
    out->acct = s.pool.acct;
    out->opts = o;
    uint32_t k = sp_mem_optimizer_states(o.optimizer);
    uint64_t widest = 0;
    for (size_t i = 0; i < s.n; i++) {
      const sim_unit *su = &s.u[i];
      if (!su->has_data) continue;
      out->sharded_state += (uint64_t)su->c * (su->esize + su->gsize);
      if (su->reduces) out->sharded_state += (uint64_t)su->c * 4u * k;
      /* the unit's parameter and gradient slots, none where they are its
       * shards */
      uint64_t pg = (uint64_t)su->padded * su->psize *
                    (uint64_t)(!su->full_is_shard + !su->grad_is_shard);
      uint64_t slot = pg;
      if (su->reduces)
        slot += (uint64_t)su->red_out_n * su->rsize +
                (su->red_in ? (uint64_t)su->padded * su->rsize : 0);
      if (i == 0)
        out->in_flight_floor += pg;
      else if (slot > widest)
        widest = slot;
    }
    out->in_flight_floor +=
        widest * o.max_inflight + out->acct.cat[SP_MEM_BUFFERS].current;
  }
  sp_mem_pool_destroy(&s.pool);
  free(s.u);
  free(s.order);
  free(s.pending);
  free(s.buf);
  free(s.buf_dt);
  return s.rc;
}
