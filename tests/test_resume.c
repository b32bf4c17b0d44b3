/* Resuming training from a checkpoint, end to end (a real coordinator and
 * shardplane-worker processes over Gloo):
 *  - bit-exact: 10 steps in one job equal 5 steps, a checkpoint, new
 *    processes that load it and train 5 more, in every tensor of every
 *    checkpoint file (parameters, buffers, the optimizer's state and
 *    whatever else a file holds) and in the loss curve, for FULL, SHARDED
 *    and LOCAL at the same world size;
 *  - another world size: FULL and SHARDED resumed at 2 and 4 ranks stay
 *    within a measured bound of the one-go run (the float32 reduction order
 *    is the world size's), and reloaded without training they give the
 *    saved tensors exactly;
 *  - stopping: a signal to one rank stops every rank after the same step
 *    with a checkpoint, and the job resumed from it equals the one that was
 *    never stopped; --checkpoint-every keeps a complete checkpoint; a save
 *    that cannot be made fails on every rank and keeps the old one;
 *  - the optimizer state must match: a checkpoint with a state the run has
 *    not registered, or without one it has, is refused naming the state.
 * The optimizer state is the worker's --test-state, and AdamW's moments
 * in test_resume_adamw; the comparisons take every tensor a file holds,
 * so the moments join them by name. */
#include <dirent.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/clock.h"
#include "plan/model.h"
#include "safetensors/safetensors.h"
#include "support/job_fixture.h"
#include "support/testutil.h"

#define MLP_BUFFERS SP_TEST_DATA "/mlp_buffers.json"
#define JOB_TIMEOUT_S 120
#define STATE "exp_avg_test"
#define STEPS_META "shardplane.optim_steps"

/* mixed precision, buffers in bfloat16: every cast of a resume path */
static const char *const k_mp_job[] = {
    "--wrap-type",    "Linear",         "--param-dtype",
    "bfloat16",       "--reduce-dtype", "float32",
    "--buffer-dtype", "bfloat16",       NULL};
/* float32 throughout: what differs between world sizes is the order of
 * the float32 sums alone */
static const char *const k_f32_job[] = {"--wrap-type", "Linear", NULL};

/* argv-style list builder: a, then b (both NULL-terminated) */
typedef struct flags {
  const char *v[64];
  size_t n;
} flags;

static void add(flags *f, ...) {
  va_list ap;
  va_start(ap, f);
  const char *s;
  while ((s = va_arg(ap, const char *)) != NULL) {
    assert_true(f->n + 1 < sizeof f->v / sizeof f->v[0]);
    f->v[f->n++] = s;
  }
  f->v[f->n] = NULL;
  va_end(ap);
}

/* A job of n ranks: --steps steps, --test-state, every checkpoint kind
 * into out, the loss curve into out/losses.json; more flags after. */
static void train(const char *const *job, int n, const char *steps,
                  const char *out, const char *load, const char *load_kind) {
  char *losses = sp_test_path(out, "losses.json");
  mkdir(out, 0777);
  flags f = {0};
  add(&f, "--steps", steps, "--global-batch", "24", "--test-state", STATE,
      "--checkpoint-dir", out, "--checkpoint", "full", "--checkpoint",
      "sharded", "--checkpoint", "local", "--losses", losses, NULL);
  if (load) add(&f, "--load", load, "--load-kind", load_kind, NULL);
  sp_tjob_run(MLP_BUFFERS, job, n, f.v, JOB_TIMEOUT_S);
  free(losses);
}

static char *meta_of(const char *dir, const char *file, const char *key) {
  sp_safetensors_file *st = sp_tjob_open_st(dir, file);
  const char *v = sp_safetensors_metadata_get(st, key);
  char *copy = v ? strdup(v) : NULL;
  sp_safetensors_close(st);
  return copy;
}

static void expect_steps(const char *dir, const char *file, const char *want) {
  char *got = meta_of(dir, file, STEPS_META);
  if (!got || strcmp(got, want) != 0)
    fail_msg("%s/%s: %s is %s, expected %s", dir, file, STEPS_META,
             got ? got : "(none)", want);
  free(got);
}

/* Every file of each kind written by a job of w ranks: the same tensors,
 * dtypes and bytes in a and b, the same step count. */
