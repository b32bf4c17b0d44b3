/* The unsharded reference run of the MLP (mlp_reference.h). */
#include "mlp_reference.h"

#include <fnmatch.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "cast/cast.h"
#include "cast/cast_scalar.h"
#include "plan/plan.h"

sp_dtype sp_mlp_out_dtype(const sp_mlp *mlp, const sp_mlp_io *io) {
  if (mlp == NULL || io == NULL || io->param_dtype == NULL) return SP_FLOAT32;
  for (size_t l = mlp->n_layers; l-- > 0;)
    if (mlp->layers[l].weight >= 0)
      return io->param_dtype(io->user, mlp->layers[l].weight);
  return SP_FLOAT32;
}

typedef struct ref_ctx {
  const sp_model *m;
  unsigned char *master; /* every param, own dtype */
  unsigned char *view;   /* every param, unit param_dtype */
  unsigned char *grad;   /* every param, unit param_dtype */
  unsigned char *bufs;   /* every buffer, compute dtype */
  size_t *master_off, *view_off, *buf_off;
  sp_dtype *pdt, *bdt;
  /* the optimizer's side, per param element (elem_off), in double but
   * holding values of their stored dtype: the reduced gradient (the
   * gradient dtype gdt: the param's, or param_dtype with
   * keep_low_precision_grads), and the float32 state */
  size_t *elem_off;
  sp_dtype *gdt, *rdt;
  bool *decays;
  double *g, *m1, *m2;
} ref_ctx;

static void *ref_param(void *u, int32_t p) {
  ref_ctx *c = u;
  return c->view + c->view_off[p];
}
static void *ref_grad(void *u, int32_t p) {
  ref_ctx *c = u;
  return c->m->params[p].flag ? c->grad + c->view_off[p] : NULL;
}
static sp_dtype ref_param_dtype(void *u, int32_t p) {
  return ((ref_ctx *)u)->pdt[p];
}
static void *ref_buffer(void *u, int32_t b) {
  ref_ctx *c = u;
  return c->bufs + c->buf_off[b];
}
static sp_dtype ref_buffer_dtype(void *u, int32_t b) {
  return ((ref_ctx *)u)->bdt[b];
}

/* Byte offsets of n tensors laid end to end, each with numel[i] elements of
 * dtype dt[i]; *total gets the sum. SP_ETOOBIG on overflow. */
static int layout(const sp_tensor_spec *ts, const sp_dtype *dt, size_t n,
                  size_t *off, size_t *total) {
  size_t acc = 0;
  for (size_t i = 0; i < n; i++) {
    size_t es = sp_dtype_size(dt[i]);
    if (ts[i].numel < 0 || (uint64_t)ts[i].numel > SIZE_MAX / 8)
      return SP_ETOOBIG;
    /* packed, as the caller receives them; every access goes through
     * memcpy or sp_cast, so alignment does not matter */
    size_t bytes = (size_t)ts[i].numel * es;
    if (acc > SIZE_MAX - bytes) return SP_ETOOBIG;
    off[i] = acc;
    acc += bytes;
  }
  *total = acc;
  return 0;
}

/* Largest global batch the reference run takes: the norm's mean divides by
 * it in float32, exact up to 2^24. */
#define SP_MLP_MAX_BATCH (1u << 24)

/* v rounded once to dt, as a double */
static double ref_round(double v, sp_dtype dt) {
  uint64_t tmp;
  sp_elem_store_f64(&tmp, dt, 0, v);
  return sp_elem_load_f64(&tmp, dt, 0);
}

/* ---- the optimizer, written out for one process ----
 * torch.optim's formulas on whole tensors, independently of the runtime's
 * sharded implementation (client/lib/fsdp/optim.c), in the documented order of
 * double operations, so that one rank's run agrees with it bit for bit and
 * a sharded one within its summation-order differences. */

static double ref_lr(const sp_optim_opts *o, uint32_t step) {
  if (o->schedule != SP_LR_COSINE) return o->lr;
  double t = step, w = (double)o->warmup_steps, total = (double)o->total_steps;
  if (t < w) return o->lr * (t + 1) / w;
  if (t >= total) return o->min_lr;
  const double pi = 3.14159265358979323846;
  return o->min_lr +
         0.5 * (o->lr - o->min_lr) * (1.0 + cos(pi * (t - w) / (total - w)));
}

