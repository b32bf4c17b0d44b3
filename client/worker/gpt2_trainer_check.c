/* What the GPT-2 trainer would refuse of a plan, its flags and its data
 * (gpt2_trainer_check.h), checked without a runtime and without the
 * model's kernels: `shardplane run` asks before it starts any worker. */
#include "gpt2_trainer_check.h"

#include <stdbool.h>

/* The unit whose module is `module`, or 0. */
static uint32_t unit_of_module(const sp_plan *pl, int32_t module) {
  for (uint32_t u = 1; u < pl->n_units; u++)
    if (pl->units[u].module == module) return u;
  return 0;
}

/* Every parameter in the root or in its own block's unit; any other unit
 * is empty (lm_head, when Linear is wrapped). block_unit (n_layer
 * entries) and head_unit receive the units, when not NULL. */
static int check_plan(const sp_gpt2 *g, const sp_plan *pl, uint32_t *block_unit,
                      uint32_t *head_unit, sp_diag *d) {
  const sp_model *m = g->model;
  for (int64_t l = 0; block_unit != NULL && l < g->n_layer; l++)
    block_unit[l] = unit_of_module(pl, g->blocks[l].module);
  uint32_t head =
      g->lm_head_module >= 0 ? unit_of_module(pl, g->lm_head_module) : 0;
  if (head_unit != NULL) *head_unit = head;
  for (size_t p = 0; p < m->n_params; p++) {
    uint32_t u = (uint32_t)pl->param_unit[p];
    if (u == 0) continue;
    bool ok = false;
    for (int64_t l = 0; l < g->n_layer && !ok; l++) {
      const sp_module *bm = &m->modules[g->blocks[l].module];
      ok = u == unit_of_module(pl, g->blocks[l].module) &&
           (uint32_t)m->params[p].module >= (uint32_t)g->blocks[l].module &&
           (uint32_t)m->params[p].module < bm->subtree_end;
    }
    if (!ok)
      return sp_diag_set(d, SP_EUNSUPPORTED,
                         "%s: in unit %u (%s), which is not its block: the "
                         "GPT-2 trainer needs the blocks as units (--wrap-"
                         "type GPT2Block)",
                         m->params[p].fqn, u,
                         m->modules[pl->units[u].module].fqn);
  }
  for (uint32_t u = 1; u < pl->n_units; u++) {
    bool known = u == head;
    for (int64_t l = 0; l < g->n_layer && !known; l++)
      known = u == unit_of_module(pl, g->blocks[l].module);
    if (!known && pl->units[u].numel > 0)
      return sp_diag_set(d, SP_EUNSUPPORTED,
                         "unit %u (%s) is not a block: the GPT-2 trainer "
                         "needs the blocks as units (--wrap-type GPT2Block)",
                         u, m->modules[pl->units[u].module].fqn);
    if (!known)
      return sp_diag_set(d, SP_EUNSUPPORTED,
                         "unit %u (%s) is neither a block nor lm_head (use "
                         "--wrap-type GPT2Block)",
                         u, m->modules[pl->units[u].module].fqn);
  }
  return 0;
}

size_t sp_gpt2_trainer_seq_len(const sp_gpt2 *g, const sp_train_flags *flags) {
  return flags->seq_len ? flags->seq_len : (size_t)g->ctx;
}

int sp_gpt2_trainer_check_job(const sp_gpt2 *g, const sp_plan *pl,
                              const sp_train_flags *flags, uint32_t *block_unit,
                              uint32_t *head_unit, sp_diag *d) {
  size_t T = sp_gpt2_trainer_seq_len(g, flags);
  if (T > (size_t)g->ctx)
    return sp_diag_set(d, SP_EINVAL,
                       "--seq-len %zu: at most the model's "
                       "context, %lld",
                       T, (long long)g->ctx);
  return check_plan(g, pl, block_unit, head_unit, d);
}

int sp_gpt2_trainer_check(const sp_gpt2 *g, const sp_plan *pl,
                          const sp_train_flags *flags, sp_gpt2_data **keep,
                          sp_diag *d) {
  if (keep != NULL) *keep = NULL;
  int rc = sp_gpt2_trainer_check_job(g, pl, flags, NULL, NULL, d);
  sp_gpt2_data *data = NULL;
  if (rc == 0)
    rc = sp_gpt2_data_open(flags->data, sp_gpt2_trainer_seq_len(g, flags),
                           &data, d);
  /* the tokens are the data's bytes: a byte the vocabulary lacks would
   * stop training at the first window that holds it (none can with 256
   * tokens or more, and the scan is skipped) */
  for (size_t i = 0; rc == 0 && g->V < 256 && i < data->n; i++)
    if (data->bytes[i] >= g->V)
      rc = sp_diag_set(d, SP_EINVAL,
                       "--data %s: byte %u at offset %zu is "
                       "outside the model's vocabulary of %lld",
                       data->source, data->bytes[i], i, (long long)g->V);
  if (rc == 0 && keep != NULL)
    *keep = data;
  else
    sp_gpt2_data_free(data);
  return rc;
}
