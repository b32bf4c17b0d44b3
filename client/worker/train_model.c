/* What shardplane-worker trains (train_model.h). */
#include "train_model.h"

#include <string.h>

#include "gpt2_trainer_check.h"

int sp_train_model_pick(const sp_model *m, bool synthetic, sp_train_model *out,
                        sp_diag *d) {
  memset(out, 0, sizeof *out);
  if (synthetic) return 0;
  sp_diag gd = {{0}}, md = {{0}};
  int rc = sp_gpt2_new(m, &out->gpt, &gd);
  if (rc == 0) return 0;
  if (rc != SP_EUNSUPPORTED) return sp_diag_set(d, rc, "%s", gd.msg);
  rc = sp_mlp_new(m, &out->mlp, &md);
  if (rc == 0) return 0;
  if (rc != SP_EUNSUPPORTED) return sp_diag_set(d, rc, "%s", md.msg);
  /* both messages start with the spec's name: it is said once */
  const char *mlp_why = strstr(md.msg, "not a sequential MLP");
  return sp_diag_set(d, SP_EUNSUPPORTED,
                     "%.240s; %.160s (--synthetic runs the synthetic-gradient "
                     "cycle on it instead of training)",
                     gd.msg, mlp_why ? mlp_why : md.msg);
}

void sp_train_model_clear(sp_train_model *t) {
  sp_gpt2_free(t->gpt);
  sp_mlp_free(t->mlp);
  sp_gpt2_data_free(t->data);
  memset(t, 0, sizeof *t);
}

int sp_train_model_check(sp_train_model *t, const sp_plan *plan,
                         const sp_train_flags *flags, uint32_t steps, double lr,
                         bool lr_given, uint32_t global_batch, uint32_t world,
                         const char *world_name, sp_mlp_train_cfg *cfg,
                         sp_diag *d) {
  bool synthetic = t->gpt == NULL && t->mlp == NULL;
  /* the one place a run's flags meet the spec's training defaults: the
   * worker's own check and shardplane run's, so both train the same */
  int rc = sp_train_flags_finish_spec(
      flags, synthetic ? NULL : plan->model, steps, lr, lr_given,
      synthetic ? 0 : global_batch, world, world_name, cfg, d);
  if (rc == 0 && t->gpt != NULL)
    rc = sp_gpt2_trainer_check(t->gpt, plan, flags, &t->data, d);
  return rc;
}