static bool ref_any_match(const char *const *pats, size_t n, const char *fqn) {
  for (size_t i = 0; i < n; i++)
    if (fnmatch(pats[i], fqn, 0) == 0) return true;
  return false;
}

/* no_decay patterns, then decay patterns, then: weights (2-D and up) */
static bool ref_decays(const sp_optim_opts *o, const sp_tensor_spec *t) {
  if (ref_any_match(o->no_decay, o->n_no_decay, t->fqn)) return false;
  if (ref_any_match(o->decay, o->n_decay, t->fqn)) return true;
  return t->ndim >= 2;
}

/* The gradient the runtime's reduction leaves for param p from its view
 * gradient: cast to reduce_dtype and on to the gradient dtype (a no-op
 * collective in one process), added to what it holds. */
static int ref_reduce(ref_ctx *c, int32_t p, unsigned char *tmp_a,
                      unsigned char *tmp_b, sp_diag *d) {
  const sp_tensor_spec *t = &c->m->params[p];
  size_t n = (size_t)t->numel;
  int rc = sp_cast(tmp_a, c->rdt[p], c->grad + c->view_off[p], c->pdt[p], n);
  if (rc == 0) rc = sp_cast(tmp_b, c->gdt[p], tmp_a, c->rdt[p], n);
  if (rc != 0) return sp_diag_set(d, rc, "%s: gradient cast failed", t->fqn);
  double *g = c->g + c->elem_off[p];
  for (size_t i = 0; i < n; i++)
    g[i] = ref_round(g[i] + sp_elem_load_f64(tmp_b, c->gdt[p], i), c->gdt[p]);
  return 0;
}

/* clip_grad_norm_ over every trainable gradient */
static void ref_clip(ref_ctx *c, double max_norm) {
  const sp_model *m = c->m;
  double sq = 0;
  for (size_t p = 0; p < m->n_params; p++) {
    if (!m->params[p].flag) continue;
    const double *g = c->g + c->elem_off[p];
    for (int64_t i = 0; i < m->params[p].numel; i++) sq += g[i] * g[i];
  }
  double coef = max_norm / (sqrt(sq) + 1e-6);
  if (!(coef < 1.0)) return;
  for (size_t p = 0; p < m->n_params; p++) {
    if (!m->params[p].flag) continue;
    double *g = c->g + c->elem_off[p];
    for (int64_t i = 0; i < m->params[p].numel; i++)
      g[i] = ref_round(g[i] * coef, c->gdt[p]);
  }
}

/* One optimizer step (0-based `step`) on every trainable param. */
static void ref_update(ref_ctx *c, const sp_optim_opts *o, uint32_t step) {
  const sp_model *m = c->m;
  double lr = ref_lr(o, step), t = (double)step + 1;
  double bc1 = 1.0 - pow(o->beta1, t), bc2 = 1.0 - pow(o->beta2, t);
  for (size_t p = 0; p < m->n_params; p++) {
    const sp_tensor_spec *ts = &m->params[p];
    if (!ts->flag) continue;
    void *mp = c->master + c->master_off[p];
    const double *g = c->g + c->elem_off[p];
    double *m1 = c->m1 + c->elem_off[p], *m2 = c->m2 + c->elem_off[p];
    double wd = c->decays[p] ? o->weight_decay : 0.0;
    for (int64_t i = 0; i < ts->numel; i++) {
      double pv = sp_elem_load_f64(mp, ts->dtype, (size_t)i), gv = g[i];
      if (o->kind == SP_OPTIM_ADAMW) {
        pv = pv - lr * wd * pv;
        m1[i] = ref_round(o->beta1 * m1[i] + (1.0 - o->beta1) * gv, SP_FLOAT32);
        m2[i] = ref_round(o->beta2 * m2[i] + (1.0 - o->beta2) * (gv * gv),
                          SP_FLOAT32);
        pv = pv - lr * (m1[i] / bc1) / (sqrt(m2[i] / bc2) + o->eps);
      } else {
        if (wd != 0) gv = gv + wd * pv;
        if (o->momentum != 0) {
          m1[i] = ref_round(o->momentum * m1[i] + gv, SP_FLOAT32);
          gv = m1[i];
        }
        pv = pv - lr * gv;
      }
      sp_elem_store_f64(mp, ts->dtype, (size_t)i, pv);
    }
  }
}

