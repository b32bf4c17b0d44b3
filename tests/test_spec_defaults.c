/* The defaults a model spec carries, as a Hugging Face model does:
 * "no_split_modules" (the tools' default wrap policy) and "training" (the
 * defaults of the training flags). They parse, every wrong entry is an
 * error naming the field, the value and the spec, the default wrap comes
 * from them, flags win over them, and a spec without them keeps the old
 * defaults exactly. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>
#include <math.h>

#include "plan/job.h"
#include "plan/model.h"
#include "plan/plan.h"
#include "support/testutil.h"
#include "worker/train_flags.h"

#define MODEL(name) SP_EXAMPLES "/models/" name ".json"
#define MLP SP_EXAMPLES "/mlp.json"

static sp_model *load(const char *path) {
  sp_model *m = NULL;
  sp_diag d = {{0}};
  if (sp_model_load_file(path, &m, &d) != 0) fail_msg("%s: %s", path, d.msg);
  return m;
}

/* The spec at `path` with its top-level key `drop` removed (NULL: none)
 * and `add` (a JSON object, may be NULL) merged in, loaded under the name
 * `origin`. *rc and d receive the loader's answer. */
static sp_model *variant(const char *path, const char *drop, const char *add,
                         const char *origin, int *rc, sp_diag *d) {
  json_error_t e;
  json_t *root = json_load_file(path, 0, &e);
  if (root == NULL) fail_msg("%s: %s", path, e.text);
  if (drop != NULL) json_object_del(root, drop);
  if (add != NULL) {
    json_t *extra = json_loads(add, 0, &e);
    if (extra == NULL) fail_msg("bad test JSON %s: %s", add, e.text);
    json_object_update(root, extra);
    json_decref(extra);
  }
  char *text = json_dumps(root, 0);
  json_decref(root);
  sp_model *m = NULL;
  *rc = sp_model_load_string(text, strlen(text), origin, &m, d);
  free(text);
  return m;
}

static void test_shipped_specs_carry_them(void **state) {
  (void)state;
  static const char *const gpt2[] = {MODEL("gpt2"), MODEL("gpt2-mini"),
                                     MODEL("gpt2-tiny")};
  for (size_t i = 0; i < 3; i++) {
    sp_model *m = load(gpt2[i]);
    assert_int_equal(m->n_no_split_modules, 1);
    assert_string_equal(m->no_split_modules[0], "GPT2Block");
    const sp_model_training *t = &m->training;
    assert_true(t->adamw);
    assert_true(t->cosine);
    assert_true(t->lr == 6e-4);
    assert_true(t->min_lr == 6e-5);
    assert_true(t->weight_decay == 0.1);
    assert_true(t->beta1 == 0.9 && t->beta2 == 0.95);
    assert_true(t->eps == 1e-8);
    assert_true(t->clip_grad_norm == 1.0);
    assert_true(t->warmup_ratio == 0.04);
    assert_false(t->set & SP_MODEL_TRAIN_WARMUP_STEPS);
    assert_false(t->set & SP_MODEL_TRAIN_MOMENTUM);
    sp_model_free(m);
  }
  sp_model *m = load(MODEL("llama2_7b"));
  assert_int_equal(m->n_no_split_modules, 1);
  assert_string_equal(m->no_split_modules[0], "LlamaDecoderLayer");
  assert_int_equal(m->training.set, 0);
  sp_model_free(m);
  /* the other families, and the MLP, have neither */
  static const char *const none[] = {MLP, MODEL("resnet50"), MODEL("vit_b_16")};
  for (size_t i = 0; i < 3; i++) {
    m = load(none[i]);
    assert_int_equal(m->n_no_split_modules, 0);
    assert_int_equal(m->training.set, 0);
    sp_model_free(m);
  }
}

