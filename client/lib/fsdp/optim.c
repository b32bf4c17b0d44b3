/* The optimizer of the FSDP runtime (shardplane.h): AdamW and SGD on the
 * master shards, the learning-rate schedule, the weight-decay mask and
 * gradient clipping by the global norm.
 *
 * A shard mixes parameters (and padding), so the optimizer sees it as a
 * list of element ranges per unit: the trainable parameters' slices in
 * this rank's shard, each with its decay flag, built once from the plan's
 * shard params. Padding and frozen parameters are in no range: no update,
 * no decay. The element arithmetic is the memory ops' (fsdp_mem_host.c on
 * the CPU, fsdp_cuda_kernels.cu on a GPU, equal bit for bit); this file
 * decides what runs where, in which order, with which constants. */
#include <fnmatch.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp_internal.h"

typedef struct optim_range {
  int64_t off, n; /* elements of the shard */
  bool decay;
} optim_range;

struct sp_fsdp_optim {
  bool ready;      /* sp_fsdp_optim_init done (clipping alone may come
                         first and only set up its scratch) */
  sp_optim_opts o; /* the patterns point into `strings` */
  char **strings;  /* owned copies of the patterns */
  size_t n_strings;
  optim_range **ranges; /* per unit */
  size_t *n_ranges;
  /* state, per unit (NULL for a unit without data), float32, c elements */
  uint8_t **exp_avg, **exp_avg_sq, **momentum;
  /* clipping: per-unit sums of squares, a chunk scratch, the reduced sum
   * (runtime storage, for the device and the collective) */
  double *unit_sums, *partial, *total;
};

/* ---- options ---- */

void sp_optim_opts_init(sp_optim_opts *o, sp_optim_kind kind) {
  memset(o, 0, sizeof *o);
  o->kind = kind;
  o->lr = 1e-3;
  o->schedule = SP_LR_CONSTANT;
  if (kind == SP_OPTIM_ADAMW) {
    o->beta1 = 0.9;
    o->beta2 = 0.999;
    o->eps = 1e-8;
    o->weight_decay = 1e-2;
  }
}

int sp_optim_opts_check(const sp_optim_opts *o, sp_diag *d) {
  if (!o) return sp_diag_set(d, SP_EINVAL, "optimizer options: NULL");
  if (o->kind != SP_OPTIM_SGD && o->kind != SP_OPTIM_ADAMW)
    return sp_diag_set(d, SP_EINVAL,
                       "optimizer kind %d: expected sgd or "
                       "adamw",
                       (int)o->kind);
  if (!isfinite(o->lr) || o->lr < 0)
    return sp_diag_set(d, SP_EINVAL,
                       "learning rate %g: expected a finite "
                       "value >= 0",
                       o->lr);
  if (!isfinite(o->weight_decay) || o->weight_decay < 0)
    return sp_diag_set(d, SP_EINVAL,
                       "weight decay %g: expected a finite "
                       "value >= 0",
                       o->weight_decay);
  if (o->kind == SP_OPTIM_SGD && (!isfinite(o->momentum) || o->momentum < 0))
    return sp_diag_set(d, SP_EINVAL,
                       "momentum %g: expected a finite value "
                       ">= 0",
                       o->momentum);
  if (o->kind == SP_OPTIM_ADAMW) {
    if (!(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1))
      return sp_diag_set(d, SP_EINVAL,
                         "betas %g,%g: each expected in "
                         "[0, 1)",
                         o->beta1, o->beta2);
    if (!isfinite(o->eps) || !(o->eps > 0))
      return sp_diag_set(d, SP_EINVAL, "eps %g: expected a finite value > 0",
                         o->eps);
  }
  if (o->schedule != SP_LR_CONSTANT && o->schedule != SP_LR_COSINE)
    return sp_diag_set(d, SP_EINVAL,
                       "lr schedule %d: expected constant or "
                       "cosine",
                       (int)o->schedule);
  if (o->schedule == SP_LR_COSINE) {
    if (o->total_steps == 0)
      return sp_diag_set(d, SP_EINVAL,
                         "cosine schedule: total steps 0; "
                         "expected the number of optimizer steps");
    if (o->warmup_steps > o->total_steps)
      return sp_diag_set(d, SP_EINVAL,
                         "warmup steps %llu: expected at most "
                         "the total steps %llu",
                         (unsigned long long)o->warmup_steps,
                         (unsigned long long)o->total_steps);
    if (!isfinite(o->min_lr) || o->min_lr < 0 || o->min_lr > o->lr)
      return sp_diag_set(d, SP_EINVAL,
                         "min lr %g: expected a value in "
                         "[0, lr = %g]",
                         o->min_lr, o->lr);
  }
  for (size_t i = 0; i < o->n_decay; i++)
    if (!o->decay || !o->decay[i] || !o->decay[i][0])
      return sp_diag_set(d, SP_EINVAL, "decay pattern %zu: empty", i);
  for (size_t i = 0; i < o->n_no_decay; i++)
    if (!o->no_decay || !o->no_decay[i] || !o->no_decay[i][0])
      return sp_diag_set(d, SP_EINVAL, "no-decay pattern %zu: empty", i);
  return 0;
}