static size_t same_checkpoints(const char *a, const char *b, int w,
                               const char *steps) {
  size_t files = 0;
  char name[96];
  sp_tjob_same_tensors(a, "full/model.safetensors", b,
                       "full/model.safetensors");
  expect_steps(b, "full/model.safetensors", steps);
  files++;
  for (int r = 0; r < w; r++) {
    snprintf(name, sizeof name, "sharded/rank-%d-of-%d.safetensors", r, w);
    sp_tjob_same_tensors(a, name, b, name);
    expect_steps(b, name, steps);
    snprintf(name, sizeof name, "local/local-%d-of-%d.safetensors", r, w);
    sp_tjob_same_tensors(a, name, b, name);
    expect_steps(b, name, steps);
    files += 2;
  }
  char *ia = sp_test_path(a, "sharded/index.json");
  char *ib = sp_test_path(b, "sharded/index.json");
  char *ta = sp_test_read_file(ia), *tb = sp_test_read_file(ib);
  assert_string_equal(ta, tb);
  assert_non_null(strstr(tb, "\"optim_states\": [\n  \"" STATE "\""));
  free(ta);
  free(tb);
  free(ia);
  free(ib);
  return files;
}

/* tail: the last n losses of a (the one-go run) equal b's, bit for bit */
static void same_losses(const char *a, const char *b, size_t from) {
  char *pa = sp_test_path(a, "losses.json"),
       *pb = sp_test_path(b, "losses.json");
  size_t na, nb;
  double *la = sp_tjob_read_losses(pa, &na), *lb = sp_tjob_read_losses(pb, &nb);
  assert_int_equal(nb, na - from);
  for (size_t i = 0; i < nb; i++)
    if (memcmp(&la[from + i], &lb[i], sizeof(double)) != 0)
      fail_msg("loss of step %zu: %.17g in one go, %.17g resumed", from + i + 1,
               la[from + i], lb[i]);
  free(la);
  free(lb);
  free(pa);
  free(pb);
}

static bool has_prefix(const char *s, const char *p) {
  return strncmp(s, p, strlen(p)) == 0;
}

/* The checkpoint files carry the state as an optimizer's: every
 * parameter's "optim.<state>.<fqn>" in FULL with the parameter's shape,
 * "<unit>.optim.<state>" in LOCAL, and the state's name. */
static void check_state_names(const char *dir, int w) {
  sp_model *m;
  sp_diag d = {{0}};
  assert_int_equal(sp_model_load_file(MLP_BUFFERS, &m, &d), 0);
  sp_safetensors_file *full = sp_tjob_open_st(dir, "full/model.safetensors");
  size_t states = 0;
  for (size_t i = 0; i < sp_safetensors_tensor_count(full); i++)
    states += has_prefix(sp_safetensors_tensor_at(full, i)->name, "optim.");
  assert_int_equal(states, m->n_params);
  for (size_t p = 0; p < m->n_params; p++) {
    char name[256];
    snprintf(name, sizeof name, "optim.%s.%s", STATE, m->params[p].fqn);
    const sp_safetensors_tensor *t = sp_safetensors_find(full, name);
    if (!t) fail_msg("%s/full: no %s", dir, name);
    assert_int_equal(t->dtype, SP_FLOAT32);
    assert_int_equal((int)t->ndim, m->params[p].ndim);
    for (size_t k = 0; k < t->ndim; k++)
      assert_int_equal(t->shape[k], m->params[p].shape[k]);
  }
  assert_string_equal(
      sp_safetensors_metadata_get(full, "shardplane.optim_states"), STATE);
  sp_safetensors_close(full);
  char name[96];
  snprintf(name, sizeof name, "local/local-0-of-%d.safetensors", w);
  sp_safetensors_file *local = sp_tjob_open_st(dir, name);
  assert_non_null(sp_safetensors_find(local, "layers.0.optim." STATE));
  assert_non_null(sp_safetensors_find(local, "layers.0._flat_param"));
  sp_safetensors_close(local);
  sp_model_free(m);
}

/* 10 steps in one go == 5 steps, save, new processes, load, 5 steps: the
 * same bits everywhere, from each kind of checkpoint. */
