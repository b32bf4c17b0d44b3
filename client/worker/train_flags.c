/* The training flags (train_flags.h): one table, read by the option
 * parser, the checks and the help of shardplane-worker and shardplane
 * run. */
#include "train_flags.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "base/flag.h"
#include "gpt2_data.h"

enum {
  F_OPTIMIZER,
  F_MOMENTUM,
  F_WEIGHT_DECAY,
  F_BETAS,
  F_EPS,
  F_SCHEDULE,
  F_WARMUP,
  F_MIN_LR,
  F_CLIP,
  F_ACCUM,
  F_NO_SYNC,
  F_DECAY,
  F_NO_DECAY,
  F_DATA,
  F_SEQ,
  F_EVAL_EVERY,
  F_EVAL_BATCHES,
  F_THREADS,
  F_CKPT,
  F_NO_MEM_CHECK,
  F_COUNT
};

static const struct {
  const char *name, *arg, *help;
} k_flags[F_COUNT] = {
    [F_OPTIMIZER] = {"optimizer", "sgd|adamw",
                     "sgd (default) or adamw, on the master shards"},
    [F_MOMENTUM] = {"momentum", "X", "sgd: momentum (default 0: none)"},
    [F_WEIGHT_DECAY] = {"weight-decay", "X",
                        "adamw: decoupled (default 0.01); sgd: L2 (default "
                        "0); decayed: 2-D and larger parameters, and see "
                        "--decay"},
    [F_BETAS] = {"betas", "B1,B2", "adamw: default 0.9,0.999"},
    [F_EPS] = {"eps", "X", "adamw: default 1e-8"},
    [F_SCHEDULE] = {"lr-schedule", "constant|cosine",
                    "constant (default), or linear warmup then cosine "
                    "decay to --min-lr at the last step"},
    [F_WARMUP] = {"warmup-steps", "N", "cosine: warmup steps (default 0)"},
    [F_MIN_LR] = {"min-lr", "X", "cosine: the floor (default 0)"},
    [F_CLIP] = {"clip-grad-norm", "X",
                "clip the gradients' global 2-norm to X before each step "
                "(default: none; 0: none)"},
    [F_ACCUM] = {"grad-accum", "K",
                 "K micro-batches a step (default 1); --global-batch is "
                 "the step's samples over all of them"},
    [F_NO_SYNC] = {"no-sync", NULL,
                   "with --grad-accum: reduce gradients once a step, "
                   "holding them unsharded meanwhile (FSDP's no_sync)"},
    [F_DECAY] = {"decay", "GLOB",
                 "decay parameters whose FQN matches (repeatable)"},
    [F_NO_DECAY] = {"no-decay", "GLOB",
                    "never decay parameters whose FQN matches (repeatable; "
                    "wins over --decay)"},
    [F_DATA] = {"data", "FILE",
                "GPT-2 models: the text to train on, as bytes (default: "
                "the licence texts under " SP_GPT2_DEFAULT_CORPUS ")"},
    [F_SEQ] = {"seq-len", "T",
               "GPT-2 models: tokens a sample (default: the context)"},
    [F_EVAL_EVERY] = {"eval-every", "K",
                      "GPT-2 models: the validation loss every K steps and "
                      "after the last (default 10; 0: never)"},
    [F_EVAL_BATCHES] = {"eval-batches", "N",
                        "GPT-2 models: validation micro-batches (default "
                        "4)"},
    [F_THREADS] = {"threads", "N", "BLAS threads of each rank (default 1)"},
    [F_CKPT] = {"activation-checkpointing", NULL,
                "GPT-2 models: keep only each block's input from forward "
                "and recompute the block in backward (less memory, about "
                "one more forward)"},
    [F_NO_MEM_CHECK] = {"no-memory-check", NULL,
                        "start even when the memory model predicts more "
                        "than the host (or device) has available"},
};

