/* shardplane-worker's MLP trainer (mlp_train.h). */
#include "mlp_train.h"

#include <stdlib.h>

#include "mlp_cuda.h"
#include "train_io.h"

struct sp_mlp_trainer {
  sp_fsdp *f;
  sp_session *s;
  const sp_plan *plan;
  const sp_mlp *mlp;
  sp_mlp_acts *acts;    /* host: the batch is generated here */
  sp_mlp_cuda *gpu;     /* device activations; NULL on the CPU */
  uint32_t *layer_unit; /* per layer: the unit its module is, or 0 */
  size_t local_n;       /* samples of a micro-batch on this rank */
  const sp_mlp_train_cfg *cfg;
  uint32_t rank;
};

static int io_all_reduce(void *u, float *buf, size_t n, sp_diag *d) {
  return sp_fsdp_all_reduce(u, buf, n, SP_FLOAT32, d);
}

/* The model's view of the runtime: its unsharded views and its
 * all-reduce. */
static sp_mlp_io runtime_io(sp_fsdp *f) {
  return (sp_mlp_io){sp_train_io_param,
                     sp_train_io_grad,
                     sp_train_io_param_dtype,
                     sp_train_io_buffer,
                     sp_train_io_buffer_dtype,
                     io_all_reduce,
                     f};
}

/* sp_mlp_trainer_new's work on a zeroed tr; on failure what it holds is freed
 * by the caller. */
static int trainer_init(sp_mlp_trainer *tr, sp_fsdp *f, sp_session *s,
                        const sp_mlp *mlp, const sp_mlp_train_cfg *cfg,
                        sp_diag *d) {
  tr->f = f;
  tr->s = s;
  tr->plan = sp_session_plan(s);
  tr->mlp = mlp;
  tr->cfg = cfg;
  tr->rank = sp_session_rank(s);
  size_t local_n = cfg->global_batch / cfg->grad_accum / sp_session_world(s);
  tr->local_n = local_n;
  tr->layer_unit = calloc(mlp->n_layers, sizeof *tr->layer_unit);
  if (!tr->layer_unit) return sp_diag_set(d, SP_ENOMEM, "no memory");
  for (size_t l = 0; l < mlp->n_layers; l++)
    for (uint32_t u = 1; u < tr->plan->n_units; u++)
      if (tr->plan->units[u].module == mlp->layers[l].module)
        tr->layer_unit[l] = u;
  int rc = sp_mlp_acts_new(mlp, local_n, &tr->acts);
  if (rc < 0) return sp_diag_set(d, rc, "activations: %s", sp_strerror(rc));
  if (sp_fsdp_on_device(f))
    rc = sp_mlp_cuda_new(mlp, local_n, sp_fsdp_cuda_stream(f), &tr->gpu, d);
  return rc;
}

int sp_mlp_trainer_new(const sp_mlp *mlp, sp_fsdp *f, sp_session *s,
                       const sp_mlp_train_cfg *cfg, sp_mlp_trainer **out,
                       sp_diag *d) {
  *out = NULL;
  sp_mlp_trainer *tr = calloc(1, sizeof *tr);
  if (!tr) return sp_diag_set(d, SP_ENOMEM, "no memory");
  int rc = trainer_init(tr, f, s, mlp, cfg, d);
  if (rc < 0) {
    sp_mlp_trainer_free(tr);
    return rc;
  }
  *out = tr;
  return 0;
}

sp_act_bytes sp_mlp_trainer_act_bytes(const sp_mlp_trainer *tr) {
  return tr->acts->mem;
}

void sp_mlp_trainer_free(sp_mlp_trainer *tr) {
  if (!tr) return;
  sp_mlp_cuda_free(tr->gpu);
  sp_mlp_acts_free(tr->acts);
  free(tr->layer_unit);
  free(tr);
}

