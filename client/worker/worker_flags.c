/* The flags a run passes on to its workers (worker_flags.h). */
#include "worker_flags.h"

#include <string.h>

#include "base/flag.h"

void sp_worker_flags_init(sp_worker_flags *f, uint32_t min_steps) {
  memset(f, 0, sizeof *f);
  f->min_steps = min_steps;
  f->steps_arg = "20";
  f->steps = 20;
  f->batch_arg = "24";
  f->global_batch = 24;
  f->lr_arg = "0.05";
  f->lr = 0.05;
  f->log_every_arg = "1";
  f->log_every = 1;
}

/* An integer flag in [min, max], kept as given and as a number. */
static int count_flag(const char **arg, uint32_t *out, const char *flag,
                      const char *v, long long min, long long max, sp_diag *d) {
  long long n = 0;
  *arg = v;
  int rc = sp_flag_int(flag, v, min, max, &n, d);
  *out = (uint32_t)n;
  return rc;
}

int sp_worker_flag(sp_worker_flags *f, int c, const char *flag, const char *v,
                   sp_diag *d) {
  static const char *const kinds[] = {"none", "full", "sharded", "local"};
  size_t k = 0;
  int rc;
  switch (c) {
    case SP_WORKER_OPT_STEPS:
      return count_flag(&f->steps_arg, &f->steps, flag, v, f->min_steps,
                        1000000000, d);
    case SP_WORKER_OPT_BATCH:
      return count_flag(&f->batch_arg, &f->global_batch, flag, v, 1, 1 << 20,
                        d);
    case SP_WORKER_OPT_LR:
      f->lr_arg = v;
      f->lr_given = true;
      return sp_flag_number(flag, v, 0, &f->lr, d);
    case SP_WORKER_OPT_LOG_EVERY:
      return count_flag(&f->log_every_arg, &f->log_every, flag, v, 0,
                        1000000000, d);
    case SP_WORKER_OPT_CKPT_DIR:
      f->ckpt_dir = v;
      return sp_flag_text(flag, v, "a directory", d);
    case SP_WORKER_OPT_CKPT:
      rc = sp_flag_choice(flag, v, kinds, 4, &k, d);
      if (rc == 0 && k > 0) f->kinds[k] = true;
      if (rc == 0) f->kind_given = true;
      return rc;
    case SP_WORKER_OPT_CKPT_EVERY:
      return count_flag(&f->ckpt_every_arg, &f->ckpt_every, flag, v, 1,
                        1000000000, d);
    case SP_WORKER_OPT_LOAD:
      f->load_dir = v;
      return sp_flag_text(flag, v, "a checkpoint directory", d);
    case SP_WORKER_OPT_LOAD_KIND:
      rc = sp_flag_choice(flag, v, kinds + 1, 3, &k, d);
      if (rc == 0) f->load_kind = (sp_ckpt_kind)(k + 1);
      return rc;
    case SP_WORKER_OPT_LOAD_PARAMS: f->load_params_only = true; return 0;
  }
  return SP_ENOENT;
}

int sp_worker_flags_finish(sp_worker_flags *f, sp_diag *d) {
  if ((f->load_kind || f->load_params_only) && !f->load_dir)
    return sp_diag_set(d, SP_EINVAL, "%s needs --load DIR",
                       f->load_kind ? "--load-kind" : "--load-params-only");
  if (!f->kind_given) f->kinds[SP_CKPT_FULL] = true;
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++)
    f->any_kind |= f->kinds[k];
  return 0;
}