/* Every field, in a spec of its own: sgd with momentum, warmup as steps. */
static void test_fields_parse(void **state) {
  (void)state;
  int rc;
  sp_diag d = {{0}};
  sp_model *m = variant(MODEL("gpt2-tiny"), "training",
                        "{\"training\": {\"optimizer\": \"sgd\", \"lr\": 0.1,"
                        " \"momentum\": 0.9, \"weight_decay\": 0,"
                        " \"lr_schedule\": \"cosine\", \"warmup_steps\": 700,"
                        " \"min_lr\": 0.01, \"clip_grad_norm\": 0.5},"
                        " \"no_split_modules\": [\"GPT2Block\", \"Conv1D\"]}",
                        "s.json", &rc, &d);
  if (rc != 0) fail_msg("%s", d.msg);
  const sp_model_training *t = &m->training;
  assert_false(t->adamw);
  assert_true(t->cosine);
  assert_true(t->lr == 0.1 && t->momentum == 0.9 && t->weight_decay == 0);
  assert_int_equal(t->warmup_steps, 700);
  assert_true(t->min_lr == 0.01 && t->clip_grad_norm == 0.5);
  assert_int_equal(t->set,
                   SP_MODEL_TRAIN_OPTIMIZER | SP_MODEL_TRAIN_LR |
                       SP_MODEL_TRAIN_MOMENTUM | SP_MODEL_TRAIN_WEIGHT_DECAY |
                       SP_MODEL_TRAIN_SCHEDULE | SP_MODEL_TRAIN_WARMUP_STEPS |
                       SP_MODEL_TRAIN_MIN_LR | SP_MODEL_TRAIN_CLIP);
  assert_int_equal(m->n_no_split_modules, 2);
  assert_string_equal(m->no_split_modules[1], "Conv1D");
  sp_model_free(m);
}

