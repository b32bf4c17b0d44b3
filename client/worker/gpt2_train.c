/* shardplane-worker's GPT-2 trainer (gpt2_train.h). */
#include "gpt2_train.h"

#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "plan/plan.h"
#include "train_memory.h"
#include "gpt2_cuda.h"
#include "gpt2_trainer_check.h"

struct sp_gpt2_trainer {
  const sp_gpt2 *g;
  sp_fsdp *f;
  sp_session *s;
  const sp_plan *plan;
  const sp_mlp_train_cfg *cfg;
  const sp_train_flags *flags;
  const sp_gpt2_data *data; /* sp_gpt2_trainer_check's, borrowed */
  sp_gpt2_acts *acts;       /* on the CPU */
  sp_gpt2_cuda *gpu;        /* on a GPU (the runtime's storage on a device) */
  int32_t *tok, *tgt;       /* the micro-batch's host arrays, of acts or gpu */
  uint32_t *block_unit;     /* per block: its unit, or 0 (the root's) */
  uint32_t head_unit;       /* lm_head's unit (empty: the head is tied), or 0 */
  size_t B, T;              /* a micro-batch's sequences on this rank, tokens */
  uint32_t rank, world;
  sp_gpt2_times times; /* of the step in progress */
};

/* Time of a call, added to one of the step's counters. */
#define TIMED(counter, call)                 \
  do {                                       \
    double t0_ = sp_clock_s();               \
    rc = (call);                             \
    tr->times.counter += sp_clock_s() - t0_; \
  } while (0)

static void *io_param(void *u, int32_t p) { return sp_fsdp_param(u, p); }
static void *io_grad(void *u, int32_t p) { return sp_fsdp_param_grad(u, p); }
static sp_dtype io_param_dtype(void *u, int32_t p) {
  return sp_fsdp_param_dtype(u, p);
}
static void *io_buffer(void *u, int32_t b) { return sp_fsdp_buffer(u, b); }
static sp_dtype io_buffer_dtype(void *u, int32_t b) {
  return sp_fsdp_buffer_dtype(u, b);
}

int sp_gpt2_trainer_new(const sp_gpt2 *g, sp_fsdp *f, sp_session *s,
                        const sp_mlp_train_cfg *cfg,
                        const sp_train_flags *flags, const sp_gpt2_data *data,
                        sp_gpt2_trainer **out, sp_diag *d) {
  *out = NULL;
  if (data == NULL) return sp_diag_set(d, SP_EINVAL, "no data");
  sp_gpt2_trainer *tr = calloc(1, sizeof *tr);
  if (tr == NULL) return sp_diag_set(d, SP_ENOMEM, "no memory");
  tr->g = g;
  tr->f = f;
  tr->s = s;
  tr->plan = sp_session_plan(s);
  tr->cfg = cfg;
  tr->flags = flags;
  tr->data = data;
  tr->rank = sp_session_rank(s);
  tr->world = sp_session_world(s);
  tr->T = sp_gpt2_trainer_seq_len(g, flags);
  tr->B = cfg->global_batch / cfg->grad_accum / tr->world;
  int rc = 0;
  tr->block_unit = calloc((size_t)g->n_layer, sizeof *tr->block_unit);
  if (tr->block_unit == NULL) rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  if (rc == 0)
    rc = sp_gpt2_trainer_check_job(g, tr->plan, flags, tr->block_unit,
                                   &tr->head_unit, d);
  /* the layout the memory model counted (train_memory.h) */
  sp_gpt2_shape sh = {tr->B, tr->T, flags->checkpointing,
                      sp_train_mem_f32_views(tr->plan)};
  if (rc == 0 && sp_fsdp_on_device(f)) {
    rc = sp_gpt2_cuda_new_with(g, &sh, sp_fsdp_cuda_stream(f), &tr->gpu, d);
    if (rc == 0) {
      tr->tok = sp_gpt2_cuda_tokens(tr->gpu);
      tr->tgt = sp_gpt2_cuda_targets(tr->gpu);
    }
  } else if (rc == 0) {
    rc = sp_gpt2_acts_new_with(g, sh.B, sh.T, sh.checkpointing, sh.f32_views,
                               &tr->acts, d);
    if (rc != 0)
      sp_diag_prefix(d, rc, "activations of %zu x %zu tokens", tr->B, tr->T);
    else {
      tr->tok = tr->acts->tok;
      tr->tgt = tr->acts->tgt;
    }
  }
  if (rc != 0) {
    sp_gpt2_trainer_free(tr);
    return rc;
  }
  /* the BLAS's own threads, one by default: ranks share the cores */
  openblas_set_num_threads((int)flags->threads);
  *out = tr;
  return 0;
}

void sp_gpt2_trainer_free(sp_gpt2_trainer *tr) {
  if (tr == NULL) return;
  sp_gpt2_acts_free(tr->acts);
  sp_gpt2_cuda_free(tr->gpu);
  free(tr->block_unit);
  free(tr);
}