void sp_train_flags_init(sp_train_flags *t) {
  memset(t, 0, sizeof *t);
  t->kind = SP_OPTIM_SGD;
  t->schedule = SP_LR_CONSTANT;
  t->grad_accum = 1;
  t->eval_every = 10;
  t->eval_batches = 4;
  t->threads = 1;
}

size_t sp_train_options(struct option *out, size_t cap) {
  for (size_t i = 0; i < F_COUNT && i < cap; i++)
    out[i] = (struct option){k_flags[i].name,
                             k_flags[i].arg ? required_argument : no_argument,
                             NULL, SP_TRAIN_OPT_BASE + (int)i};
  return F_COUNT;
}

const char *sp_train_flag_name(int c) {
  int i = c - SP_TRAIN_OPT_BASE;
  return i >= 0 && i < F_COUNT ? k_flags[i].name : NULL;
}

bool sp_train_flag_has_arg(int c) {
  int i = c - SP_TRAIN_OPT_BASE;
  return i >= 0 && i < F_COUNT && k_flags[i].arg != NULL;
}

void sp_mlp_train_cfg_init(sp_mlp_train_cfg *cfg, uint32_t steps,
                           uint32_t global_batch, double lr) {
  memset(cfg, 0, sizeof *cfg);
  cfg->steps = steps;
  cfg->global_batch = global_batch;
  cfg->grad_accum = 1;
  sp_optim_opts_init(&cfg->optim, SP_OPTIM_SGD);
  cfg->optim.lr = lr;
}

/* "B1,B2", each in [0, 1) */
static int parse_betas(sp_train_flags *t, const char *flag, const char *v,
                       sp_diag *d) {
  const char *comma = v ? strchr(v, ',') : NULL;
  char a[64], b[64];
  if (!comma || (size_t)(comma - v) >= sizeof a ||
      strlen(comma + 1) >= sizeof b)
    return sp_flag_fail(d, flag, v, "two numbers B1,B2, each in [0, 1)");
  memcpy(a, v, (size_t)(comma - v));
  a[comma - v] = '\0';
  strcpy(b, comma + 1);
  sp_diag ignored = {{0}};
  if (sp_flag_number(flag, a, 0, &t->beta1, &ignored) < 0 ||
      sp_flag_number(flag, b, 0, &t->beta2, &ignored) < 0 || !(t->beta1 < 1) ||
      !(t->beta2 < 1))
    return sp_flag_fail(d, flag, v, "two numbers B1,B2, each in [0, 1)");
  return 0;
}

static int add_pattern(const char **list, size_t *n, const char *flag,
                       const char *v, sp_diag *d) {
  if (!v || !*v)
    return sp_flag_fail(d, flag, v, "an FQN glob (fnmatch), e.g. '*.bias'");
  if (*n >= SP_TRAIN_MAX_PATTERNS)
    return sp_flag_fail(d, flag, v, "at most %d of them",
                        SP_TRAIN_MAX_PATTERNS);
  list[(*n)++] = v;
  return 0;
}

