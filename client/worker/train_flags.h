/* The training flags of shardplane-worker: optimizer, learning-rate
 * schedule, weight decay, clipping, gradient accumulation, and the GPT-2
 * models' data, sequence length and validation. `shardplane
 * run` takes the same flags and passes them through, so both check them
 * here, once: every error names the flag, the value and what is allowed
 * (common/base/flag.h). */
#ifndef SP_TRAIN_FLAGS_H
#define SP_TRAIN_FLAGS_H

#include <getopt.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/sp_error.h"
#include "lib/shardplane.h"
#include "plan/model.h"

/* What a trainer runs, made from the flags by sp_train_flags_finish: the
 * worker's trainers' and the tests' reference run's
 * (tests/support/mlp_reference.h). Named for the MLP it first served; the
 * GPT-2 trainer takes the same (gpt2_train.h). */
typedef struct sp_mlp_train_cfg {
  uint32_t steps; /* optimizer steps */
  /* samples per optimizer step, over all micro-batches (and ranks, for a
   * sharded trainer); 1..2^24, a multiple of grad_accum */
  uint32_t global_batch;
  /* micro-batches per step, 0 or 1: none. Micro-batch j of step s is
   * samples [j*m, (j+1)*m) of sp_mlp_batch(step = s), m = global_batch / k
   * (a sharded rank r of W takes [j*m + r*m/W, j*m + (r+1)*m/W)); its
   * forward uses global_n = m, its loss sp_mlp_loss_over(denom = m * k for
   * one process, m / W * k for a rank), and sp_mlp_count_step follows
   * each micro-batch's backward. */
  uint32_t grad_accum;
  /* how the micro-batches' gradients add up (the reference run's
   * reduction emulation):
   * false: each is cast to reduce_dtype and on to the gradient dtype and
   * added there (FSDP2's reduce per micro-batch); true: they add up in
   * the views' param_dtype and are cast once (no_sync) */
  bool no_sync;
  /* optimizer, schedule (total_steps set by the caller) and decay mask */
  sp_optim_opts optim;
  double clip_grad_norm; /* > 0: clip_grad_norm_ before each step; 0 off */
  /* what the spec's "training" set (no flag did), as the flags that would
   * say it: "--optimizer adamw --lr 0.0006 ..."; "" for nothing */
  char from_spec[384];
} sp_mlp_train_cfg;

/* steps and global batch, SGD at lr with no momentum, decay, clipping or
 * accumulation: what sp_mlp_reference_run trains. */
void sp_mlp_train_cfg_init(sp_mlp_train_cfg *cfg, uint32_t steps,
                           uint32_t global_batch, double lr);

/* getopt_long returns SP_TRAIN_OPT_BASE + i for the i-th training flag. */
#define SP_TRAIN_OPT_BASE 2000
/* Most values of the repeatable --decay and --no-decay (each). */
#define SP_TRAIN_MAX_PATTERNS 16

typedef struct sp_train_flags {
  sp_optim_kind kind;      /* --optimizer (default sgd) */
  double momentum;         /* --momentum (sgd) */
  double weight_decay;     /* --weight-decay */
  double beta1, beta2;     /* --betas B1,B2 (adamw) */
  double eps;              /* --eps (adamw) */
  sp_lr_schedule schedule; /* --lr-schedule */
  uint64_t warmup_steps;   /* --warmup-steps (cosine) */
  double min_lr;           /* --min-lr (cosine) */
  double clip_grad_norm;   /* --clip-grad-norm; 0: off */
  uint32_t grad_accum;     /* --grad-accum K, micro-batches a step */
  bool no_sync;            /* --no-sync */
  /* --decay / --no-decay globs, pointing into argv */
  const char *decay[SP_TRAIN_MAX_PATTERNS];
  size_t n_decay;
  const char *no_decay[SP_TRAIN_MAX_PATTERNS];
  size_t n_no_decay;
  /* GPT-2 models */
  const char *data;      /* --data FILE; NULL: the default corpus */
  uint32_t seq_len;      /* --seq-len; 0: the model's context */
  uint32_t eval_every;   /* --eval-every (default 10; 0: never) */
  uint32_t eval_batches; /* --eval-batches (default 4) */
  uint32_t threads;      /* --threads, BLAS threads (default 1) */
  bool checkpointing;    /* --activation-checkpointing */
  bool no_memory_check;  /* --no-memory-check */
  /* which were given, for the checks that combine flags: the value as
   * given (NULL: not given), by flag index */
  const char *given[32];
} sp_train_flags;