/* Each wrong entry names the spec, the field and the value. */
static void test_field_errors(void **state) {
  (void)state;
  static const struct {
    const char *add, *want;
  } cases[] = {
      {"{\"no_split_modules\": [\"GPT2Blok\"]}",
       "examples/models/x.json: no_split_modules: type \"GPT2Blok\" is not "
       "the type of any module in examples/models/x.json (did you mean "
       "\"GPT2Block\"?)"},
      {"{\"no_split_modules\": [\"Nothing\"]}",
       "no_split_modules: type \"Nothing\" is not the type of any module in "
       "examples/models/x.json\n"},
      {"{\"no_split_modules\": []}", "no_split_modules: empty"},
      {"{\"no_split_modules\": \"GPT2Block\"}",
       "no_split_modules: expected an array"},
      {"{\"no_split_modules\": [7]}",
       "no_split_modules[0]: expected a module type"},
      {"{\"no_split_modules\": [\"GPT2Block\", \"GPT2Block\"]}",
       "no_split_modules[1]: type \"GPT2Block\" is listed twice"},
      {"{\"training\": {\"optimizer\": \"adam\"}}",
       "examples/models/x.json: training.optimizer: \"adam\": expected sgd "
       "or adamw"},
      {"{\"training\": {\"lr_schedule\": \"linear\"}}",
       "training.lr_schedule: \"linear\": expected constant or cosine"},
      {"{\"training\": {\"lr\": -1}}",
       "training.lr: -1: expected a finite number >= 0"},
      {"{\"training\": {\"lr\": \"fast\"}}", "training.lr: expected a number"},
      {"{\"training\": {\"weight_decay\": -0.1}}",
       "training.weight_decay: -0.1: expected a finite number >= 0"},
      {"{\"training\": {\"optimizer\": \"adamw\", \"eps\": 0}}",
       "training.eps: 0: expected a finite number > 0"},
      {"{\"training\": {\"optimizer\": \"adamw\", \"betas\": [0.9, 1]}}",
       "training.betas: [0.9, 1]: expected each in [0, 1)"},
      {"{\"training\": {\"optimizer\": \"adamw\", \"betas\": [0.9]}}",
       "training.betas: expected [B1, B2]"},
      {"{\"training\": {\"betas\": [0.9, 0.95]}}",
       "training.betas: only with optimizer adamw (the optimizer is sgd)"},
      {"{\"training\": {\"optimizer\": \"adamw\", \"momentum\": 0.9}}",
       "training.momentum: only with optimizer sgd"},
      {"{\"training\": {\"lr\": 1, \"min_lr\": 0.1}}",
       "training.min_lr: only with lr_schedule cosine"},
      {"{\"training\": {\"lr_schedule\": \"cosine\", \"min_lr\": 0.1}}",
       "training.min_lr: needs training.lr"},
      {"{\"training\": {\"lr_schedule\": \"cosine\", \"lr\": 0.1, "
       "\"min_lr\": 0.2}}",
       "training.min_lr: 0.2: expected at most lr 0.1"},
      {"{\"training\": {\"lr_schedule\": \"cosine\", \"warmup_steps\": -1}}",
       "training.warmup_steps: -1 is outside [0, 1000000000]"},
      {"{\"training\": {\"lr_schedule\": \"cosine\", \"warmup_ratio\": 1.5}}",
       "training.warmup_ratio: 1.5: expected a fraction of the run's steps"},
      {"{\"training\": {\"lr_schedule\": \"cosine\", \"warmup_ratio\": 0.1, "
       "\"warmup_steps\": 10}}",
       "training: warmup_steps and warmup_ratio both given"},
      {"{\"training\": {\"warmup_step\": 10}}",
       "unknown key \"warmup_step\" in training (did you mean "
       "\"warmup_steps\"?)"},
      {"{\"training\": {\"clip_grad_norm\": -1}}",
       "training.clip_grad_norm: -1: expected a finite number >= 0"},
      {"{\"training\": []}", "training: expected an object"},
  };
  int bad = 0;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int rc;
    sp_diag d = {{0}};
    sp_model *m = variant(MODEL("gpt2-tiny"), "training", cases[i].add,
                          "examples/models/x.json", &rc, &d);
    /* a trailing "\n" in want: the message ends there */
    char msg[sizeof d.msg + 2];
    snprintf(msg, sizeof msg, "%s\n", d.msg);
    if (rc != SP_EFORMAT || strstr(msg, cases[i].want) == NULL) {
      printf("  %s: rc %d, \"%s\"; want \"%s\"\n", cases[i].add, rc, d.msg,
             cases[i].want);
      bad++;
    }
    sp_model_free(m);
  }
  assert_int_equal(bad, 0);
  /* from a file, the file's name */
  char *dir = sp_test_mkdtemp();
  char *path = sp_test_path(dir, "bad.json");
  const char *text =
      "{\"format\": \"shardplane.model/v1\", \"name\": \"b\", "
      "\"modules\": [{\"fqn\": \"\", \"type\": \"Root\"}], \"params\": [], "
      "\"no_split_modules\": [\"Block\"]}";
  sp_test_write_file(path, text, strlen(text));
  sp_model *m = NULL;
  sp_diag d = {{0}};
  assert_int_equal(sp_model_load_file(path, &m, &d), SP_EFORMAT);
  char want[4096];
  snprintf(want, sizeof want,
           "%s: no_split_modules: type \"Block\" is not the type of any "
           "module in %s",
           path, path);
  assert_string_equal(d.msg, want);
  free(path);
  sp_test_rmtree(dir);
  free(dir);
}

/* The job `flags` (name, value pairs) make of spec m, with the tools'
 * default wrap policy; its wrap types joined by ",", into out. */
