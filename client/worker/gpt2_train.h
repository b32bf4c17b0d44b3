/* shardplane-worker's GPT-2 trainer: the model of gpt2.h driven through the
 * FSDP runtime's schedule, unit by unit, on the byte data of gpt2_data.h.
 *
 * Every block that is a unit (wrap type GPT2Block) is unsharded by
 * pre_forward right before its forward and by pre_backward before its
 * backward, and its gradient reduced by post_backward right after; the
 * root unit holds the embeddings, ln_f and the tied head, so the head's
 * and the lookup's shares of wte's gradient add up in the root's gradient
 * before post_backward(0) reduces it. A plan that puts a block's
 * parameters anywhere else (a unit per Conv1D) is refused: the trainer
 * would need their views outside their unit's window.
 *
 * Loss scaling (as the MLP trainer's): each rank computes the mean over
 * its own tokens of a micro-batch, divided by the micro-batches of the
 * step; the runtime's reduction averages over the ranks, so the gradient
 * is that of the global mean (all ranks hold equal shares).
 *
 * On a GPU (the runtime's storage on a device, --device cuda:N) the same
 * schedule runs gpt2_cuda.h's pieces on the runtime's compute stream, on
 * the same data; the loss is reduced in device memory. */
#ifndef SP_GPT2_TRAIN_H
#define SP_GPT2_TRAIN_H

#include <stdint.h>

#include "gpt2.h"
#include "gpt2_data.h"
#include "lib/shardplane.h"
#include "mlp.h"
#include "gpt2_trainer_check.h"
#include "train_flags.h"

typedef struct sp_gpt2_trainer sp_gpt2_trainer;

/* Sets up the trainer of rank sp_session_rank(s): cfg->global_batch
 * sequences a step over every rank and micro-batch, of flags->seq_len
 * tokens (0: the context), from data (what sp_gpt2_trainer_check kept of
 * flags->data); sets the BLAS threads to flags->threads. g, f, s, cfg,
 * flags and data are borrowed, for the trainer's life. Errors:
 * SP_EUNSUPPORTED (the plan, naming a parameter and the wrap type to
 * use), SP_EINVAL (--seq-len over the context, or no data), SP_ENOMEM,
 * SP_ETOOBIG. */
int sp_gpt2_trainer_new(const sp_gpt2 *g, sp_fsdp *f, sp_session *s,
                        const sp_mlp_train_cfg *cfg,
                        const sp_train_flags *flags, const sp_gpt2_data *data,
                        sp_gpt2_trainer **out, sp_diag *d);
void sp_gpt2_trainer_free(sp_gpt2_trainer *tr);

/* One optimizer step (index step, 0-based): the micro-batches' forward and
 * backward, clipping, the optimizer; *loss receives the global mean
 * training loss. A collective: every rank calls it. */
int sp_gpt2_trainer_step(sp_gpt2_trainer *tr, uint64_t step, double *loss,
                         sp_diag *d);
/* The mean loss over flags->eval_batches micro-batches of held-out
 * windows (window v for v = (e * W + r) * B + q of rank r, taken modulo
 * the number of windows), a forward-only pass. A collective. */
int sp_gpt2_trainer_eval(sp_gpt2_trainer *tr, double *loss, sp_diag *d);
/* Where the training thread spent the last step (sp_gpt2_trainer_step):
 * in the model's kernels; in the runtime's schedule calls (all-gathers
 * waited for, gradients cast and queued, reductions waited for at
 * finish_backward: the collectives themselves run on the runtime's
 * communication thread, overlapping the kernels, so this is the part of
 * them compute did not hide); in clipping and the optimizer. comm_s: what
 * the runtime's communication thread was busy meanwhile (collectives,
 * waiting for the peers included, and their casts: sp_fsdp_stats.
 * comm_busy_s), overlapping the rest. On a GPU the kernels run
 * asynchronously: compute_s is the time to enqueue them, except that each
 * micro-batch's forward waits for its loss, and the step's end for the
 * reduced loss. */
typedef struct sp_gpt2_times {
  double compute_s, wait_s, optim_s, comm_s;
} sp_gpt2_times;
sp_gpt2_times sp_gpt2_trainer_times(const sp_gpt2_trainer *tr);
/* Tokens a step trains over every rank (global_batch * seq_len). */
uint64_t sp_gpt2_trainer_tokens_per_step(const sp_gpt2_trainer *tr);
/* Bytes of the model's activations and scratch on this rank by category
 * (held from sp_gpt2_trainer_new on; outside the runtime's counted
 * memory; what sp_train_mem_predict predicts for the job). */
sp_act_bytes sp_gpt2_trainer_act_bytes(const sp_gpt2_trainer *tr);
/* Tokens one sp_gpt2_trainer_eval reads over every rank. */
uint64_t sp_gpt2_trainer_eval_tokens(const sp_gpt2_trainer *tr);
/* Where the data came from, for the first progress line. */
const char *sp_gpt2_trainer_data_source(const sp_gpt2_trainer *tr);

#endif