/* The dtype activations leave the last layer in: its unit's param dtype. */
static sp_dtype output_dtype(const sp_mlp_trainer *tr) {
  for (size_t l = tr->mlp->n_layers; l-- > 0;) {
    int32_t w = tr->mlp->layers[l].weight;
    if (w >= 0) return tr->plan->units[tr->plan->param_unit[w]].param_dtype;
  }
  return SP_FLOAT32;
}

/* The micro-batch's first sample on this rank, and its size over every
 * rank (the RunningNorm mean's global batch). */
static uint64_t micro_first(const sp_mlp_trainer *tr, uint32_t j) {
  uint64_t micro = tr->cfg->global_batch / tr->cfg->grad_accum;
  return j * micro + (uint64_t)tr->rank * tr->local_n;
}

static uint64_t micro_global(const sp_mlp_trainer *tr) {
  return tr->cfg->global_batch / tr->cfg->grad_accum;
}

/* Sync off for every micro-batch but the last (no_sync). */
static int set_sync(sp_mlp_trainer *tr, uint32_t j, sp_diag *d) {
  if (!tr->cfg->no_sync) return 0;
  return sp_fsdp_set_requires_gradient_sync(tr->f, j + 1 == tr->cfg->grad_accum,
                                            d);
}

/* After the micro-batches: clipping, then the optimizer. */
static int optimizer_step(sp_mlp_trainer *tr, sp_diag *d) {
  int rc = 0;
  if (tr->cfg->clip_grad_norm > 0)
    rc = sp_fsdp_clip_grad_norm(tr->f, tr->cfg->clip_grad_norm, NULL, d);
  if (rc == 0) rc = sp_fsdp_optim_step(tr->f, NULL, d);
  return rc;
}

/* One micro-batch on the GPU: micro_step's schedule with the device
 * layers. The local loss stays on the device, summed over the
 * micro-batches, for the all-reduce. */
static int micro_step_gpu(sp_mlp_trainer *tr, uint64_t step, uint32_t j,
                          sp_diag *d) {
  sp_fsdp *f = tr->f;
  const sp_mlp *mlp = tr->mlp;
  sp_mlp_cuda *g = tr->gpu;
  sp_mlp_io io = runtime_io(f);
  sp_mlp_batch(mlp, step, micro_first(tr, j), tr->local_n, tr->acts->x[0],
               tr->acts->t);
  int rc = set_sync(tr, j, d);
  if (rc == 0) rc = sp_mlp_cuda_set_batch(g, tr->acts->x[0], tr->acts->t, d);
  if (rc == 0) rc = sp_fsdp_root_pre_forward(f, d);
  for (size_t l = 0; rc == 0 && l < mlp->n_layers; l++) {
    uint32_t u = tr->layer_unit[l];
    if (u) rc = sp_fsdp_pre_forward(f, u, d);
    if (rc == 0) rc = sp_mlp_cuda_forward(g, l, &io, micro_global(tr), d);
    if (rc == 0 && u) rc = sp_fsdp_post_forward(f, u, d);
  }
  if (rc == 0)
    rc = sp_mlp_cuda_loss_over(g, output_dtype(tr),
                               tr->local_n * tr->cfg->grad_accum, j > 0, d);
  if (rc == 0) rc = sp_fsdp_root_post_forward(f, d);
  if (rc == 0) rc = sp_fsdp_root_pre_backward(f, d);
  for (size_t l = mlp->n_layers; rc == 0 && l-- > 0;) {
    uint32_t u = tr->layer_unit[l];
    if (u) rc = sp_fsdp_pre_backward(f, u, d);
    if (rc == 0) rc = sp_mlp_cuda_backward(g, l, &io, d);
    if (rc == 0 && u) rc = sp_fsdp_post_backward(f, u, d);
  }
  if (rc == 0) rc = sp_fsdp_post_backward(f, 0, d);
  if (rc == 0) rc = sp_fsdp_finish_backward(f, d);
  if (rc == 0) rc = sp_mlp_cuda_count_step(g, &io, d);
  return rc;
}

