/* The reference model of shardplane-worker: a sequential MLP read from a
 * model spec, its deterministic data and initialisation, and its CPU
 * forward and backward. The unsharded single-process trainer the tests
 * compare against is tests/support/mlp_reference.h.
 *
 * The spec (examples/mlp.json): the root module (any type) holds an int64
 * scalar buffer "step"; its children "layers.0", "layers.1", ... run in
 * order and are of three types:
 *   Linear       weight [out, in], optional bias [out]:   y = x W^T + b
 *   RunningNorm  weight [h], bias [h]; buffers running_mean [h] (any
 *                floating dtype), optional num_batches_tracked (any integer
 *                dtype, scalar) and optional "seen" (bool, scalar):
 *                  m = mean of x over the *global* batch (all-reduced),
 *                  running_mean <- 0.9 * running_mean + 0.1 * m  (computed in
 *                  float32, stored in the buffer's current dtype),
 *                  num_batches_tracked += 1, seen = true,
 *                  y = (x - running_mean) * weight + bias
 *                running_mean is a constant for backward. Unlike BatchNorm
 *                the output of a sample does not depend on how the batch is
 *                split, so a sharded run can match the single-process run.
 *   ReLU         no parameters.
 * Loss: 0.5 * mean over the batch of sum_j (y_j - t_j)^2.
 *
 * Precision: activations and gradients are kept in float32 arrays holding
 * values rounded to the compute dtype (the unit's param_dtype), as a
 * bfloat16 GEMM with float32 accumulation produces: every layer output and
 * every gradient is rounded (RNE, sp_cast) once; sums accumulate in float32
 * in a fixed order. Parameters are read from their views in param_dtype.
 */
#ifndef SP_MLP_H
#define SP_MLP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cast/dtype.h"
#include "plan/job.h"
#include "plan/model.h"
#include "base/sp_error.h"
#include "lib/shardplane.h"
#include "train_memory.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum sp_mlp_kind {
  SP_MLP_LINEAR = 1,
  SP_MLP_NORM = 2,
  SP_MLP_RELU = 3,
} sp_mlp_kind;

typedef struct sp_mlp_layer {
  sp_mlp_kind kind;
  int32_t module;       /* model module index */
  int32_t weight, bias; /* model param indices; -1 when absent */
  int32_t running_mean; /* model buffer indices; -1 when absent */
  int32_t num_batches_tracked;
  int32_t seen;
  int64_t in, out; /* features in and out */
} sp_mlp_layer;

typedef struct sp_mlp {
  const sp_model *model; /* borrowed */
  sp_mlp_layer *layers;
  size_t n_layers;
  int64_t in_dim, out_dim, max_dim;
  int32_t step_buffer; /* root "step" buffer, -1 when absent */
} sp_mlp;

/* Reads the layer chain from the spec. SP_EUNSUPPORTED (naming the module
 * or tensor) when the spec is not such an MLP: shardplane-worker then
 * refuses it unless asked for the synthetic-gradient cycle
 * (train_model.h). */
int sp_mlp_new(const sp_model *m, sp_mlp **out, sp_diag *d);
void sp_mlp_free(sp_mlp *mlp);

/* Deterministic synthetic data: samples [first, first + n) of step `step`
 * (a pure function of (step, sample index), so any split of the global
 * batch sees the same samples). x is n x in_dim, t is n x out_dim; either
 * may be NULL. x is uniform in [-1, 1) on a 2^-23 grid (exact in float32);
 * t_j = c_j + sin(sum_i a_ji x_i), with a_ji and c_j fixed by a hash. */
void sp_mlp_batch(const sp_mlp *mlp, uint64_t step, uint64_t first, size_t n,
                  float *x, float *t);

/* Deterministic initialisation by FQN, for any spec: elements
 * [start, start + n) of parameter `param` written to dst in the param's
 * dtype. Weights of ndim >= 2 uniform in +-1/sqrt(fan_in) from a hash of
 * (fqn, element); 1-D params named "weight" 1, other 1-D params 0 (plus
 * a small hashed term so tests see distinct values). Signature matches
 * sp_fsdp_opts.init_param (user unused). */
void sp_mlp_init_param(void *user, const sp_model *m, int32_t param,
                       int64_t start, int64_t n, void *dst);
/* Buffers: floating ones 0, integers 0, bools false; in the original
 * dtype. */
void sp_mlp_init_buffer(void *user, const sp_model *m, int32_t buffer,
                        void *dst);

