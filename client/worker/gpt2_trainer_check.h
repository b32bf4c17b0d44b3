/* What the GPT-2 trainer (gpt2_train.h) would refuse, checked before a
 * worker starts: no runtime, no kernels, so the `shardplane` command links
 * it without the model. */
#ifndef SP_GPT2_TRAINER_CHECK_H
#define SP_GPT2_TRAINER_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "gpt2.h"
#include "gpt2_data.h"
#include "plan/plan.h"
#include "train_flags.h"

/* What sp_gpt2_trainer_new would refuse of this plan and these flags,
 * checked without a runtime (train_model.h, before any worker starts):
 * the plan (SP_EUNSUPPORTED naming a parameter and --wrap-type
 * GPT2Block), --seq-len over the context (SP_EINVAL), the data (the
 * errors of sp_gpt2_data_open, naming --data; SP_EINVAL when it holds a
 * byte outside the vocabulary). Reads the data once: with keep, the
 * data checked goes to *keep (the caller frees it with
 * sp_gpt2_data_free), for sp_gpt2_trainer_new, so that a worker reads
 * it once in all; NULL on failure. */
int sp_gpt2_trainer_check(const sp_gpt2 *g, const sp_plan *pl,
                          const sp_train_flags *flags, sp_gpt2_data **keep,
                          sp_diag *d);

/* The tokens of a sequence: --seq-len, else the context. */
size_t sp_gpt2_trainer_seq_len(const sp_gpt2 *g, const sp_train_flags *flags);

/* --seq-len against the context (SP_EINVAL), then every parameter in the
 * root or in its own block's unit (SP_EUNSUPPORTED naming it and
 * --wrap-type GPT2Block). block_unit (n_layer entries) and head_unit
 * receive each block's and lm_head's unit (0: the root's) when not NULL. */
int sp_gpt2_trainer_check_job(const sp_gpt2 *g, const sp_plan *pl,
                              const sp_train_flags *flags, uint32_t *block_unit,
                              uint32_t *head_unit, sp_diag *d);

#endif