int sp_train_flag(sp_train_flags *t, int c, const char *v, sp_diag *d) {
  static const char *const kinds[] = {"sgd", "adamw"};
  static const char *const schedules[] = {"constant", "cosine"};
  int i = c - SP_TRAIN_OPT_BASE;
  if (i < 0 || i >= F_COUNT) return SP_ENOENT;
  char flag[64];
  snprintf(flag, sizeof flag, "--%s", k_flags[i].name);
  long long n = 0;
  size_t k = 0;
  int rc = 0;
  switch (i) {
    case F_OPTIMIZER:
      rc = sp_flag_choice(flag, v, kinds, 2, &k, d);
      t->kind = k == 1 ? SP_OPTIM_ADAMW : SP_OPTIM_SGD;
      break;
    case F_MOMENTUM: rc = sp_flag_number(flag, v, 0, &t->momentum, d); break;
    case F_WEIGHT_DECAY:
      rc = sp_flag_number(flag, v, 0, &t->weight_decay, d);
      break;
    case F_BETAS: rc = parse_betas(t, flag, v, d); break;
    case F_EPS:
      rc = sp_flag_number(flag, v, 0, &t->eps, d);
      if (rc == 0 && !(t->eps > 0))
        rc = sp_flag_fail(d, flag, v, "a finite number > 0");
      break;
    case F_SCHEDULE:
      rc = sp_flag_choice(flag, v, schedules, 2, &k, d);
      t->schedule = k == 1 ? SP_LR_COSINE : SP_LR_CONSTANT;
      break;
    case F_WARMUP:
      rc = sp_flag_int(flag, v, 0, 1000000000, &n, d);
      t->warmup_steps = (uint64_t)n;
      break;
    case F_MIN_LR: rc = sp_flag_number(flag, v, 0, &t->min_lr, d); break;
    case F_CLIP:
      /* 0 turns off the clipping a spec's training.clip_grad_norm asks for
       * (Hugging Face's max_grad_norm 0 does the same) */
      rc = sp_flag_number(flag, v, 0, &t->clip_grad_norm, d);
      if (rc != 0)
        rc = sp_flag_fail(d, flag, v, "a finite number >= 0 (0: off)");
      break;
    case F_ACCUM:
      rc = sp_flag_int(flag, v, 1, 1024, &n, d);
      t->grad_accum = (uint32_t)n;
      break;
    case F_NO_SYNC: t->no_sync = true; break;
    case F_CKPT: t->checkpointing = true; break;
    case F_NO_MEM_CHECK: t->no_memory_check = true; break;
    case F_DECAY: rc = add_pattern(t->decay, &t->n_decay, flag, v, d); break;
    case F_NO_DECAY:
      rc = add_pattern(t->no_decay, &t->n_no_decay, flag, v, d);
      break;
    case F_DATA:
      t->data = v;
      rc = sp_flag_text(flag, v, "a text file", d);
      break;
    case F_SEQ:
      rc = sp_flag_int(flag, v, 1, 65536, &n, d);
      t->seq_len = (uint32_t)n;
      break;
    case F_EVAL_EVERY:
      rc = sp_flag_int(flag, v, 0, 1000000000, &n, d);
      t->eval_every = (uint32_t)n;
      break;
    case F_EVAL_BATCHES:
      rc = sp_flag_int(flag, v, 1, 100000, &n, d);
      t->eval_batches = (uint32_t)n;
      break;
    case F_THREADS:
      rc = sp_flag_int(flag, v, 1, 1024, &n, d);
      t->threads = (uint32_t)n;
      break;
  }
  if (rc == 0) t->given[i] = v ? v : "";
  return rc;
}

/* `--flag "value": only with <what>` for a flag given where it means
 * nothing; `why` (may be "") says where the setting in the way came from. */
static int only_with(const sp_train_flags *t, int i, const char *what,
                     const char *why, sp_diag *d) {
  if (!k_flags[i].arg)
    return sp_diag_set(d, SP_EINVAL, "--%s: only with %s%s", k_flags[i].name,
                       what, why);
  return sp_diag_set(d, SP_EINVAL, "--%s \"%s\": only with %s%s",
                     k_flags[i].name, t->given[i], what, why);
}

/* Appends `fmt...` to the cfg's list of what the spec set. */
static void from_spec(sp_mlp_train_cfg *cfg, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void from_spec(sp_mlp_train_cfg *cfg, const char *fmt, ...) {
  size_t len = strlen(cfg->from_spec);
  if (len + 1 >= sizeof cfg->from_spec) return;
  if (len > 0) cfg->from_spec[len++] = ' ';
  cfg->from_spec[len] = '\0';
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cfg->from_spec + len, sizeof cfg->from_spec - len, fmt, ap);
  va_end(ap);
}