int sp_mlp_reference_run(const sp_model *m, const sp_job *job, uint32_t steps,
                         uint32_t global_batch, double lr, double *losses,
                         void **params, void **buffers, sp_diag *d) {
  if (!isfinite(lr))
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_reference_run: lr not finite");
  sp_mlp_train_cfg cfg;
  sp_mlp_train_cfg_init(&cfg, steps, global_batch, lr);
  return sp_mlp_reference_train(m, job, &cfg, losses, params, buffers, d);
}

static int ref_check(const sp_mlp_train_cfg *cfg, sp_diag *d) {
  uint32_t k = cfg->grad_accum ? cfg->grad_accum : 1;
  if (cfg->global_batch == 0 || cfg->global_batch > SP_MLP_MAX_BATCH)
    return sp_diag_set(d, SP_EINVAL,
                       "sp_mlp_reference_run: global batch %u not in 1..%u",
                       cfg->global_batch, SP_MLP_MAX_BATCH);
  if (cfg->global_batch % k != 0)
    return sp_diag_set(d, SP_EINVAL,
                       "sp_mlp_reference_run: global batch %u "
                       "is not a multiple of %u micro-batches",
                       cfg->global_batch, k);
  if (cfg->clip_grad_norm < 0 || !isfinite(cfg->clip_grad_norm))
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_reference_run: clip norm %g",
                       cfg->clip_grad_norm);
  int rc = sp_optim_opts_check(&cfg->optim, d);
  if (rc != 0) return sp_diag_prefix(d, rc, "sp_mlp_reference_run");
  return 0;
}