static void test_resume_bit_exact(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *one = sp_test_path(dir, "one"), *half = sp_test_path(dir, "half");
  train(k_mp_job, 3, "10", one, NULL, NULL);
  train(k_mp_job, 3, "5", half, NULL, NULL);
  check_state_names(one, 3);
  expect_steps(half, "full/model.safetensors", "5");
  const char *kinds[] = {"full", "sharded", "local"};
  for (size_t k = 0; k < 3; k++) {
    char name[32];
    snprintf(name, sizeof name, "from-%s", kinds[k]);
    char *to = sp_test_path(dir, name);
    char *from = sp_test_path(half, kinds[k]);
    train(k_mp_job, 3, "10", to, from, kinds[k]);
    size_t files = same_checkpoints(one, to, 3, "10");
    same_losses(one, to, 5);
    printf(
        "  5 + 5 steps from the %s checkpoint == 10 in one go: %zu "
        "checkpoint files, every tensor's bytes, the loss curve\n",
        kinds[k], files);
    free(from);
    free(to);
  }
  free(one);
  free(half);
  sp_test_rmtree(dir);
  free(dir);
}

/* The real optimizer's state resumes as the stand-in's does: AdamW with a
 * warmup-cosine schedule, clipping and two micro-batches a step; 6 steps
 * in one go equal 3, a checkpoint (its exp_avg, exp_avg_sq and step
 * count), new processes and 3 more, bit for bit, from FULL and LOCAL. */
static const char *const k_adamw[] = {"--optimizer",
                                      "adamw",
                                      "--lr",
                                      "0.01",
                                      "--weight-decay",
                                      "0.1",
                                      "--lr-schedule",
                                      "cosine",
                                      "--warmup-steps",
                                      "2",
                                      "--min-lr",
                                      "0.001",
                                      "--clip-grad-norm",
                                      "1",
                                      "--grad-accum",
                                      "2",
                                      NULL};

static void train_adamw(const char *steps, const char *out, const char *load,
                        const char *load_kind) {
  char *losses = sp_test_path(out, "losses.json");
  mkdir(out, 0777);
  flags f = {0};
  add(&f, "--steps", steps, "--global-batch", "24", "--checkpoint-dir", out,
      "--checkpoint", "full", "--checkpoint", "local", "--losses", losses,
      NULL);
  for (size_t i = 0; k_adamw[i]; i++) add(&f, k_adamw[i], NULL);
  if (load) add(&f, "--load", load, "--load-kind", load_kind, NULL);
  sp_tjob_run(MLP_BUFFERS, k_f32_job, 2, f.v, JOB_TIMEOUT_S);
  free(losses);
}

static void test_resume_adamw(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *one = sp_test_path(dir, "one"), *half = sp_test_path(dir, "half");
  train_adamw("6", one, NULL, NULL);
  train_adamw("3", half, NULL, NULL);
  char *states =
      meta_of(one, "full/model.safetensors", "shardplane.optim_states");
  assert_non_null(states);
  assert_string_equal(states, "exp_avg,exp_avg_sq");
  free(states);
  const char *kinds[] = {"full", "local"};
  for (size_t k = 0; k < 2; k++) {
    char name[32];
    snprintf(name, sizeof name, "from-%s", kinds[k]);
    char *to = sp_test_path(dir, name);
    char *from = sp_test_path(half, kinds[k]);
    train_adamw("6", to, from, kinds[k]);
    sp_tjob_same_tensors(one, "full/model.safetensors", to,
                         "full/model.safetensors");
    sp_tjob_same_tensors(one, "local/local-1-of-2.safetensors", to,
                         "local/local-1-of-2.safetensors");
    expect_steps(to, "full/model.safetensors", "6");
    same_losses(one, to, 3);
    printf(
        "  AdamW, cosine, clipping, 2 micro-batches: 3 + 3 steps from the "
        "%s checkpoint == 6 in one go, moments and parameters bit for "
        "bit\n",
        kinds[k]);
    free(from);
    free(to);
  }
  free(one);
  free(half);
  sp_test_rmtree(dir);
  free(dir);
}

/* What differs between two FULL checkpoints: max |a - b| / max |a| per
 * floating tensor, the worst over the parameters and buffers and over the
 * optimizer's tensors, and how many elements differ at all; integer and
 * bool tensors must be equal. */
typedef struct diff_stats {
  double model_err, optim_err;
  char model_worst[256], optim_worst[256];
  size_t differ, elems, tensors;
} diff_stats;

