/* The flags of a training run that shardplane-worker reads and
 * `shardplane run` checks and passes on to every worker: its length, batch,
 * learning rate and progress lines, and the checkpoints it writes and
 * loads. Both parse them here, so that a value run accepts is one every
 * worker accepts, in the same words (common/base/flag.h). The help lines
 * stay each program's own: they say what the flag does there. */
#ifndef SP_WORKER_FLAGS_H
#define SP_WORKER_FLAGS_H

#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "lib/shardplane.h"

/* getopt_long's value of each flag. The programs list them in their own
 * option tables, each where it was: a table's order is the order getopt
 * names the candidates of an ambiguous abbreviation in. */
#define SP_WORKER_OPT_BASE 3000
enum {
  SP_WORKER_OPT_STEPS = SP_WORKER_OPT_BASE, /* --steps N */
  SP_WORKER_OPT_BATCH,                      /* --global-batch N */
  SP_WORKER_OPT_LR,                         /* --lr X */
  SP_WORKER_OPT_LOG_EVERY,                  /* --log-every N */
  SP_WORKER_OPT_CKPT_DIR,                   /* --checkpoint-dir DIR */
  SP_WORKER_OPT_CKPT,                       /* --checkpoint KIND */
  SP_WORKER_OPT_CKPT_EVERY,                 /* --checkpoint-every N */
  SP_WORKER_OPT_LOAD,                       /* --load DIR */
  SP_WORKER_OPT_LOAD_KIND,                  /* --load-kind KIND */
  SP_WORKER_OPT_LOAD_PARAMS,                /* --load-params-only */
  SP_WORKER_OPT_END
};

/* Their getopt_long entries, spelled here once for both programs'
 * tables, in the groups both list together. */
#define SP_WORKER_OPTIONS_RUN_AND_SAVE                                       \
  {"steps", required_argument, NULL, SP_WORKER_OPT_STEPS},                   \
      {"global-batch", required_argument, NULL, SP_WORKER_OPT_BATCH},        \
      {"lr", required_argument, NULL, SP_WORKER_OPT_LR},                     \
      {"checkpoint-dir", required_argument, NULL, SP_WORKER_OPT_CKPT_DIR}, { \
    "checkpoint", required_argument, NULL, SP_WORKER_OPT_CKPT                \
  }
#define SP_WORKER_OPTIONS_LOAD                                           \
  {"load", required_argument, NULL, SP_WORKER_OPT_LOAD},                 \
      {"load-kind", required_argument, NULL, SP_WORKER_OPT_LOAD_KIND}, { \
    "load-params-only", no_argument, NULL, SP_WORKER_OPT_LOAD_PARAMS     \
  }
#define SP_WORKER_OPTION_LOG_EVERY \
  { "log-every", required_argument, NULL, SP_WORKER_OPT_LOG_EVERY }
#define SP_WORKER_OPTION_CKPT_EVERY \
  { "checkpoint-every", required_argument, NULL, SP_WORKER_OPT_CKPT_EVERY }

typedef struct sp_worker_flags {
  /* each value as given (or the default's words), for passing on, and
   * as a number */
  const char *steps_arg, *batch_arg, *lr_arg, *log_every_arg;
  uint32_t steps;        /* --steps (default 20) */
  uint32_t global_batch; /* --global-batch (default 24) */
  double lr;             /* --lr (default 0.05) */
  /* --lr given: else the spec's training.lr, when it has one, goes first
   * (sp_train_flags_finish_spec), and shardplane run passes none on */
  bool lr_given;
  uint32_t log_every;   /* --log-every (default 1) */
  const char *ckpt_dir; /* --checkpoint-dir; NULL: not given */
  /* --checkpoint, by sp_ckpt_kind: after sp_worker_flags_finish, FULL
   * unless --checkpoint was given */
  bool kinds[4];
  bool any_kind;   /* after sp_worker_flags_finish: kinds[] has one */
  bool kind_given; /* some --checkpoint (none included) */
  const char *ckpt_every_arg; /* --checkpoint-every; NULL: not given */
  uint32_t ckpt_every;
  const char *load_dir;   /* --load; NULL: not given */
  sp_ckpt_kind load_kind; /* --load-kind; 0: the only kind load_dir holds */
  bool load_params_only;  /* --load-params-only */
  uint32_t min_steps;     /* what --steps allows: min_steps and up */
} sp_worker_flags;

/* The defaults; --steps takes min_steps and up (shardplane run trains at
 * least one step: 1; a worker, 0). */
void sp_worker_flags_init(sp_worker_flags *f, uint32_t min_steps);

/* One flag (getopt's c, written `flag` with its dashes) with its value:
 * 0, or SP_EINVAL naming the flag, the value and what is allowed;
 * SP_ENOENT when c is none of them. */
int sp_worker_flag(sp_worker_flags *f, int c, const char *flag,
                   const char *value, sp_diag *d);

/* After the last flag: --load-kind and --load-params-only only with
 * --load (SP_EINVAL, `--load-kind needs --load DIR`); then the kinds
 * written, FULL unless --checkpoint said otherwise. */
int sp_worker_flags_finish(sp_worker_flags *f, sp_diag *d);

#endif