double sp_optim_lr(const sp_optim_opts *o, uint64_t t) {
  if (!o) return 0;
  if (o->schedule != SP_LR_COSINE) return o->lr;
  uint64_t w = o->warmup_steps, total = o->total_steps;
  if (t < w) return o->lr * (double)(t + 1) / (double)w;
  if (t >= total) return o->min_lr;
  double progress = (double)(t - w) / (double)(total - w);
  return o->min_lr + 0.5 * (o->lr - o->min_lr) *
                         (1.0 + cos(3.14159265358979323846 * progress));
}

static bool matches(const char *const *pats, size_t n, const char *fqn) {
  for (size_t i = 0; i < n; i++)
    if (fnmatch(pats[i], fqn, 0) == 0) return true;
  return false;
}

bool sp_optim_decays(const sp_optim_opts *o, const sp_model *m, int32_t param) {
  if (!o || !m || param < 0 || (size_t)param >= m->n_params) return false;
  const sp_tensor_spec *t = &m->params[param];
  if (matches(o->no_decay, o->n_no_decay, t->fqn)) return false;
  if (matches(o->decay, o->n_decay, t->fqn)) return true;
  return t->ndim >= 2;
}

/* ---- state ---- */

static sp_fsdp_optim *optim_get(sp_fsdp *f, sp_diag *d) {
  if (f->optim) return f->optim;
  f->optim = calloc(1, sizeof *f->optim);
  if (!f->optim) sp_diag_set(d, SP_ENOMEM, "no memory for the optimizer");
  return f->optim;
}

static void free_per_unit(sp_fsdp *f, uint8_t **pu) {
  for (size_t u = 0; pu && u < f->n_units; u++)
    (void)sp_fsdp_release(f, SP_MEM_OPTIMIZER, pu[u]);
  free(pu);
}

void sp_fsdp_optim_release(sp_fsdp *f) {
  sp_fsdp_optim *op = f ? f->optim : NULL;
  if (!op) return;
  /* checkpoints read registered state until the runtime goes; this is
   * sp_fsdp_free, after its last use */
  free_per_unit(f, op->exp_avg);
  free_per_unit(f, op->exp_avg_sq);
  free_per_unit(f, op->momentum);
  (void)sp_fsdp_release(f, SP_MEM_OPTIMIZER, op->unit_sums);
  (void)sp_fsdp_release(f, SP_MEM_OPTIMIZER, op->partial);
  (void)sp_fsdp_release(f, SP_MEM_OPTIMIZER, op->total);
  for (size_t u = 0; op->ranges && u < f->n_units; u++) free(op->ranges[u]);
  free(op->ranges);
  free(op->n_ranges);
  for (size_t i = 0; i < op->n_strings; i++) free(op->strings[i]);
  free(op->strings);
  free(op);
  f->optim = NULL;
}