sp_gpt2_times sp_gpt2_trainer_times(const sp_gpt2_trainer *tr) {
  return tr->times;
}

uint64_t sp_gpt2_trainer_tokens_per_step(const sp_gpt2_trainer *tr) {
  return (uint64_t)tr->cfg->global_batch * tr->T;
}

sp_act_bytes sp_gpt2_trainer_act_bytes(const sp_gpt2_trainer *tr) {
  return tr->gpu ? sp_gpt2_cuda_act_bytes(tr->gpu) : tr->acts->mem;
}

uint64_t sp_gpt2_trainer_eval_tokens(const sp_gpt2_trainer *tr) {
  return (uint64_t)tr->flags->eval_batches * tr->B * tr->T * tr->world;
}

const char *sp_gpt2_trainer_data_source(const sp_gpt2_trainer *tr) {
  return tr->data->source;
}

/* The model's pieces on the CPU or, when the runtime is on a GPU, there. */
static int embed_forward(sp_gpt2_trainer *tr, const sp_gpt2_io *io,
                         sp_diag *d) {
  if (tr->gpu) return sp_gpt2_cuda_embed_forward(tr->gpu, io, d);
  return sp_gpt2_embed_forward(tr->g, io, tr->acts, d);
}
static int block_forward(sp_gpt2_trainer *tr, size_t l, const sp_gpt2_io *io,
                         sp_diag *d) {
  if (tr->gpu) return sp_gpt2_cuda_block_forward(tr->gpu, l, io, d);
  return sp_gpt2_block_forward(tr->g, l, io, tr->acts, d);
}
static int head_forward(sp_gpt2_trainer *tr, const sp_gpt2_io *io, double denom,
                        double *loss, sp_diag *d) {
  if (tr->gpu) return sp_gpt2_cuda_head_forward(tr->gpu, io, denom, loss, d);
  return sp_gpt2_head_forward(tr->g, io, tr->acts, denom, loss, d);
}
static int head_backward(sp_gpt2_trainer *tr, const sp_gpt2_io *io,
                         double denom, sp_diag *d) {
  if (tr->gpu) return sp_gpt2_cuda_head_backward(tr->gpu, io, denom, d);
  return sp_gpt2_head_backward(tr->g, io, tr->acts, denom, d);
}
static int block_backward(sp_gpt2_trainer *tr, size_t l, const sp_gpt2_io *io,
                          sp_diag *d) {
  if (tr->gpu) return sp_gpt2_cuda_block_backward(tr->gpu, l, io, d);
  return sp_gpt2_block_backward(tr->g, l, io, tr->acts, d);
}
static int embed_backward(sp_gpt2_trainer *tr, const sp_gpt2_io *io,
                          sp_diag *d) {
  if (tr->gpu) return sp_gpt2_cuda_embed_backward(tr->gpu, io, d);
  return sp_gpt2_embed_backward(tr->g, io, tr->acts, d);
}

/* The micro-batch's tokens, written into tr->tok / tgt, to the device. */
static int upload(sp_gpt2_trainer *tr, sp_diag *d) {
  return tr->gpu ? sp_gpt2_cuda_upload(tr->gpu, d) : 0;
}

/* A sum over the ranks of one double: on a GPU the runtime reduces device
 * memory. */
static int all_reduce_sum(sp_gpt2_trainer *tr, double *v, sp_diag *d) {
  if (!tr->gpu) return sp_fsdp_all_reduce(tr->f, v, 1, SP_FLOAT64, d);
  int rc = sp_gpt2_cuda_set_scalar(tr->gpu, *v, d);
  if (rc == 0)
    rc = sp_fsdp_all_reduce(tr->f, sp_gpt2_cuda_scalar(tr->gpu), 1, SP_FLOAT64,
                            d);
  if (rc == 0) rc = sp_gpt2_cuda_get_scalar(tr->gpu, v, d);
  return rc;
}

/* The forward of the micro-batch in tr->tok / tgt: *loss its local loss
 * over denom tokens. */
static int forward(sp_gpt2_trainer *tr, const sp_gpt2_io *io, double denom,
                   double *loss, sp_diag *d) {
  sp_fsdp *f = tr->f;
  const sp_gpt2 *g = tr->g;
  int rc = upload(tr, d);
  if (rc == 0) TIMED(wait_s, sp_fsdp_root_pre_forward(f, d));
  if (rc == 0) TIMED(compute_s, embed_forward(tr, io, d));
  for (int64_t l = 0; rc == 0 && l < g->n_layer; l++) {
    uint32_t u = tr->block_unit[l];
    if (u) TIMED(wait_s, sp_fsdp_pre_forward(f, u, d));
    if (rc == 0) TIMED(compute_s, block_forward(tr, (size_t)l, io, d));
    if (rc == 0 && u) TIMED(wait_s, sp_fsdp_post_forward(f, u, d));
  }
  if (rc == 0 && tr->head_unit)
    TIMED(wait_s, sp_fsdp_pre_forward(f, tr->head_unit, d));
  if (rc == 0) TIMED(compute_s, head_forward(tr, io, denom, loss, d));
  if (rc == 0 && tr->head_unit)
    TIMED(wait_s, sp_fsdp_post_forward(f, tr->head_unit, d));
  if (rc == 0) TIMED(wait_s, sp_fsdp_root_post_forward(f, d));
  return rc;
}