/* Defaults: SGD, constant schedule, no clipping, one micro-batch; AdamW's
 * betas, eps and weight decay as sp_optim_opts_init gives them unless the
 * flags say otherwise. */
void sp_train_flags_init(sp_train_flags *t);

/* Appends the training flags to a getopt_long table: up to cap entries at
 * out; returns how many there are. */
size_t sp_train_options(struct option *out, size_t cap);
/* The flag's name (without dashes) for getopt's return value c, or NULL
 * when c is none of them. */
const char *sp_train_flag_name(int c);
/* Whether the flag (by getopt's c) takes a value. */
bool sp_train_flag_has_arg(int c);

/* One flag (getopt's c) with its value: 0, or SP_EINVAL naming the flag,
 * the value and what is allowed; SP_ENOENT when c is no training flag. */
int sp_train_flag(sp_train_flags *t, int c, const char *value, sp_diag *d);

/* The checks that combine flags, with the run's --steps, --lr and
 * --global-batch over `world` ranks: --momentum only for sgd, --betas and
 * --eps only for adamw, --warmup-steps and --min-lr only with
 * --lr-schedule cosine, warmup at most --steps, --min-lr at most --lr,
 * --no-sync only with --grad-accum above 1, the batch a multiple of
 * world * K (world 0: not known yet, of K; world_name says what gave the
 * world in messages: "--nproc", "the world size"). Then the configuration for the trainer and the reference run
 * (cfg: optimizer with total_steps = steps, clipping, accumulation; the
 * patterns point into t). SP_EINVAL with the message. */
int sp_train_flags_finish(const sp_train_flags *t, uint32_t steps, double lr,
                          uint32_t global_batch, uint32_t world,
                          const char *world_name, sp_mlp_train_cfg *cfg,
                          sp_diag *d);

/* The same with the defaults of a model spec's "training" (model.h) for
 * the flags not given, the run's lr (the default when !lr_given)
 * included: a flag always wins. The spec's optimizer settings (lr,
 * momentum, weight_decay, betas, eps) are for its optimizer (sgd when it
 * names none) and apply only when that is the optimizer in effect; its
 * warmup and min_lr only with the cosine schedule in effect. Its
 * warmup_steps is cut to the run's steps and its warmup_ratio is
 * ceil(ratio * steps) (as Hugging Face's Trainer): a spec cannot know how
 * long a run is, and a default that made a short run an error would be
 * no default. Its min_lr is its lr's floor: under another lr (--lr, or
 * the spec's optimizer not in effect) it keeps its ratio to the peak.
 * The checks that combine flags are those above, against the settings in
 * effect, and say when the spec chose one; cfg->from_spec lists what the
 * spec set. spec NULL: none (sp_train_flags_finish). */
int sp_train_flags_finish_spec(const sp_train_flags *t, const sp_model *spec,
                               uint32_t steps, double lr, bool lr_given,
                               uint32_t global_batch, uint32_t world,
                               const char *world_name, sp_mlp_train_cfg *cfg,
                               sp_diag *d);

/* Before the spec is known (a worker before it attaches): the checks of
 * sp_train_flags_finish that no spec can change (the values, --warmup-
 * steps at most --steps, --min-lr at most a given --lr, a flag given where
 * the flags alone say it means nothing, --no-sync, the batch over
 * --grad-accum); the rest waits for sp_train_flags_finish_spec. */
int sp_train_flags_precheck(const sp_train_flags *t, uint32_t steps, double lr,
                            bool lr_given, uint32_t global_batch, sp_diag *d);

/* The help lines, indented like the programs' own (column `col` for the
 * descriptions). */
void sp_train_flags_help(FILE *f, int col);

#endif