/* Where a layer's tensors are: the trainer (sharded or not) supplies them.
 * Param views and gradients are in `pdtype` (the unit's param_dtype);
 * buffers in their own current dtype (bdtype per buffer via the callback). */
typedef struct sp_mlp_io {
  void *(*param)(void *user, int32_t param); /* view, pdtype */
  /* gradient, pdtype; NULL: the param takes no gradient */
  void *(*grad)(void *user, int32_t param);
  sp_dtype (*param_dtype)(void *user, int32_t param);
  void *(*buffer)(void *user, int32_t buffer);
  sp_dtype (*buffer_dtype)(void *user, int32_t buffer);
  /* Sum of buf[0..n) over every rank, in place (NULL: single process). */
  int (*all_reduce_sum)(void *user, float *buf, size_t n, sp_diag *d);
  void *user;
} sp_mlp_io;

/* Per-step activations of a local batch of n samples (owned by the
 * caller; sp_mlp_acts_new sizes them for n samples). */
typedef struct sp_mlp_acts {
  size_t n;
  /* x[l]: input of layer l (n x in); x[n_layers]: output; x[n_layers + 1]
   * is NULL */
  float **x;
  float *dx, *dy;   /* scratch, n x max_dim */
  float *t;         /* the targets, n x out_dim */
  sp_act_bytes mem; /* the arrays' bytes by category (train_memory.h) */
} sp_mlp_acts;
/* 0, SP_EINVAL (NULL), SP_ETOOBIG (n x width overflows), SP_ENOMEM
 * (mlp_acts.c, which also counts them for the memory model). */
int sp_mlp_acts_new(const sp_mlp *mlp, size_t n, sp_mlp_acts **out);
void sp_mlp_acts_free(sp_mlp_acts *a);
/* What sp_mlp_acts_new allocates for n samples, by category, without
 * allocating it. Errors as it. */
int sp_mlp_acts_count(const sp_mlp *mlp, size_t n, sp_act_bytes *out);
/* n x dim floats, zeroed (at least one: the activations, a layer's
 * transient scratch), or NULL with *rc set to SP_ETOOBIG (the bytes
 * overflow) or SP_ENOMEM; *rc is left alone on success. */
float *sp_mlp_floats(size_t n, int64_t dim, int *rc);

/* Forward of layer l: reads a->x[l], writes a->x[l+1]. global_n is the
 * global batch size (RunningNorm's mean; 1..2^24, at least a->n). Updates
 * the layer's buffers. A Linear or RunningNorm first rounds a->x[l] in place
 * to its compute dtype (the GEMM's input dtype; for l == 0 this is FSDP's
 * root input cast), a no-op when the previous layer already rounded to it.
 * RunningNorm calls io->all_reduce_sum also when a->n is 0. */
int sp_mlp_forward(const sp_mlp *mlp, size_t l, const sp_mlp_io *io,
                   sp_mlp_acts *a, uint64_t global_n, sp_diag *d);
/* Loss of the local batch (sum over its samples of 0.5*sum_j (y-t)^2,
 * divided by n) and the output gradient (y - t) / n rounded to the output
 * dtype, into a->dy. */
double sp_mlp_loss(const sp_mlp *mlp, sp_mlp_acts *a, const float *t,
                   sp_dtype out_dtype);
/* The same with another denominator than n: a micro-batch of k per
 * optimizer step divides by n * k, so that its loss and gradient are 1/k
 * of the micro-batch's mean and k of them add up to the step's mean
 * (gradient accumulation). dy = (y - t) / (float)denom rounded; returns
 * the sum / denom. 0 when denom or a->n is 0. */
double sp_mlp_loss_over(const sp_mlp *mlp, sp_mlp_acts *a, const float *t,
                        sp_dtype out_dtype, uint64_t denom);
/* Backward of layer l: reads a->dy (gradient of layer l's output), ADDS
 * the param gradients to io->grad's views (as autograd accumulates into
 * .grad: the float32 gradient plus the view's value in double, rounded
 * once to the view's dtype; the caller zeroes the views, or keeps them to
 * accumulate micro-batches) and writes the input gradient back into a->dy
 * (swapping with a->dx), except for l == 0. */
int sp_mlp_backward(const sp_mlp *mlp, size_t l, const sp_mlp_io *io,
                    sp_mlp_acts *a, sp_diag *d);
/* Increments the root "step" buffer (any integer dtype) if there is one. */
void sp_mlp_count_step(const sp_mlp *mlp, const sp_mlp_io *io);
#ifdef __cplusplus
}
#endif
#endif