static void full_diff(const char *a, const char *b, diff_stats *ds) {
  memset(ds, 0, sizeof *ds);
  sp_safetensors_file *fa = sp_tjob_open_st(a, "full/model.safetensors");
  sp_safetensors_file *fb = sp_tjob_open_st(b, "full/model.safetensors");
  assert_int_equal(sp_safetensors_tensor_count(fa),
                   sp_safetensors_tensor_count(fb));
  ds->tensors = sp_safetensors_tensor_count(fa);
  for (size_t i = 0; i < sp_safetensors_tensor_count(fa); i++) {
    const sp_safetensors_tensor *ta = sp_safetensors_tensor_at(fa, i);
    const sp_safetensors_tensor *tb = sp_safetensors_find(fb, ta->name);
    if (!tb) fail_msg("%s: no %s", b, ta->name);
    assert_int_equal(ta->dtype, tb->dtype);
    assert_int_equal(ta->numel, tb->numel);
    if (!sp_dtype_is_floating(ta->dtype)) {
      if (memcmp(ta->data, tb->data, ta->nbytes) != 0)
        fail_msg("%s (%s) differs", ta->name, sp_dtype_name(ta->dtype));
      continue;
    }
    double diff = 0, scale = 0;
    for (size_t k = 0; k < ta->numel; k++) {
      double x = sp_tjob_elem(ta, k), y = sp_tjob_elem(tb, k);
      if (isnan(x) || isnan(y)) fail_msg("%s: NaN", ta->name);
      diff = fmax(diff, fabs(x - y));
      scale = fmax(scale, fabs(x));
      ds->differ += x != y;
    }
    ds->elems += ta->numel;
    double e = scale > 0 ? diff / scale : diff;
    bool optim = has_prefix(ta->name, "optim.");
    double *err = optim ? &ds->optim_err : &ds->model_err;
    if (e > *err) {
      *err = e;
      snprintf(optim ? ds->optim_worst : ds->model_worst, 256, "%s", ta->name);
    }
  }
  sp_safetensors_close(fa);
  sp_safetensors_close(fb);
}

/* Measured (3 ranks to step 5, then 2 or 4 ranks to step 10, float32):
 * at most 1.1e-7 relative on parameters and buffers and 1.7e-7 on the
 * optimizer state, about 1 ulp of each tensor's largest value; 8.5% of
 * the elements differ at all. The bound is the parity test's TOL_F32,
 * 1e-5: a misplaced element or a lost state would be off by O(1). */
#define TOL_WORLD 1e-5

/* FULL and SHARDED resume at another world size: within TOL_WORLD of the
 * one-go run; reloaded without training, exactly the saved tensors. */
static void test_resume_other_world(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *one = sp_test_path(dir, "one"), *half = sp_test_path(dir, "half");
  train(k_f32_job, 3, "10", one, NULL, NULL);
  train(k_f32_job, 3, "5", half, NULL, NULL);
  struct {
    const char *kind;
    int n;
  } cases[] = {{"full", 2}, {"sharded", 4}, {"sharded", 2}, {"full", 4}};
  double worst_all = 0;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char name[64], nn[8];
    snprintf(nn, sizeof nn, "%d", cases[i].n);
    char *from = sp_test_path(half, cases[i].kind);
    /* no training: the step loaded is already --steps */
    snprintf(name, sizeof name, "reload-%s-%d", cases[i].kind, cases[i].n);
    char *re = sp_test_path(dir, name);
    train(k_f32_job, cases[i].n, "5", re, from, cases[i].kind);
    sp_tjob_same_tensors(half, "full/model.safetensors", re,
                         "full/model.safetensors");
    expect_steps(re, "full/model.safetensors", "5");
    snprintf(name, sizeof name, "resume-%s-%d", cases[i].kind, cases[i].n);
    char *to = sp_test_path(dir, name);
    train(k_f32_job, cases[i].n, "10", to, from, cases[i].kind);
    expect_steps(to, "full/model.safetensors", "10");
    diff_stats ds;
    full_diff(one, to, &ds);
    printf(
        "  %s of 3 ranks at step 5, reloaded into %d ranks: every tensor "
        "equal; resumed to step 10, against the one-go run: parameters "
        "and buffers within %.2e (%s), optimizer state within %.2e (%s); "
        "%zu of %zu elements differ\n",
        cases[i].kind, cases[i].n, ds.model_err, ds.model_worst, ds.optim_err,
        ds.optim_worst, ds.differ, ds.elems);
    double err = fmax(ds.model_err, ds.optim_err);
    assert_true(err <= TOL_WORLD);
    worst_all = fmax(worst_all, err);
    free(to);
    free(re);
    free(from);
  }
  printf(
      "  largest relative difference at another world size: %.2e "
      "(bound %.0e)\n",
      worst_all, TOL_WORLD);
  free(one);
  free(half);
  sp_test_rmtree(dir);
  free(dir);
}

static bool exists(const char *dir, const char *name) {
  char *p = sp_test_path(dir, name);
  struct stat sb;
  bool ok = stat(p, &sb) == 0;
  free(p);
  return ok;
}