/* Copies n patterns into op->strings; *out points at the copies. */
static int copy_patterns(sp_fsdp_optim *op, const char *const *pats, size_t n,
                         const char *const **out, sp_diag *d) {
  *out = NULL;
  if (n == 0) return 0;
  char **grown = realloc(op->strings, (op->n_strings + n) * sizeof *grown);
  if (!grown) return sp_diag_set(d, SP_ENOMEM, "no memory");
  op->strings = grown;
  size_t first = op->n_strings;
  for (size_t i = 0; i < n; i++) {
    char *c = strdup(pats[i]);
    if (!c) return sp_diag_set(d, SP_ENOMEM, "no memory");
    op->strings[op->n_strings++] = c;
  }
  *out = (const char *const *)(op->strings + first);
  return 0;
}

/* The trainable slices of unit u's shard on this rank, in shard order,
 * neighbours with the same decay flag merged. */
static int build_ranges(sp_fsdp *f, sp_fsdp_optim *op, uint32_t u, sp_diag *d) {
  const sp_plan *pl = f->plan;
  size_t n = 0;
  int rc = sp_plan_shard_params(pl, u, f->rank, NULL, 0, &n);
  if (rc < 0) return sp_diag_set(d, rc, "shard params of unit %u", u);
  sp_shard_param *sp = sp_fsdp_xcalloc(n, sizeof *sp);
  optim_range *r = sp_fsdp_xcalloc(n, sizeof *r);
  if (!sp || !r) {
    free(sp);
    free(r);
    return sp_diag_set(d, SP_ENOMEM, "no memory");
  }
  rc = sp_plan_shard_params(pl, u, f->rank, sp, n, &n);
  size_t k = 0;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    int32_t p = pl->entries[sp[i].entry].param;
    if (p < 0 || !f->model->params[p].flag) continue; /* frozen */
    bool decay = sp_optim_decays(&op->o, f->model, p);
    if (k > 0 && r[k - 1].decay == decay &&
        r[k - 1].off + r[k - 1].n == sp[i].offset_in_shard) {
      r[k - 1].n += sp[i].numel_in_shard;
      continue;
    }
    r[k++] = (optim_range){sp[i].offset_in_shard, sp[i].numel_in_shard, decay};
  }
  free(sp);
  if (rc < 0) {
    free(r);
    return sp_diag_set(d, rc, "shard params of unit %u", u);
  }
  op->ranges[u] = r;
  op->n_ranges[u] = k;
  return 0;
}

/* One float32 state tensor per unit with data, c elements, zeroed, in the
 * runtime's storage (counted as optimizer state), registered under
 * `name`. Frozen units get one too: checkpoints want every state of every
 * unit with parameters; it stays zero. */
static int alloc_state(sp_fsdp *f, const char *name, uint8_t ***out,
                       sp_diag *d) {
  uint8_t **pu = sp_fsdp_xcalloc(f->n_units, sizeof *pu);
  if (!pu) return sp_diag_set(d, SP_ENOMEM, "no memory");
  *out = pu;
  for (uint32_t u = 0; u < f->n_units; u++) {
    sp_fsdp_unit *fu = &f->units[u];
    if (!fu->has_data) continue;
    void *p = NULL;
    /* category: optimizer state */
    int rc =
        sp_fsdp_alloc(f, SP_MEM_OPTIMIZER, (size_t)fu->c, sizeof(float), &p, d);
    if (rc < 0)
      return sp_diag_prefix(d, rc, "optimizer state %s of unit %u (%s)", name,
                            u, sp_fsdp_unit_name(f, u));
    pu[u] = p;
  }
  return sp_fsdp_register_shard_state(f, name, SP_FLOAT32, pu, d);
}