static int backward(sp_gpt2_trainer *tr, const sp_gpt2_io *io, double denom,
                    sp_diag *d) {
  sp_fsdp *f = tr->f;
  const sp_gpt2 *g = tr->g;
  int rc;
  TIMED(wait_s, sp_fsdp_root_pre_backward(f, d));
  if (rc == 0 && tr->head_unit)
    TIMED(wait_s, sp_fsdp_pre_backward(f, tr->head_unit, d));
  if (rc == 0) TIMED(compute_s, head_backward(tr, io, denom, d));
  if (rc == 0 && tr->head_unit)
    TIMED(wait_s, sp_fsdp_post_backward(f, tr->head_unit, d));
  for (int64_t l = g->n_layer; rc == 0 && l-- > 0;) {
    uint32_t u = tr->block_unit[l];
    if (u) TIMED(wait_s, sp_fsdp_pre_backward(f, u, d));
    if (rc == 0) TIMED(compute_s, block_backward(tr, (size_t)l, io, d));
    if (rc == 0 && u) TIMED(wait_s, sp_fsdp_post_backward(f, u, d));
  }
  if (rc == 0) TIMED(compute_s, embed_backward(tr, io, d));
  if (rc == 0) TIMED(wait_s, sp_fsdp_post_backward(f, 0, d));
  if (rc == 0) TIMED(wait_s, sp_fsdp_finish_backward(f, d));
  return rc;
}

int sp_gpt2_trainer_step(sp_gpt2_trainer *tr, uint64_t step, double *loss,
                         sp_diag *d) {
  sp_gpt2_io io = {io_param,  io_grad,         io_param_dtype,
                   io_buffer, io_buffer_dtype, tr->f};
  const sp_mlp_train_cfg *cfg = tr->cfg;
  uint32_t k = cfg->grad_accum;
  uint64_t micro = cfg->global_batch / k;
  double denom = (double)(tr->B * tr->T) * k, local = 0;
  sp_session_set_step(tr->s, step + 1); /* reported from 1 */
  memset(&tr->times, 0, sizeof tr->times);
  sp_fsdp_stats st0, st1;
  sp_fsdp_get_stats(tr->f, &st0);
  int rc = 0;
  for (uint32_t j = 0; rc == 0 && j < k; j++) {
    /* samples [j*m + r*B, j*m + (r+1)*B) of the step (gpt2_data.h) */
    sp_gpt2_data_train(tr->data, step, j * micro + (uint64_t)tr->rank * tr->B,
                       tr->B, tr->T, tr->tok, tr->tgt);
    if (cfg->no_sync)
      rc = sp_fsdp_set_requires_gradient_sync(tr->f, j + 1 == k, d);
    double part = 0;
    if (rc == 0) rc = forward(tr, &io, denom, &part, d);
    if (rc == 0) rc = backward(tr, &io, denom, d);
    local += part;
  }
  if (rc == 0 && cfg->clip_grad_norm > 0)
    TIMED(optim_s, sp_fsdp_clip_grad_norm(tr->f, cfg->clip_grad_norm, NULL, d));
  if (rc == 0) TIMED(optim_s, sp_fsdp_optim_step(tr->f, NULL, d));
  /* the global loss: local means weighted equally (equal shares) */
  double sum = local;
  if (rc == 0) rc = all_reduce_sum(tr, &sum, d);
  *loss = sum / sp_fsdp_world_now(tr->f);
  sp_fsdp_get_stats(tr->f, &st1);
  tr->times.comm_s = st1.comm_busy_s - st0.comm_busy_s;
  return rc;
}

int sp_gpt2_trainer_eval(sp_gpt2_trainer *tr, double *loss, sp_diag *d) {
  sp_gpt2_io io = {io_param,  io_grad,         io_param_dtype,
                   io_buffer, io_buffer_dtype, tr->f};
  size_t count = sp_gpt2_data_val_count(tr->data, tr->T);
  double denom = (double)(tr->B * tr->T), sum = 0;
  int rc = 0;
  for (uint32_t e = 0; rc == 0 && e < tr->flags->eval_batches; e++) {
    for (size_t q = 0; q < tr->B; q++) {
      uint64_t v = (((uint64_t)e * tr->world + tr->rank) * tr->B + q) % count;
      sp_gpt2_data_val(tr->data, v, tr->T, tr->tok + q * tr->T,
                       tr->tgt + q * tr->T);
    }
    double part = 0;
    rc = forward(tr, &io, denom, &part, d);
    sum += part;
  }
  if (rc == 0) rc = all_reduce_sum(tr, &sum, d);
  *loss = sum / ((double)sp_fsdp_world_now(tr->f) * tr->flags->eval_batches);
  return rc;
}