/* SIGINT to one rank mid-run: every rank stops after the same step K
 * (rank 1 exits 130, the others 143), with a checkpoint of step K in
 * every file; resumed to K + 5 it equals a job of K + 5 steps that was
 * never stopped. */
static void test_stop_and_resume(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *stop = sp_test_path(dir, "stop");
  mkdir(stop, 0777);
  const char *wf[] = {"--steps",
                      "1000000",
                      "--test-state",
                      STATE,
                      "--checkpoint-dir",
                      stop,
                      "--checkpoint",
                      "full",
                      "--checkpoint",
                      "sharded",
                      "--checkpoint",
                      "local",
                      "--checkpoint-every",
                      "7",
                      NULL};
  sp_tjob j;
  sp_tjob_start(&j, MLP_BUFFERS, k_mp_job, 3, wf, dir);
  /* training is under way once the first periodic checkpoint is there */
  double end = sp_clock_s() + 60;
  while (!exists(stop, "sharded/index.json") && sp_clock_s() < end)
    sp_test_sleep_ms(20);
  assert_true(exists(stop, "sharded/index.json"));
  kill(j.w[1], SIGINT);
  assert_int_equal(sp_tjob_wait(&j, 60), 0);
  assert_int_equal(j.status[0], 143);
  assert_int_equal(j.status[1], 130);
  assert_int_equal(j.status[2], 143);
  char *k = meta_of(stop, "full/model.safetensors", STEPS_META);
  assert_non_null(k);
  long steps = atol(k);
  assert_true(steps >= 7);
  char name[96];
  for (int r = 0; r < 3; r++) {
    snprintf(name, sizeof name, "sharded/rank-%d-of-3.safetensors", r);
    expect_steps(stop, name, k);
    snprintf(name, sizeof name, "local/local-%d-of-3.safetensors", r);
    expect_steps(stop, name, k);
  }
  /* nothing half-written is left next to the checkpoints */
  assert_false(exists(stop, "full.tmp"));
  assert_false(exists(stop, "sharded.tmp"));
  char total[32];
  snprintf(total, sizeof total, "%ld", steps + 5);
  char *resumed = sp_test_path(dir, "resumed");
  char *from = sp_test_path(stop, "sharded");
  train(k_mp_job, 3, total, resumed, from, "sharded");
  char *whole = sp_test_path(dir, "whole");
  train(k_mp_job, 3, total, whole, NULL, NULL);
  size_t files = same_checkpoints(whole, resumed, 3, total);
  same_losses(whole, resumed, (size_t)steps);
  printf(
      "  SIGINT to rank 1: all 3 ranks stopped after step %s (exit 143, "
      "130, 143) with a checkpoint; resumed to step %s it equals the "
      "run never stopped (%zu files)\n",
      k, total, files);
  free(k);
  free(whole);
  free(from);
  free(resumed);
  free(stop);
  sp_test_rmtree(dir);
  free(dir);
}

/* A save that cannot be made fails on every rank, naming the one at
 * fault, and keeps the previous checkpoint; a clean save then replaces
 * it and leaves no staging directory. */