int sp_fsdp_optim_init(sp_fsdp *f, const sp_optim_opts *o, sp_diag *d) {
  if (!f || !o)
    return sp_diag_set(d, SP_EINVAL, "sp_fsdp_optim_init: NULL argument");
  if (f->optim && f->optim->ready)
    return sp_diag_set(d, SP_EEXIST,
                       "sp_fsdp_optim_init: the runtime has "
                       "an optimizer already");
  /* its state may be registered already, under the names a second try
   * would register again */
  if (f->optim && f->optim->ranges)
    return sp_diag_set(d, SP_ESTATE,
                       "sp_fsdp_optim_init: an earlier call "
                       "failed half-way; free the runtime");
  int rc = sp_optim_opts_check(o, d);
  if (rc < 0) return rc;
  sp_fsdp_optim *op = optim_get(f, d);
  if (!op) return SP_ENOMEM;
  op->o = *o;
  rc = copy_patterns(op, o->decay, o->n_decay, &op->o.decay, d);
  if (rc == 0)
    rc = copy_patterns(op, o->no_decay, o->n_no_decay, &op->o.no_decay, d);
  if (rc == 0) {
    op->ranges = sp_fsdp_xcalloc(f->n_units, sizeof *op->ranges);
    op->n_ranges = sp_fsdp_xcalloc(f->n_units, sizeof *op->n_ranges);
    if (!op->ranges || !op->n_ranges)
      rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  }
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++)
    if (f->units[u].has_data) rc = build_ranges(f, op, u, d);
  if (rc == 0 && o->kind == SP_OPTIM_ADAMW) {
    rc = alloc_state(f, "exp_avg", &op->exp_avg, d);
    if (rc == 0) rc = alloc_state(f, "exp_avg_sq", &op->exp_avg_sq, d);
  }
  if (rc == 0 && o->kind == SP_OPTIM_SGD && o->momentum != 0)
    rc = alloc_state(f, "momentum_buffer", &op->momentum, d);
  /* A failure leaves a half-built optimizer that sp_fsdp_free releases;
   * registered state stays valid until then. */
  if (rc == 0) op->ready = true;
  return rc;
}

double sp_fsdp_optim_lr(const sp_fsdp *f) {
  if (!f || !f->optim || !f->optim->ready) return 0;
  return sp_optim_lr(&f->optim->o, f->optim_steps);
}

uint64_t sp_fsdp_optim_steps(const sp_fsdp *f) {
  return f ? f->optim_steps : 0;
}

/* ---- the step ---- */

static float *state_at(uint8_t **pu, uint32_t u, int64_t off) {
  return pu ? (float *)pu[u] + off : NULL;
}

static int step_unit(sp_fsdp *f, const sp_fsdp_optim *op, uint32_t u, double lr,
                     const sp_fsdp_adamw_args *base, sp_diag *d) {
  sp_fsdp_unit *fu = &f->units[u];
  const sp_optim_opts *o = &op->o;
  size_t gsize = sp_dtype_size(fu->grad_dtype);
  for (size_t i = 0; i < op->n_ranges[u]; i++) {
    const optim_range *r = &op->ranges[u][i];
    uint8_t *p = fu->shard + (size_t)r->off * fu->esize;
    const uint8_t *g = fu->shard_grad + (size_t)r->off * gsize;
    int rc;
    if (o->kind == SP_OPTIM_ADAMW) {
      sp_fsdp_adamw_args a = *base;
      if (!r->decay) a.lrwd = 0;
      rc = f->mem->adamw(f, p, fu->u->dtype, g, fu->grad_dtype,
                         state_at(op->exp_avg, u, r->off),
                         state_at(op->exp_avg_sq, u, r->off), (size_t)r->n, &a,
                         d);
    } else {
      rc = f->mem->sgd(f, p, fu->u->dtype, g, fu->grad_dtype,
                       state_at(op->momentum, u, r->off), (size_t)r->n, lr,
                       o->momentum, r->decay ? o->weight_decay : 0, d);
    }
    if (rc < 0) return rc;
  }
  return 0;
}