static bool default_wrap(const sp_model *m, const char *const *flags, char *out,
                         size_t cap) {
  sp_job job;
  sp_job_init(&job);
  sp_diag d = {{0}};
  for (size_t k = 0; flags && flags[k]; k += 2)
    assert_int_equal(sp_job_apply_flag(&job, flags[k], flags[k + 1], &d), 0);
  bool applied = false;
  assert_int_equal(sp_job_default_wrap(&job, m, &applied), 0);
  out[0] = '\0';
  for (size_t i = 0; i < job.wrap_types.n; i++)
    snprintf(out + strlen(out), cap - strlen(out), "%s%s", i ? "," : "",
             job.wrap_types.items[i]);
  sp_job_clear(&job);
  return applied;
}

static void test_default_wrap_from_spec(void **state) {
  (void)state;
  char w[256];
  sp_model *m = load(MODEL("gpt2-tiny"));
  assert_true(default_wrap(m, NULL, w, sizeof w));
  assert_string_equal(w, "GPT2Block");
  /* so the plan has the blocks as units, as --wrap-type GPT2Block has */
  sp_job job;
  sp_job_init(&job);
  job.world_size = 2;
  assert_int_equal(sp_job_default_wrap(&job, m, NULL), 0);
  sp_plan *pl = NULL;
  sp_diag d = {{0}};
  assert_int_equal(sp_plan_build(m, &job, &pl, &d), 0);
  assert_int_equal(pl->n_units, 3);
  assert_string_equal(m->modules[pl->units[1].module].fqn, "transformer.h.0");
  assert_string_equal(m->modules[pl->units[2].module].fqn, "transformer.h.1");
  sp_plan_free(pl);
  sp_job_clear(&job);
  /* a wrap policy given wins: the default is not added to it */
  const char *linear[] = {"wrap-type", "Linear", NULL};
  assert_false(default_wrap(m, linear, w, sizeof w));
  assert_string_equal(w, "Linear");
  const char *module[] = {"wrap-module", "transformer.h.1", NULL};
  assert_false(default_wrap(m, module, w, sizeof w));
  assert_string_equal(w, "");
  sp_model_free(m);
  /* the same spec without the field: every Linear, as before */
  int rc;
  m = variant(MODEL("gpt2-tiny"), "no_split_modules", NULL, "t.json", &rc, &d);
  assert_int_equal(rc, 0);
  assert_true(default_wrap(m, NULL, w, sizeof w));
  assert_string_equal(w, SP_JOB_DEFAULT_WRAP_TYPE);
  sp_model_free(m);
  m = load(MLP);
  assert_true(default_wrap(m, NULL, w, sizeof w));
  assert_string_equal(w, "Linear");
  sp_model_free(m);
  m = load(MODEL("llama2_7b"));
  assert_true(default_wrap(m, NULL, w, sizeof w));
  assert_string_equal(w, "LlamaDecoderLayer");
  sp_model_free(m);
  /* other families keep every Linear */
  m = load(MODEL("resnet50"));
  assert_true(default_wrap(m, NULL, w, sizeof w));
  assert_string_equal(w, "Linear");
  sp_model_free(m);
}

/* The training flags args (NULL-terminated, "--name" [value]) parsed as
 * shardplane-worker and shardplane run parse them. */
static void parse_train(sp_train_flags *t, const char *const *args) {
  struct option opts[64];
  size_t n = sp_train_options(opts, 64);
  sp_train_flags_init(t);
  for (size_t i = 0; args && args[i]; i++) {
    bool found = false;
    for (size_t o = 0; o < n && !found; o++)
      if (strcmp(args[i] + 2, opts[o].name) == 0) {
        sp_diag d = {{0}};
        const char *v = opts[o].has_arg ? args[++i] : NULL;
        if (sp_train_flag(t, opts[o].val, v, &d) != 0)
          fail_msg("%s: %s", args[i], d.msg);
        found = true;
      }
    if (!found) fail_msg("no training flag %s", args[i]);
  }
}

/* The configuration of a run of `steps` steps of spec m with the flags
 * args and --lr lr (NAN: not given): 0, or the error in d. */