static void test_failed_save_keeps_old(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  train(k_f32_job, 2, "3", ck, NULL, NULL);
  /* something in the staging directory the save may not remove */
  char *staging = sp_test_path(ck, "sharded.tmp");
  char *sub = sp_test_path(staging, "keep-me");
  assert_int_equal(mkdir(staging, 0777), 0);
  assert_int_equal(mkdir(sub, 0777), 0);
  char *from = sp_test_path(ck, "sharded");
  const char *wf[] = {"--steps",
                      "6",
                      "--test-state",
                      STATE,
                      "--load",
                      from,
                      "--load-kind",
                      "sharded",
                      "--checkpoint-dir",
                      ck,
                      "--checkpoint",
                      "sharded",
                      NULL};
  sp_tjob j;
  sp_tjob_start(&j, MLP_BUFFERS, k_f32_job, 2, wf, dir);
  assert_int_equal(sp_tjob_wait(&j, 60), 0);
  for (int r = 0; r < 2; r++) assert_int_equal(j.status[r], 1);
  char *e0p = sp_test_path(dir, "rank-0.err"),
       *e1p = sp_test_path(dir, "rank-1.err");
  char *e0 = sp_test_read_file(e0p), *e1 = sp_test_read_file(e1p);
  printf("  rank 0: %s  rank 1: %s", e0, e1);
  assert_non_null(strstr(e0, "keep-me"));
  assert_non_null(strstr(e1,
                         "rank 0 failed preparing the checkpoint "
                         "directory"));
  /* the old checkpoint is there, whole */
  expect_steps(ck, "sharded/rank-0-of-2.safetensors", "3");
  expect_steps(ck, "sharded/rank-1-of-2.safetensors", "3");
  assert_int_equal(rmdir(sub), 0);
  /* a folder to replace that holds more than a checkpoint's files */
  char *mine = sp_test_path(from, "not-a-checkpoint-file");
  assert_int_equal(mkdir(mine, 0777), 0);
  sp_tjob_start(&j, MLP_BUFFERS, k_f32_job, 2, wf, dir);
  assert_int_equal(sp_tjob_wait(&j, 60), 0);
  for (int r = 0; r < 2; r++) assert_int_equal(j.status[r], 1);
  free(e0);
  e0 = sp_test_read_file(e0p);
  printf("  rank 0: %s", e0);
  assert_non_null(strstr(e0,
                         "holds not-a-checkpoint-file, which is not a "
                         "checkpoint file"));
  expect_steps(ck, "sharded/rank-0-of-2.safetensors", "3");
  assert_int_equal(rmdir(mine), 0);
  free(mine);
  char *again = sp_test_path(dir, "again");
  /* now it goes through, every 2 steps and at the end */
  sp_tjob_run(MLP_BUFFERS, k_f32_job, 2,
              (const char *const[]){"--steps", "6", "--test-state", STATE,
                                    "--load", from, "--load-kind", "sharded",
                                    "--checkpoint-dir", ck, "--checkpoint",
                                    "sharded", "--checkpoint-every", "2", NULL},
              JOB_TIMEOUT_S);
  expect_steps(ck, "sharded/rank-1-of-2.safetensors", "6");
  assert_false(exists(ck, "sharded.tmp"));
  printf(
      "  a save refused on rank 0 failed on both ranks and kept the "
      "step-3 checkpoint; the next one replaced it (step 6), no staging "
      "left\n");
  free(again);
  free(e0);
  free(e1);
  free(e0p);
  free(e1p);
  free(from);
  free(sub);
  free(staging);
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* The checkpoint's optimizer states must be the registered ones. */
static void test_state_mismatch(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *with = sp_test_path(dir, "with");
  train(k_f32_job, 2, "2", with, NULL, NULL);
  char *plain = sp_test_path(dir, "plain");
  const char *pf[] = {"--steps", "2", "--checkpoint-dir", plain, "--checkpoint",
                      "full",    NULL};
  sp_tjob_run(MLP_BUFFERS, k_f32_job, 2, pf, JOB_TIMEOUT_S);
  struct {
    const char *from, *state, *want;
  } cases[] = {
      {with, NULL,
       "holds optimizer state \"" STATE "\", which this runtime "
       "has not registered"},
      {plain, STATE,
       "optimizer state \"" STATE "\" of this runtime is not "
       "in the checkpoint"},
      {with, "other", "has not registered"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *from = sp_test_path(cases[i].from, "full");
    flags f = {0};
    add(&f, "--steps", "3", "--load", from, "--load-kind", "full",
        "--checkpoint", "none", NULL);
    if (cases[i].state) add(&f, "--test-state", cases[i].state, NULL);
    sp_tjob j;
    char sub[32];
    snprintf(sub, sizeof sub, "case-%zu", i);
    char *errdir = sp_test_path(dir, sub);
    mkdir(errdir, 0777);
    sp_tjob_start(&j, MLP_BUFFERS, k_f32_job, 2, f.v, errdir);
    assert_int_equal(sp_tjob_wait(&j, 60), 0);
    char *ep = sp_test_path(errdir, "rank-1.err");
    char *e = sp_test_read_file(ep);
    printf("  %s", e);
    assert_int_equal(j.status[1], 1);
    assert_non_null(strstr(e, cases[i].want));
    assert_non_null(strstr(e, "model.safetensors"));
    free(e);
    free(ep);
    free(errdir);
    free(from);
  }
  free(plain);
  free(with);
  sp_test_rmtree(dir);
  free(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_resume_bit_exact),
      cmocka_unit_test(test_resume_adamw),
      cmocka_unit_test(test_resume_other_world),
      cmocka_unit_test(test_stop_and_resume),
      cmocka_unit_test(test_failed_save_keeps_old),
      cmocka_unit_test(test_state_mismatch),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