static int step_gpu(sp_mlp_trainer *tr, uint64_t step, double *loss,
                    sp_diag *d) {
  sp_fsdp *f = tr->f;
  sp_session_set_step(tr->s, step + 1); /* reported from 1 */
  int rc = 0;
  for (uint32_t j = 0; rc == 0 && j < tr->cfg->grad_accum; j++)
    rc = micro_step_gpu(tr, step, j, d);
  if (rc == 0) rc = optimizer_step(tr, d);
  double sum = 0;
  if (rc == 0)
    rc = sp_fsdp_all_reduce(f, sp_mlp_cuda_loss_ptr(tr->gpu), 1, SP_FLOAT64, d);
  if (rc == 0) rc = sp_mlp_cuda_read_loss(tr->gpu, &sum, d);
  *loss = sum / sp_fsdp_world_now(tr->f);
  return rc;
}

/* One micro-batch; *local receives its scaled local loss. */
static int micro_step(sp_mlp_trainer *tr, uint64_t step, uint32_t j,
                      double *local, sp_diag *d) {
  sp_fsdp *f = tr->f;
  const sp_mlp *mlp = tr->mlp;
  sp_mlp_io io = runtime_io(f);
  sp_mlp_batch(mlp, step, micro_first(tr, j), tr->local_n, tr->acts->x[0],
               tr->acts->t);
  int rc = set_sync(tr, j, d);
  if (rc == 0) rc = sp_fsdp_root_pre_forward(f, d);
  for (size_t l = 0; rc == 0 && l < mlp->n_layers; l++) {
    uint32_t u = tr->layer_unit[l];
    if (u) rc = sp_fsdp_pre_forward(f, u, d);
    if (rc == 0)
      rc = sp_mlp_forward(mlp, l, &io, tr->acts, micro_global(tr), d);
    if (rc == 0 && u) rc = sp_fsdp_post_forward(f, u, d);
  }
  if (rc == 0) {
    *local = sp_mlp_loss_over(mlp, tr->acts, tr->acts->t, output_dtype(tr),
                              tr->local_n * tr->cfg->grad_accum);
    rc = sp_fsdp_root_post_forward(f, d);
  }
  if (rc == 0) rc = sp_fsdp_root_pre_backward(f, d);
  for (size_t l = mlp->n_layers; rc == 0 && l-- > 0;) {
    uint32_t u = tr->layer_unit[l];
    if (u) rc = sp_fsdp_pre_backward(f, u, d);
    if (rc == 0) rc = sp_mlp_backward(mlp, l, &io, tr->acts, d);
    if (rc == 0 && u) rc = sp_fsdp_post_backward(f, u, d);
  }
  if (rc == 0) rc = sp_fsdp_post_backward(f, 0, d);
  if (rc == 0) rc = sp_fsdp_finish_backward(f, d);
  if (rc == 0) sp_mlp_count_step(mlp, &io);
  return rc;
}

static int step_cpu(sp_mlp_trainer *tr, uint64_t step, double *loss,
                    sp_diag *d) {
  sp_session_set_step(tr->s, step + 1); /* reported from 1 */
  double local = 0;
  int rc = 0;
  for (uint32_t j = 0; rc == 0 && j < tr->cfg->grad_accum; j++) {
    double part = 0;
    rc = micro_step(tr, step, j, &part, d);
    local += part;
  }
  if (rc == 0) rc = optimizer_step(tr, d);
  /* the global loss: local means weighted equally (equal local batches) */
  double sum = local;
  if (rc == 0) rc = sp_fsdp_all_reduce(tr->f, &sum, 1, SP_FLOAT64, d);
  *loss = sum / sp_fsdp_world_now(tr->f);
  return rc;
}

int sp_mlp_trainer_step(sp_mlp_trainer *tr, uint64_t step, double *loss,
                        sp_diag *d) {
  return tr->gpu ? step_gpu(tr, step, loss, d) : step_cpu(tr, step, loss, d);
}
