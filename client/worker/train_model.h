/* What shardplane-worker trains on a spec, and what of the job can be
 * checked without a worker. `shardplane run` makes these checks before it
 * starts any process and the worker before its rendezvous, both through
 * these functions: a job the workers would refuse is refused before any
 * of them starts, in the same words.
 *
 * A GPT-2 spec (gpt2.h) trains as one, else a sequential MLP (mlp.h) as
 * the reference MLP. Any other spec is refused unless the synthetic-
 * gradient cycle (the runtime's unshard / reduce / cast schedule with
 * gradients made up from the parameters, for benchmarks) is asked for by
 * name: a user who asked for training gets training or an error. */
#ifndef SP_TRAIN_MODEL_H
#define SP_TRAIN_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "plan/model.h"
#include "plan/plan.h"
#include "gpt2.h"
#include "gpt2_data.h"
#include "mlp.h"
#include "train_flags.h"

/* At most one of them; neither: the synthetic-gradient cycle. */
typedef struct sp_train_model {
  sp_gpt2 *gpt;
  sp_mlp *mlp;
  /* a GPT-2's data, read by sp_train_model_check for its trainer */
  sp_gpt2_data *data;
} sp_train_model;

/* The model of spec m (borrowed until sp_train_model_clear): with
 * synthetic neither; else a GPT-2, failing that the MLP. A spec that is
 * neither is SP_EUNSUPPORTED with both reasons and the flag:
 * `M.json: not a GPT-2: no parameter transformer.wte.weight; not a
 * sequential MLP: Linear "layers.0": bias shape (--synthetic runs the
 * synthetic-gradient cycle on it instead of training)`. SP_ENOMEM. */
int sp_train_model_pick(const sp_model *m, bool synthetic, sp_train_model *out,
                        sp_diag *d);
void sp_train_model_clear(sp_train_model *t);

/* The job as the model's trainer will take it, over `world` ranks
 * (world_name names what gave it: "--nproc", "the world size"): the
 * training flags with steps, lr (the default unless lr_given) and
 * global_batch, and the spec's "training" for what they do not say
 * (sp_train_flags_finish_spec; the synthetic cycle, which trains no model,
 * takes no spec defaults and has no batch), and a GPT-2's
 * sp_gpt2_trainer_check of the plan, --seq-len and --data. cfg receives
 * the trainer's configuration. SP_EINVAL naming the flag, SP_EUNSUPPORTED
 * naming the wrap that fixes the plan (--wrap-type GPT2Block), the
 * data's errors. A GPT-2's data, read for the check, stays in t->data
 * for its trainer (freed by sp_train_model_clear). */
int sp_train_model_check(sp_train_model *t, const sp_plan *plan,
                         const sp_train_flags *flags, uint32_t steps, double lr,
                         bool lr_given, uint32_t global_batch, uint32_t world,
                         const char *world_name, sp_mlp_train_cfg *cfg,
                         sp_diag *d);

#endif
