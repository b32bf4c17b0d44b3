/* The unsharded single-process trainer of the reference MLP
 * (worker/mlp.h) that the tests compare shardplane-worker's sharded runs
 * against: the oracle, written on its own over the model's layers, so a
 * test checks two implementations against each other. */
#ifndef SP_TEST_MLP_REFERENCE_H
#define SP_TEST_MLP_REFERENCE_H

#include <stdint.h>

#include "base/sp_error.h"
#include "cast/dtype.h"
#include "plan/job.h"
#include "plan/model.h"
#include "worker/mlp.h"
#include "worker/train_flags.h"

/* The compute dtype of the network output, for sp_mlp_loss: the param
 * dtype of the last layer with parameters (float32 when none). */
sp_dtype sp_mlp_out_dtype(const sp_mlp *mlp, const sp_mlp_io *io);

/* The unsharded single-process run: sp_mlp_reference_train with
 * sp_mlp_train_cfg_init(steps, global_batch, lr).
 *
 * sp_mlp_reference_train: full float32 (master dtype) parameters; per
 * micro-batch, params cast to each unit's param_dtype, buffers cast once
 * to their compute dtype, forward, backward, gradients cast to
 * reduce_dtype and back (unless keep_low_precision_grads) and summed over
 * the micro-batches; then clipping and the optimizer (cfg). Units and
 * dtypes come from the plan of (model, job) with world size 1. losses[s] receives the loss of step s (may be NULL). On
 * return *params holds every model param (model order, each in its dtype,
 * concatenated; caller frees) and *buffers every buffer in its compute
 * dtype (concatenated, caller frees); either may be NULL.
 *
 * Exactly, so that a sharded trainer can follow it: params start from
 * sp_mlp_init_param, buffers from sp_mlp_init_buffer, then floating buffers
 * are sp_cast to their compute dtype. Micro-batch j of step s (0-based) as
 * sp_mlp_train_cfg says; forward of every layer; loss with
 * sp_mlp_out_dtype (losses[s]: the sum of the micro-batches' scaled
 * losses, the step's mean); backward from the last layer;
 * sp_mlp_count_step. Per param p with requires_grad, in its unit's
 * dtypes: g = sp_cast(grad, param_dtype -> reduce_dtype), then to the
 * param's own dtype, or to param_dtype with keep_low_precision_grads
 * (FSDP's cast_grad_to_param_dtype_if_needed), added to the step's
 * gradient (the sum rounded to that dtype). Clipping: the 2-norm of every
 * trainable gradient (squares summed in double), coef = max /
 * (norm + 1e-6), g = rne(g * coef) when coef < 1. The optimizer at
 * lr(step) (warmup-cosine as sp_optim_lr), on trainable params only, the
 * decay mask as sp_optim_decays, the formulas of sp_fsdp_optim_step in
 * its order of double operations (ISO C, no FMA contraction), moments
 * rounded to float32 and params once (RNE) to their dtype. Written on its
 * own (not through the runtime's optimizer), so the parity tests compare
 * two implementations. With SGD, no momentum and no decay this is
 * p = rne((double)p - lr * (double)g), as sp_fsdp_sgd_step.
 * Errors: SP_EINVAL (NULL, global_batch 0, over 2^24 or not a multiple of
 * grad_accum, a bad optimizer option or clip norm), SP_EUNSUPPORTED (not
 * an MLP spec), plan errors, SP_ENOMEM, SP_ETOOBIG. */
int sp_mlp_reference_run(const sp_model *m, const sp_job *job, uint32_t steps,
                         uint32_t global_batch, double lr, double *losses,
                         void **params, void **buffers, sp_diag *d);
int sp_mlp_reference_train(const sp_model *m, const sp_job *job,
                           const sp_mlp_train_cfg *cfg, double *losses,
                           void **params, void **buffers, sp_diag *d);

#endif