static int resolve(const sp_model *m, const char *const *args, uint32_t steps,
                   double lr, sp_mlp_train_cfg *cfg, sp_diag *d) {
  sp_train_flags t;
  parse_train(&t, args);
  bool given = !isnan(lr);
  return sp_train_flags_finish_spec(&t, m, steps, given ? lr : 0.05, given, 24,
                                    2, "--nproc", cfg, d);
}

static void test_training_defaults(void **state) {
  (void)state;
  sp_model *m = load(MODEL("gpt2-tiny"));
  sp_mlp_train_cfg cfg;
  sp_diag d = {{0}};
  assert_int_equal(resolve(m, NULL, 1000, NAN, &cfg, &d), 0);
  const sp_optim_opts *o = &cfg.optim;
  assert_int_equal(o->kind, SP_OPTIM_ADAMW);
  assert_true(o->lr == 6e-4);
  assert_true(o->beta1 == 0.9 && o->beta2 == 0.95 && o->eps == 1e-8);
  assert_true(o->weight_decay == 0.1);
  assert_int_equal(o->schedule, SP_LR_COSINE);
  assert_int_equal(o->warmup_steps, 40); /* 4 % of 1000 */
  assert_int_equal(o->total_steps, 1000);
  assert_true(o->min_lr == 6e-5);
  assert_true(cfg.clip_grad_norm == 1.0);
  assert_string_equal(cfg.from_spec,
                      "--optimizer adamw --lr 0.0006 --weight-decay 0.1 "
                      "--betas 0.9,0.95 --eps 1e-08 --lr-schedule cosine "
                      "--warmup-steps 40 --min-lr 6e-05 --clip-grad-norm 1");
  /* a short run warms up over a share of its own steps, rounded up: never
   * an error, never a run that only warms up */
  static const struct {
    uint32_t steps;
    uint64_t warmup;
  } w[] = {{1, 1}, {6, 1}, {20, 1}, {25, 1}, {26, 2}, {50, 2}};
  for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) {
    assert_int_equal(resolve(m, NULL, w[i].steps, NAN, &cfg, &d), 0);
    if (cfg.optim.warmup_steps != w[i].warmup)
      fail_msg("%u steps: warmup %llu, want %llu", w[i].steps,
               (unsigned long long)cfg.optim.warmup_steps,
               (unsigned long long)w[i].warmup);
  }
  /* a fixed warmup longer than the run is cut to it */
  int rc;
  sp_model *fixed = variant(MODEL("gpt2-tiny"), NULL,
                            "{\"training\": {\"lr_schedule\": \"cosine\", "
                            "\"warmup_steps\": 700}}",
                            "f.json", &rc, &d);
  assert_int_equal(rc, 0);
  assert_int_equal(resolve(fixed, NULL, 6, NAN, &cfg, &d), 0);
  assert_int_equal(cfg.optim.warmup_steps, 6);
  assert_int_equal(resolve(fixed, NULL, 1000, NAN, &cfg, &d), 0);
  assert_int_equal(cfg.optim.warmup_steps, 700);
  /* no optimizer named: sgd, the tools' lr */
  assert_int_equal(cfg.optim.kind, SP_OPTIM_SGD);
  assert_true(cfg.optim.lr == 0.05);
  sp_model_free(fixed);
  sp_model_free(m);
}