int sp_fsdp_optim_step(sp_fsdp *f, double *lr_out, sp_diag *d) {
  if (!f) return sp_diag_set(d, SP_EINVAL, "sp_fsdp_optim_step: NULL");
  sp_fsdp_optim *op = f->optim;
  if (!op || !op->ready)
    return sp_diag_set(d, SP_ESTATE,
                       "sp_fsdp_optim_step: no optimizer "
                       "(sp_fsdp_optim_init first)");
  int rc = sp_fsdp_check_between_steps(f, "sp_fsdp_optim_step", d);
  if (rc == 0) rc = sp_fsdp_quorum_commit(f, d);
  if (rc < 0) return rc;
  const sp_optim_opts *o = &op->o;
  double lr = sp_optim_lr(o, f->optim_steps);
  /* every constant once, in double, so the host and the device use the
   * same values; t counts from 1 (PyTorch's state["step"]) */
  double t = (double)(f->optim_steps + 1);
  sp_fsdp_adamw_args a = {.lr = lr,
                          .lrwd = lr * o->weight_decay,
                          .beta1 = o->beta1,
                          .omb1 = 1.0 - o->beta1,
                          .beta2 = o->beta2,
                          .omb2 = 1.0 - o->beta2,
                          .bc1 = 1.0 - pow(o->beta1, t),
                          .bc2 = 1.0 - pow(o->beta2, t),
                          .eps = o->eps};
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++) {
    if (!f->units[u].reduces) continue;
    rc = step_unit(f, op, u, lr, &a, d);
    if (rc < 0)
      sp_diag_prefix(d, rc, "%s step %llu on unit %u (%s)",
                     o->kind == SP_OPTIM_ADAMW ? "AdamW" : "SGD",
                     (unsigned long long)f->optim_steps, u,
                     sp_fsdp_unit_name(f, u));
  }
  if (rc == 0) rc = sp_fsdp_zero_shard_grads(f, d);
  if (rc == 0) rc = sp_fsdp_shards_changed(f, d);
  if (rc == 0) {
    f->optim_steps++;
    if (lr_out) *lr_out = lr;
  }
  return rc;
}

/* ---- clipping ---- */

static int clip_scratch(sp_fsdp *f, sp_fsdp_optim *op, sp_diag *d) {
  if (op->total) return 0;
  size_t chunks = 1;
  for (size_t u = 0; u < f->n_units; u++) {
    size_t c = sp_fsdp_sqsum_chunks((size_t)f->units[u].c);
    if (c > chunks) chunks = c;
  }
  void *a = NULL, *b = NULL, *c = NULL;
  /* category: optimizer state (the clipping's few doubles, held from the
   * first clip on) */
  int rc =
      sp_fsdp_alloc(f, SP_MEM_OPTIMIZER, f->n_units, sizeof(double), &a, d);
  if (rc == 0)
    rc = sp_fsdp_alloc(f, SP_MEM_OPTIMIZER, chunks, sizeof(double), &b, d);
  if (rc == 0)
    rc = sp_fsdp_alloc(f, SP_MEM_OPTIMIZER, 1, sizeof(double), &c, d);
  if (rc < 0) {
    (void)sp_fsdp_release(f, SP_MEM_OPTIMIZER, a);
    (void)sp_fsdp_release(f, SP_MEM_OPTIMIZER, b);
    return sp_diag_prefix(d, rc, "gradient clipping scratch");
  }
  op->unit_sums = a;
  op->partial = b;
  op->total = c;
  return 0;
}

/* This rank's sum of squares over its shards: per unit on the compute
 * lane (sqsum's fixed order), then the units in order on the host. */
