/* shardplane-worker's MLP trainer: the reference MLP of mlp.h driven
 * through the FSDP runtime's schedule, unit by unit, over the runtime's
 * views (train_io.h). On the CPU the layers run as sp_mlp_forward /
 * sp_mlp_backward on host activations; on a GPU (the runtime's storage on
 * a device, --device cuda:N) as their mlp_cuda.h twins on device
 * activations, the views being device memory, with the runtime's compute
 * stream ordering both. The schedule around them is the same.
 *
 * A step is grad_accum micro-batches (sp_mlp_train_cfg says which
 * samples each is): forward and backward of each, the reductions adding
 * up in the shard gradients (or, with no_sync, the unsharded gradients
 * adding up until the last micro-batch reduces them), each micro-batch's
 * loss scaled by 1/K; then clipping and the optimizer step. */
#ifndef SP_MLP_TRAIN_H
#define SP_MLP_TRAIN_H

#include <stdint.h>

#include "lib/shardplane.h"
#include "mlp.h"
#include "train_flags.h"

typedef struct sp_mlp_trainer sp_mlp_trainer;

/* Sets up the trainer of rank sp_session_rank(s): cfg->global_batch
 * samples a step over every rank and micro-batch, each rank an equal
 * share of every micro-batch. mlp, f, s and cfg are borrowed, for the
 * trainer's life. Errors: SP_ENOMEM, the activations' (SP_ETOOBIG), and
 * on a GPU sp_mlp_cuda_new's. */
int sp_mlp_trainer_new(const sp_mlp *mlp, sp_fsdp *f, sp_session *s,
                       const sp_mlp_train_cfg *cfg, sp_mlp_trainer **out,
                       sp_diag *d);
void sp_mlp_trainer_free(sp_mlp_trainer *tr);
/* Bytes of the host activations and scratch by category (held from
 * sp_mlp_trainer_new on; what sp_train_mem_predict predicts). */
sp_act_bytes sp_mlp_trainer_act_bytes(const sp_mlp_trainer *tr);

/* One optimizer step (index step, 0-based); *loss receives the global
 * mean training loss. A collective: every rank calls it. */
int sp_mlp_trainer_step(sp_mlp_trainer *tr, uint64_t step, double *loss,
                        sp_diag *d);

#endif