static void test_flags_override(void **state) {
  (void)state;
  sp_model *m = load(MODEL("gpt2-tiny"));
  sp_mlp_train_cfg cfg;
  sp_diag d = {{0}};
  /* --lr: the floor keeps its tenth of the peak */
  assert_int_equal(resolve(m, NULL, 100, 1e-3, &cfg, &d), 0);
  assert_true(cfg.optim.lr == 1e-3);
  assert_true(fabs(cfg.optim.min_lr - 1e-4) < 1e-15);
  assert_null(strstr(cfg.from_spec, "--lr "));
  assert_non_null(strstr(cfg.from_spec, "--min-lr 0.0001"));
  /* another optimizer: the spec's lr, decay and betas are not for it */
  const char *sgd[] = {"--optimizer", "sgd", NULL};
  assert_int_equal(resolve(m, sgd, 100, NAN, &cfg, &d), 0);
  assert_int_equal(cfg.optim.kind, SP_OPTIM_SGD);
  assert_true(cfg.optim.lr == 0.05);
  assert_true(cfg.optim.weight_decay == 0);
  assert_int_equal(cfg.optim.schedule, SP_LR_COSINE);
  assert_true(fabs(cfg.optim.min_lr - 0.005) < 1e-15);
  assert_true(cfg.clip_grad_norm == 1.0);
  assert_string_equal(cfg.from_spec,
                      "--lr-schedule cosine --warmup-steps 4 --min-lr 0.005 "
                      "--clip-grad-norm 1");
  /* each flag wins over its field */
  const char *all[] = {"--lr-schedule",
                       "constant",
                       "--clip-grad-norm",
                       "0",
                       "--weight-decay",
                       "0.01",
                       "--betas",
                       "0.9,0.999",
                       "--eps",
                       "1e-6",
                       NULL};
  assert_int_equal(resolve(m, all, 100, 0.01, &cfg, &d), 0);
  assert_int_equal(cfg.optim.kind, SP_OPTIM_ADAMW);
  assert_int_equal(cfg.optim.schedule, SP_LR_CONSTANT);
  assert_int_equal(cfg.optim.warmup_steps, 0);
  assert_true(cfg.optim.min_lr == 0);
  assert_true(cfg.clip_grad_norm == 0);
  assert_true(cfg.optim.weight_decay == 0.01);
  assert_true(cfg.optim.beta2 == 0.999 && cfg.optim.eps == 1e-6);
  assert_string_equal(cfg.from_spec, "--optimizer adamw");
  /* a flag the spec's settings make meaningful is taken */
  const char *warm[] = {"--warmup-steps", "3", NULL};
  assert_int_equal(resolve(m, warm, 10, NAN, &cfg, &d), 0);
  assert_int_equal(cfg.optim.warmup_steps, 3);
  /* and one they make meaningless is refused, saying where that came
   * from */
  const char *mom[] = {"--momentum", "0.9", NULL};
  assert_int_equal(resolve(m, mom, 10, NAN, &cfg, &d), SP_EINVAL);
  char want[1024];
  snprintf(want, sizeof want,
           "--momentum \"0.9\": only with --optimizer sgd (adamw has "
           "--betas); adamw is training.optimizer of %s",
           MODEL("gpt2-tiny"));
  assert_string_equal(d.msg, want);
  const char *floor[] = {"--min-lr", "0.001", NULL};
  assert_int_equal(resolve(m, floor, 10, NAN, &cfg, &d), SP_EINVAL);
  snprintf(want, sizeof want,
           "--min-lr \"0.001\": expected at most the lr 0.0006, training.lr "
           "of %s (--lr sets another)",
           MODEL("gpt2-tiny"));
  assert_string_equal(d.msg, want);
  sp_model_free(m);
}