static int local_sqsum(sp_fsdp *f, sp_fsdp_optim *op, double *out, sp_diag *d) {
  int rc = 0;
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++) {
    sp_fsdp_unit *fu = &f->units[u];
    if (!fu->reduces) continue;
    rc = f->mem->sqsum(f, fu->shard_grad, fu->grad_dtype, (size_t)fu->c,
                       op->partial, op->unit_sums + u, d);
    if (rc < 0)
      sp_diag_prefix(d, rc, "gradient norm of unit %u (%s)", u,
                     sp_fsdp_unit_name(f, u));
  }
  double *sums = rc == 0 ? calloc(f->n_units + 1, sizeof *sums) : NULL;
  if (rc == 0 && !sums) rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  if (rc == 0)
    rc = f->mem->to_host(f, sums, op->unit_sums, f->n_units * sizeof *sums, d);
  double total = 0;
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++)
    if (f->units[u].reduces) total += sums[u];
  free(sums);
  *out = total;
  return rc;
}

int sp_fsdp_clip_grad_norm(sp_fsdp *f, double max_norm, double *total_norm,
                           sp_diag *d) {
  if (!f) return sp_diag_set(d, SP_EINVAL, "sp_fsdp_clip_grad_norm: NULL");
  if (!(max_norm > 0))
    return sp_diag_set(d, SP_EINVAL,
                       "clip grad norm: max norm %g; expected "
                       "a value > 0",
                       max_norm);
  int rc = sp_fsdp_check_between_steps(f, "sp_fsdp_clip_grad_norm", d);
  sp_fsdp_optim *op = rc == 0 ? optim_get(f, d) : NULL;
  if (rc == 0 && !op) rc = SP_ENOMEM;
  if (rc == 0) rc = clip_scratch(f, op, d);
  double sq = 0;
  if (rc == 0) rc = local_sqsum(f, op, &sq, d);
  /* flat (NO_SHARD, or shard groups of one rank): every rank has the
   * whole reduced gradient; otherwise each shard once, over the shard
   * group (the world, or for HYBRID_SHARD the group whose replicas
   * elsewhere hold the same shards) */
  if (rc == 0 && !f->flat) {
    rc = f->mem->from_host(f, op->total, &sq, sizeof sq, d);
    sp_fsdp_work w = {.kind = SP_WORK_SHARD_ALL_REDUCE,
                      .buf = op->total,
                      .count = 1,
                      .dt = SP_FLOAT64};
    if (rc == 0)
      sp_fsdp_fp_issue(f, &w, sp_fsdp_gather_kind(f), SP_OP_ALL_REDUCE, 0,
                       SP_FLOAT64, 1);
    int64_t t = rc == 0 ? sp_fsdp_enqueue(f, &w, d) : -1;
    if (rc == 0 && t < 0) rc = (int)t;
    if (rc == 0) {
      f->stats.all_reduces++;
      rc = sp_fsdp_wait(f, t, d);
    }
    if (rc == 0) rc = f->mem->to_host(f, &sq, op->total, sizeof sq, d);
  }
  if (rc < 0) return sp_diag_prefix(d, rc, "clip grad norm");
  double norm = sqrt(sq);
  if (total_norm) *total_norm = norm;
  double coef = max_norm / (norm + 1e-6);
  if (!isfinite(norm) || !(coef < 1.0)) return 0;
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++) {
    sp_fsdp_unit *fu = &f->units[u];
    if (!fu->reduces) continue;
    rc = f->mem->scale(f, SP_LANE_COMPUTE, fu->shard_grad, fu->grad_dtype,
                       (size_t)fu->c, coef, d);
    if (rc < 0)
      sp_diag_prefix(d, rc, "clipping the gradient of unit %u (%s)", u,
                     sp_fsdp_unit_name(f, u));
  }
  return rc;
}