int sp_mlp_reference_train(const sp_model *m, const sp_job *job,
                           const sp_mlp_train_cfg *cfg, double *losses,
                           void **params, void **buffers, sp_diag *d) {
  if (params) *params = NULL;
  if (buffers) *buffers = NULL;
  if (m == NULL || job == NULL || cfg == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_reference_run: NULL argument");
  int rc = ref_check(cfg, d);
  if (rc != 0) return rc;
  uint32_t k = cfg->grad_accum ? cfg->grad_accum : 1;
  uint32_t micro = cfg->global_batch / k;

  sp_mlp *mlp = NULL;
  sp_plan *plan = NULL;
  sp_mlp_acts *acts = NULL;
  float *target = NULL;
  unsigned char *tmp_a = NULL, *tmp_b = NULL;
  ref_ctx c = {.m = m};
  rc = sp_mlp_new(m, &mlp, d);
  if (rc != 0) return rc;

  /* Same units and dtypes as the sharded job; only the world differs. The
   * plan's dtypes do not depend on strategy, and HYBRID_SHARD's group size
   * would not divide a world of 1. */
  sp_job one = *job;
  one.world_size = 1;
  if (one.strategy == SP_HYBRID_SHARD) one.strategy = SP_FULL_SHARD;
  one.shard_group_size = 0;
  if ((rc = sp_plan_build(m, &one, &plan, d)) != 0) goto out;

  size_t np = m->n_params, nb = m->n_buffers;
  c.master_off = calloc(np + 1, sizeof *c.master_off);
  c.view_off = calloc(np + 1, sizeof *c.view_off);
  c.buf_off = calloc(nb + 1, sizeof *c.buf_off);
  c.elem_off = calloc(np + 1, sizeof *c.elem_off);
  c.pdt = calloc(np + 1, sizeof *c.pdt);
  c.gdt = calloc(np + 1, sizeof *c.gdt);
  c.rdt = calloc(np + 1, sizeof *c.rdt);
  c.decays = calloc(np + 1, sizeof *c.decays);
  c.bdt = calloc(nb + 1, sizeof *c.bdt);
  sp_dtype *mdt = calloc(np + 1, sizeof *mdt);
  if (!c.master_off || !c.view_off || !c.buf_off || !c.elem_off || !c.pdt ||
      !c.gdt || !c.rdt || !c.decays || !c.bdt || !mdt) {
    free(mdt);
    rc = sp_diag_set(d, SP_ENOMEM, "sp_mlp_reference_run: out of memory");
    goto out;
  }
  int64_t max_numel = 1;
  size_t elems = 0;
  for (size_t p = 0; p < np; p++) {
    const sp_unit *u = &plan->units[plan->param_unit[p]];
    mdt[p] = m->params[p].dtype;
    c.pdt[p] = u->param_dtype != SP_DTYPE_INVALID ? u->param_dtype : mdt[p];
    /* FSDP: the gradient goes to reduce_dtype for the collective (a no-op
     * sum at world size 1), then back to the flat parameter's dtype, or,
     * with keep_low_precision_grads, to param_dtype
     * (cast_grad_to_param_dtype_if_needed). */
    c.rdt[p] = u->reduce_dtype != SP_DTYPE_INVALID ? u->reduce_dtype : c.pdt[p];
    c.gdt[p] = u->keep_low_precision_grads ? c.pdt[p] : mdt[p];
    c.decays[p] = ref_decays(&cfg->optim, &m->params[p]);
    c.elem_off[p] = elems;
    elems += (size_t)m->params[p].numel;
    if (m->params[p].numel > max_numel) max_numel = m->params[p].numel;
  }
  for (size_t b = 0; b < nb; b++)
    if (m->buffers[b].numel > max_numel) max_numel = m->buffers[b].numel;
  for (size_t i = 0; i < plan->n_buffers; i++)
    c.bdt[plan->buffers[i].buffer] = plan->buffers[i].compute_dtype;
  size_t master_bytes = 0, view_bytes = 0, buf_bytes = 0;
  rc = layout(m->params, mdt, np, c.master_off, &master_bytes);
  if (rc == 0) rc = layout(m->params, c.pdt, np, c.view_off, &view_bytes);
  if (rc == 0) rc = layout(m->buffers, c.bdt, nb, c.buf_off, &buf_bytes);
  free(mdt);
  if (rc != 0) {
    rc = sp_diag_set(d, rc, "sp_mlp_reference_run: model too large");
    goto out;
  }
  c.master = calloc(master_bytes ? master_bytes : 1, 1);
  c.view = calloc(view_bytes ? view_bytes : 1, 1);
  c.grad = calloc(view_bytes ? view_bytes : 1, 1);
  c.bufs = calloc(buf_bytes ? buf_bytes : 1, 1);
  c.g = calloc(elems + 1, sizeof *c.g);
  c.m1 = calloc(elems + 1, sizeof *c.m1);
  c.m2 = calloc(elems + 1, sizeof *c.m2);
  /* two scratch arrays of the largest tensor, 8 bytes an element */
  if ((uint64_t)max_numel <= SIZE_MAX / 8) {
    tmp_a = malloc((size_t)max_numel * 8);
    tmp_b = malloc((size_t)max_numel * 8);
  }
  if (!c.master || !c.view || !c.grad || !c.bufs || !c.g || !c.m1 || !c.m2 ||
      !tmp_a || !tmp_b) {
    rc = sp_diag_set(d, SP_ENOMEM, "sp_mlp_reference_run: out of memory");
    goto out;
  }
  for (size_t p = 0; p < np; p++)
    sp_mlp_init_param(NULL, m, (int32_t)p, 0, m->params[p].numel,
                      c.master + c.master_off[p]);
  /* buffers: initialised in their original dtype, cast once to the compute
   * dtype, as FSDP's lazy init does before the first forward */
  for (size_t b = 0; b < nb; b++) {
    const sp_tensor_spec *t = &m->buffers[b];
    void *dst = c.bufs + c.buf_off[b];
    if (c.bdt[b] == t->dtype || !sp_dtype_is_floating(t->dtype)) {
      sp_mlp_init_buffer(NULL, m, (int32_t)b, dst);
      continue;
    }
    sp_mlp_init_buffer(NULL, m, (int32_t)b, tmp_a);
    if ((rc = sp_cast(dst, c.bdt[b], tmp_a, t->dtype, (size_t)t->numel)) != 0) {
      rc = sp_diag_set(d, rc, "%s: buffer cast failed", t->fqn);
      goto out;
    }
  }

  if ((rc = sp_mlp_acts_new(mlp, micro, &acts)) != 0) {
    rc = sp_diag_set(d, rc, "sp_mlp_reference_run: activations");
    goto out;
  }
  /* micro <= 2^24 and every row fits the activations just made */
  target = calloc((size_t)micro * (size_t)mlp->out_dim + 1, sizeof *target);
  if (target == NULL) {
    rc = sp_diag_set(d, SP_ENOMEM, "sp_mlp_reference_run: targets");
    goto out;
  }

  sp_mlp_io io = {
      .param = ref_param,
      .grad = ref_grad,
      .param_dtype = ref_param_dtype,
      .buffer = ref_buffer,
      .buffer_dtype = ref_buffer_dtype,
      .all_reduce_sum = NULL,
      .user = &c,
  };
  sp_dtype out_dt = sp_mlp_out_dtype(mlp, &io);

  for (uint32_t step = 0; step < cfg->steps; step++) {
    memset(c.g, 0, elems * sizeof *c.g);
    if (losses) losses[step] = 0;
    for (uint32_t j = 0; j < k; j++) {
      for (size_t p = 0; p < np; p++) {
        rc = sp_cast(c.view + c.view_off[p], c.pdt[p],
                     c.master + c.master_off[p], m->params[p].dtype,
                     (size_t)m->params[p].numel);
        if (rc != 0) {
          rc = sp_diag_set(d, rc, "%s: cast to param dtype failed",
                           m->params[p].fqn);
          goto out;
        }
      }
      /* without sync the view gradients add up over the micro-batches
       * and are reduced once, at the last */
      bool sync = !cfg->no_sync || j + 1 == k;
      if (!cfg->no_sync || j == 0) memset(c.grad, 0, view_bytes);
      sp_mlp_batch(mlp, step, (uint64_t)j * micro, micro, acts->x[0], target);
      for (size_t l = 0; l < mlp->n_layers; l++)
        if ((rc = sp_mlp_forward(mlp, l, &io, acts, micro, d)) != 0) goto out;
      /* each micro-batch's loss scaled by 1/k: the mean over the step */
      double loss =
          sp_mlp_loss_over(mlp, acts, target, out_dt, (uint64_t)micro * k);
      if (losses) losses[step] += loss;
      for (size_t l = mlp->n_layers; l-- > 0;)
        if ((rc = sp_mlp_backward(mlp, l, &io, acts, d)) != 0) goto out;
      sp_mlp_count_step(mlp, &io);
      for (size_t p = 0; sync && p < np; p++)
        if (m->params[p].flag &&
            (rc = ref_reduce(&c, (int32_t)p, tmp_a, tmp_b, d)) != 0)
          goto out;
    }
    if (cfg->clip_grad_norm > 0) ref_clip(&c, cfg->clip_grad_norm);
    ref_update(&c, &cfg->optim, step);
  }

  if (params) {
    *params = c.master;
    c.master = NULL;
  }
  if (buffers) {
    *buffers = c.bufs;
    c.bufs = NULL;
  }
out:
  free(c.master);
  free(c.view);
  free(c.grad);
  free(c.bufs);
  free(c.master_off);
  free(c.view_off);
  free(c.buf_off);
  free(c.elem_off);
  free(c.pdt);
  free(c.gdt);
  free(c.rdt);
  free(c.decays);
  free(c.bdt);
  free(c.g);
  free(c.m1);
  free(c.m2);
  free(tmp_a);
  free(tmp_b);
  free(target);
  sp_mlp_acts_free(acts);
  sp_plan_free(plan);
  sp_mlp_free(mlp);
  return rc;
}