/* A spec without "training" gives what the flags alone gave before. */
static void test_no_spec_defaults_unchanged(void **state) {
  (void)state;
  sp_model *mlp = load(MLP);
  const char *const *const flagsets[] = {
      (const char *const[]){NULL},
      (const char *const[]){"--optimizer", "adamw", "--lr-schedule", "cosine",
                            "--warmup-steps", "2", "--min-lr", "0.001",
                            "--clip-grad-norm", "1", NULL},
      (const char *const[]){"--momentum", "0.9", "--weight-decay", "0.1", NULL},
  };
  for (size_t i = 0; i < 3; i++) {
    sp_train_flags t;
    parse_train(&t, flagsets[i]);
    sp_mlp_train_cfg a, b;
    sp_diag d = {{0}};
    assert_int_equal(
        sp_train_flags_finish(&t, 10, 0.05, 24, 2, "--nproc", &a, &d), 0);
    assert_int_equal(resolve(mlp, flagsets[i], 10, NAN, &b, &d), 0);
    assert_string_equal(b.from_spec, "");
    assert_int_equal(a.optim.kind, b.optim.kind);
    assert_true(a.optim.lr == b.optim.lr && b.optim.lr == 0.05);
    assert_true(a.optim.momentum == b.optim.momentum);
    assert_true(a.optim.weight_decay == b.optim.weight_decay);
    assert_true(a.optim.beta1 == b.optim.beta1);
    assert_true(a.optim.beta2 == b.optim.beta2);
    assert_true(a.optim.eps == b.optim.eps);
    assert_int_equal(a.optim.schedule, b.optim.schedule);
    assert_int_equal(a.optim.warmup_steps, b.optim.warmup_steps);
    assert_true(a.optim.min_lr == b.optim.min_lr);
    assert_true(a.clip_grad_norm == b.clip_grad_norm);
  }
  /* and refuses what it refused */
  const char *warm[] = {"--warmup-steps", "2", NULL};
  sp_mlp_train_cfg cfg;
  sp_diag d = {{0}};
  assert_int_equal(resolve(mlp, warm, 10, NAN, &cfg, &d), SP_EINVAL);
  assert_string_equal(d.msg,
                      "--warmup-steps \"2\": only with --lr-schedule cosine");
  sp_model_free(mlp);
}

/* Before the spec is known (a worker before it attaches) only what no
 * spec can change is refused. */
static void test_precheck(void **state) {
  (void)state;
  static const struct {
    const char *args[8];
    const char *want; /* NULL: accepted */
  } cases[] = {
      {{"--warmup-steps", "5", NULL}, NULL},
      {{"--eps", "1e-6", NULL}, NULL},
      {{"--momentum", "0.9", NULL}, NULL},
      {{"--min-lr", "1", NULL}, NULL},
      {{"--lr-schedule", "constant", "--warmup-steps", "5", NULL},
       "--warmup-steps \"5\": only with --lr-schedule cosine"},
      {{"--optimizer", "sgd", "--eps", "1e-6", NULL},
       "--eps \"1e-6\": only with --optimizer adamw"},
      {{"--warmup-steps", "50", NULL},
       "--warmup-steps \"50\": expected at most --steps 20"},
      {{"--no-sync", NULL}, "--no-sync: only with --grad-accum K, K > 1"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    sp_train_flags t;
    parse_train(&t, cases[i].args);
    sp_diag d = {{0}};
    int rc = sp_train_flags_precheck(&t, 20, 0.05, false, 24, &d);
    if (cases[i].want == NULL && rc != 0)
      fail_msg("case %zu refused: %s", i, d.msg);
    if (cases[i].want != NULL &&
        (rc != SP_EINVAL || strcmp(d.msg, cases[i].want)))
      fail_msg("case %zu: rc %d \"%s\", want \"%s\"", i, rc, d.msg,
               cases[i].want);
  }
  /* with --lr given, the floor is checked against it */
  sp_train_flags t;
  const char *floor[] = {"--min-lr", "1", NULL};
  parse_train(&t, floor);
  sp_diag d = {{0}};
  assert_int_equal(sp_train_flags_precheck(&t, 20, 0.05, true, 24, &d),
                   SP_EINVAL);
  assert_string_equal(d.msg, "--min-lr \"1\": expected at most --lr 0.05");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_shipped_specs_carry_them),
      cmocka_unit_test(test_fields_parse),
      cmocka_unit_test(test_field_errors),
      cmocka_unit_test(test_default_wrap_from_spec),
      cmocka_unit_test(test_training_defaults),
      cmocka_unit_test(test_flags_override),
      cmocka_unit_test(test_no_spec_defaults_unchanged),
      cmocka_unit_test(test_precheck),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