/* The checks and the configuration, against a spec's "training" when
 * known (m NULL: a spec without one), or with `known` false before the
 * spec is: then a check that a spec's default could turn is left out. */
static int finish(const sp_train_flags *t, const sp_model *m, bool known,
                  uint32_t steps, double lr, bool lr_given,
                  uint32_t global_batch, uint32_t world, const char *world_name,
                  sp_mlp_train_cfg *cfg, sp_diag *d) {
  const sp_model_training *s = m != NULL ? &m->training : NULL;
  unsigned set = s != NULL ? s->set : 0;
  const char *spec = m != NULL && m->path != NULL ? m->path : "the spec";
  bool opt_spec = !t->given[F_OPTIMIZER] && (set & SP_MODEL_TRAIN_OPTIMIZER);
  bool adamw = opt_spec ? s->adamw : t->kind == SP_OPTIM_ADAMW;
  bool sched_spec = !t->given[F_SCHEDULE] && (set & SP_MODEL_TRAIN_SCHEDULE);
  bool cosine = sched_spec ? s->cosine : t->schedule == SP_LR_COSINE;
  /* before the spec is known, only what the flags alone decide */
  bool opt_known = known || t->given[F_OPTIMIZER];
  bool sched_known = known || t->given[F_SCHEDULE];
  /* the spec's optimizer settings are for its own optimizer (sgd when it
   * names none): AdamW's lr would stall SGD, and its decay mean another
   * thing there */
  bool spec_opt = s != NULL && adamw == s->adamw;
  bool lr_spec = !lr_given && spec_opt && (set & SP_MODEL_TRAIN_LR);
  double peak = lr_spec ? s->lr : lr;
  char why_opt[600] = "", why_sched[600] = "";
  if (opt_spec)
    snprintf(why_opt, sizeof why_opt, "; %s is training.optimizer of %.500s",
             adamw ? "adamw" : "sgd", spec);
  if (sched_spec)
    snprintf(why_sched, sizeof why_sched,
             "; constant is training.lr_schedule of %.500s", spec);
  if (opt_known && adamw && t->given[F_MOMENTUM])
    return only_with(t, F_MOMENTUM, "--optimizer sgd (adamw has --betas)",
                     why_opt, d);
  if (opt_known && !adamw && t->given[F_BETAS])
    return only_with(t, F_BETAS, "--optimizer adamw", why_opt, d);
  if (opt_known && !adamw && t->given[F_EPS])
    return only_with(t, F_EPS, "--optimizer adamw", why_opt, d);
  if (sched_known && !cosine && t->given[F_WARMUP])
    return only_with(t, F_WARMUP, "--lr-schedule cosine", why_sched, d);
  if (sched_known && !cosine && t->given[F_MIN_LR])
    return only_with(t, F_MIN_LR, "--lr-schedule cosine", why_sched, d);
  if (t->no_sync && t->grad_accum < 2)
    return only_with(t, F_NO_SYNC, "--grad-accum K, K > 1", "", d);
  if (t->given[F_WARMUP] && t->warmup_steps > steps)
    return sp_flag_fail(d, "--warmup-steps", t->given[F_WARMUP],
                        "at most --steps %u", steps);
  if (t->given[F_MIN_LR] && (known || lr_given) && t->min_lr > peak) {
    if (lr_spec)
      return sp_flag_fail(d, "--min-lr", t->given[F_MIN_LR],
                          "at most the lr %g, training.lr of %.500s (--lr "
                          "sets another)",
                          peak, spec);
    return sp_flag_fail(d, "--min-lr", t->given[F_MIN_LR], "at most --lr %g",
                        peak);
  }
  uint64_t split = (uint64_t)(world ? world : 1) * t->grad_accum;
  if (global_batch % split != 0) {
    char v[32];
    snprintf(v, sizeof v, "%u", global_batch);
    if (!world)
      return sp_flag_fail(d, "--global-batch", v,
                          "a multiple of "
                          "--grad-accum %u",
                          t->grad_accum);
    if (t->grad_accum == 1)
      return sp_flag_fail(d, "--global-batch", v,
                          "a multiple of %s %u: "
                          "every rank trains an equal share",
                          world_name, world);
    return sp_flag_fail(d, "--global-batch", v,
                        "a multiple of %u: %s %u "
                        "times --grad-accum %u, every rank an equal share "
                        "of each micro-batch",
                        (unsigned)split, world_name, world, t->grad_accum);
  }
  sp_mlp_train_cfg_init(cfg, steps, global_batch, peak);
  sp_optim_opts *o = &cfg->optim;
  sp_optim_opts_init(o, adamw ? SP_OPTIM_ADAMW : SP_OPTIM_SGD);
  o->lr = peak;
  if (opt_spec) from_spec(cfg, "--optimizer %s", adamw ? "adamw" : "sgd");
  if (lr_spec) from_spec(cfg, "--lr %g", peak);
    /* each optimizer setting: the flag's, else the spec's for its optimizer,
   * else sp_optim_opts_init's */
#define SPEC_OPT(bit) (spec_opt && (set & (bit)))
  if (t->given[F_MOMENTUM]) {
    o->momentum = t->momentum;
  } else if (!adamw && SPEC_OPT(SP_MODEL_TRAIN_MOMENTUM)) {
    o->momentum = s->momentum;
    from_spec(cfg, "--momentum %g", o->momentum);
  }
  if (t->given[F_WEIGHT_DECAY]) {
    o->weight_decay = t->weight_decay;
  } else if (SPEC_OPT(SP_MODEL_TRAIN_WEIGHT_DECAY)) {
    o->weight_decay = s->weight_decay;
    from_spec(cfg, "--weight-decay %g", o->weight_decay);
  }
  if (t->given[F_BETAS]) {
    o->beta1 = t->beta1;
    o->beta2 = t->beta2;
  } else if (adamw && SPEC_OPT(SP_MODEL_TRAIN_BETAS)) {
    o->beta1 = s->beta1;
    o->beta2 = s->beta2;
    from_spec(cfg, "--betas %g,%g", o->beta1, o->beta2);
  }
  if (t->given[F_EPS]) {
    o->eps = t->eps;
  } else if (adamw && SPEC_OPT(SP_MODEL_TRAIN_EPS)) {
    o->eps = s->eps;
    from_spec(cfg, "--eps %g", o->eps);
  }
#undef SPEC_OPT
  o->schedule = cosine ? SP_LR_COSINE : SP_LR_CONSTANT;
  if (sched_spec)
    from_spec(cfg, "--lr-schedule %s", cosine ? "cosine" : "constant");
  /* a spec's warmup and floor belong to its cosine schedule: a spec with
   * them says cosine (model.c checks), and --lr-schedule constant drops
   * them */
  bool spec_cosine = cosine && s != NULL && s->cosine;
  o->warmup_steps = t->warmup_steps;
  if (!t->given[F_WARMUP] && spec_cosine &&
      (set & SP_MODEL_TRAIN_WARMUP_STEPS)) {
    o->warmup_steps = s->warmup_steps < steps ? s->warmup_steps : steps;
    from_spec(cfg, "--warmup-steps %llu", (unsigned long long)o->warmup_steps);
  } else if (!t->given[F_WARMUP] && spec_cosine &&
             (set & SP_MODEL_TRAIN_WARMUP_RATIO)) {
    /* rounded up, as Hugging Face's get_warmup_steps; the product's
     * rounding error (0.04 * 25 = 1.0000000000000002) is not a step */
    double x = ceil(s->warmup_ratio * (double)steps * (1.0 - 1e-12));
    o->warmup_steps = x < (double)steps ? (uint64_t)x : steps;
    from_spec(cfg, "--warmup-steps %llu", (unsigned long long)o->warmup_steps);
  }
  o->total_steps = steps;
  o->min_lr = t->min_lr;
  if (!t->given[F_MIN_LR] && spec_cosine && (set & SP_MODEL_TRAIN_MIN_LR)) {
    /* the floor keeps its ratio to the peak it was written for */
    double floor = s->min_lr;
    if (peak != s->lr) floor = s->lr > 0 ? s->min_lr * (peak / s->lr) : 0;
    o->min_lr = floor < peak ? floor : peak;
    from_spec(cfg, "--min-lr %g", o->min_lr);
  }
  o->decay = t->decay;
  o->n_decay = t->n_decay;
  o->no_decay = t->no_decay;
  o->n_no_decay = t->n_no_decay;
  cfg->clip_grad_norm = t->clip_grad_norm;
  if (!t->given[F_CLIP] && (set & SP_MODEL_TRAIN_CLIP)) {
    cfg->clip_grad_norm = s->clip_grad_norm;
    from_spec(cfg, "--clip-grad-norm %g", cfg->clip_grad_norm);
  }
  cfg->grad_accum = t->grad_accum;
  cfg->no_sync = t->no_sync;
  /* what sp_optim_opts_check would refuse is refused above, by flag; a
   * cosine schedule over 0 steps is the one case left (nothing trains) */
  if (cosine && steps == 0) o->schedule = SP_LR_CONSTANT;
  int rc = sp_optim_opts_check(o, d);
  return rc < 0 ? rc : 0;
}

int sp_train_flags_finish(const sp_train_flags *t, uint32_t steps, double lr,
                          uint32_t global_batch, uint32_t world,
                          const char *world_name, sp_mlp_train_cfg *cfg,
                          sp_diag *d) {
  return finish(t, NULL, true, steps, lr, true, global_batch, world, world_name,
                cfg, d);
}

int sp_train_flags_finish_spec(const sp_train_flags *t, const sp_model *spec,
                               uint32_t steps, double lr, bool lr_given,
                               uint32_t global_batch, uint32_t world,
                               const char *world_name, sp_mlp_train_cfg *cfg,
                               sp_diag *d) {
  return finish(t, spec, true, steps, lr, lr_given, global_batch, world,
                world_name, cfg, d);
}

int sp_train_flags_precheck(const sp_train_flags *t, uint32_t steps, double lr,
                            bool lr_given, uint32_t global_batch, sp_diag *d) {
  sp_mlp_train_cfg cfg;
  return finish(t, NULL, false, steps, lr, lr_given, global_batch, 0, NULL,
                &cfg, d);
}

void sp_train_flags_help(FILE *f, int col) {
  fputs(
      "  A spec's \"training\" sets the defaults of --lr and the flags\n"
      "  below (the GPT-2 specs': AdamW at 6e-4, warmup and cosine decay\n"
      "  to 6e-5, weight decay 0.1, betas 0.9,0.95, clipping at 1.0); a\n"
      "  flag given wins.\n",
      f);
  for (size_t i = 0; i < F_COUNT; i++) {
    char head[64];
    snprintf(head, sizeof head, "  --%s%s%s", k_flags[i].name,
             k_flags[i].arg ? " " : "", k_flags[i].arg ? k_flags[i].arg : "");
    int pad = col - (int)strlen(head);
    /* the description wrapped at 76 columns */
    const char *h = k_flags[i].help;
    fputs(head, f);
    if (pad < 1) {
      fputc('\n', f);
      pad = col;
    }
    int width = 76 - col;
    bool first = true;
    while (*h) {
      size_t len = strlen(h);
      size_t take = len;
      if ((int)len > width) {
        take = (size_t)width;
        while (take > 0 && h[take] != ' ') take--;
        if (take == 0) take = (size_t)width;
      }
      fprintf(f, "%*s%.*s\n", first ? pad : col, "", (int)take, h);
      first = false;
      h += take;
      while (*h == ' ') h++;
    }
  }
}
