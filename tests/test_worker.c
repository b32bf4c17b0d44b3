/* End to end: a real coordinator and real shardplane-worker processes over
 * Gloo on loopback.
 *  - parity: every strategy, mixed precision off and on, N = 1..4 ranks,
 *    against the unsharded single-process run of the same global batch
 *    (sp_mlp_reference_run): loss curve and final parameters; with SGD,
 *    and with AdamW, warmup-cosine, clipping and gradient accumulation
 *    (sp_mlp_reference_train);
 *  - checkpoints: FULL, SHARDED and LOCAL written, read back by the
 *    project's reader and by an independent Python reader, loaded into a
 *    different world size;
 *  - the buffer test: same local name, different original dtypes;
 *  - a worker killed mid-step ends the others within the heartbeat timeout.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include <jansson.h>

#include "cast/cast.h"
#include "cast/cast_cuda.h"
#include "base/clock.h"
#include "support/job_fixture.h"
#include "worker/mlp.h"
#include "worker/train_memory.h"
#include "plan/plan.h"
#include "base/proc.h"
#include "safetensors/safetensors.h"
#include "lib/shardplane.h"
#include "support/testutil.h"

extern char **environ;

#define MLP SP_EXAMPLES "/mlp.json"
#define MLP_BUFFERS SP_TEST_DATA "/mlp_buffers.json"
#define ST_READER SP_TEST_DATA "/../interop/st_reader.py"
#define STEPS 6
#define BATCH 24
#define LR "0.05"

/* a job's workers must all be done within this */
#define JOB_TIMEOUT_S 120

static const char *const k_strategies[] = {"FULL_SHARD", "SHARD_GRAD_OP",
                                           "NO_SHARD", "HYBRID_SHARD"};

/* HYBRID_SHARD's shard group: 2 of 4 (two replicas), 1 of 2 (pure
 * replication), else all ranks. */
static int hybrid_group(int n) { return n == 4 ? 2 : n == 2 ? 1 : n; }

/* Float32: the runs differ only in summation order (per-rank partial sums,
 * the pre/post divide factors), so 1e-5 relative, as the issue asks.
 * bfloat16 parameters: each rank rounds its partial-batch gradient to bf16
 * (8 significant bits, relative spacing 2^-8 = 3.9e-3) where the single
 * process rounds the whole-batch gradient once, so the runs drift apart by
 * a fraction of one bf16 rounding step of lr * gradient per step. The bound
 * is a quarter of bf16's relative spacing, 1e-3, for the loss curve and the
 * float32 master parameters: far tighter than a bf16 ulp, so a real error
 * (a wrong cast, a missed rounding, a wrong divide factor) cannot hide in
 * it. Measured: at most 1.0e-4 (loss) and 1.6e-4 (params). */
#define TOL_F32 1e-5
#define TOL_BF16 1e-3

static void test_parity(void **state) {
  (void)state;
  enum { N_CASES = 4 * 2 * 4 };
  sp_tjob_parity_cfg c[N_CASES];
  char label[N_CASES][64];
  const char *labels[N_CASES];
  size_t k = 0;
  for (size_t s = 0; s < 4; s++)
    for (int mp = 0; mp <= 1; mp++)
      for (int n = 1; n <= 4; n++, k++) {
        snprintf(label[k], sizeof label[k], "%-13s %-4s N=%d", k_strategies[s],
                 mp ? "bf16" : "f32", n);
        labels[k] = label[k];
        c[k] = (sp_tjob_parity_cfg){.model = MLP,
                                    .strategy = k_strategies[s],
                                    .group = hybrid_group(n),
                                    .mp = mp,
                                    .n = n,
                                    .steps = STEPS,
                                    .batch = BATCH,
                                    .lr = LR,
                                    .tol = mp ? TOL_BF16 : TOL_F32,
                                    .timeout_s = JOB_TIMEOUT_S};
      }
  /* a job mostly waits on its rendezvous and timers: three at a time */
  sp_tjob_parity_many(c, labels, N_CASES, 3);
}

/* ---- the optimizer: AdamW, schedule, clipping, accumulation ----
 * AdamW (lr 0.01, betas 0.9,0.999, eps 1e-8) with decoupled weight decay
 * 0.1 on the weights only, linear warmup then cosine decay to 0.001,
 * clipping to a global norm of 1 (the MLP's gradient norm is about 2, so
 * every step clips) and two micro-batches a step, reduced each (FSDP2's
 * default) or once (no_sync); against sp_mlp_reference_train, the
 * unsharded run with the same settings (read from the same flags).
 *
 * float32: the runs differ in summation order only, and AdamW's update
 * does not amplify that: the bound is 1e-6 relative, as the issue asks.
 * Measured: params 4.6e-7 (W = 3, whose divide by 3 rounds), loss curve
 * 2.3e-8, after 20 steps.
 *
 * bfloat16 parameters: each rank rounds its partial gradient to bfloat16
 * (8 significant bits) before the reduction, where the single process
 * rounds the whole batch's once. Where the partial gradients cancel, the
 * sum's relative error is large, and AdamW normalises every element's
 * step to about lr whatever the gradient's size (m / sqrt(v) is near +-1),
 * so such an element can step up to ~2 lr apart each step; the largest
 * parameters (the norm weights) are about 1, so a few lr of drift after
 * 20 steps (sum of the schedule's lr: 0.11) is a few 1e-2 relative. SGD's
 * step scales with the gradient, which is why test_parity keeps 1e-3 for
 * it. Bounds: 0.1 for the largest element, 3e-2 for the rms error of all
 * parameters, 5e-3 for the loss curve. Measured after 20 steps: 3.8e-2,
 * 1.1e-2 and 1.4e-3. */
/* SGD with momentum 0.9, bfloat16: each step's update sums about ten
 * steps' gradients, each with the per-rank bfloat16 rounding test_parity
 * bounds by 1e-3 over 6 steps, so over 20 steps the drift is some times
 * larger; the step still scales with the gradient (no AdamW-like
 * normalisation). Measured 3.2e-3 (params), 3.4e-4 (loss). */
#define TOL_BF16_MOMENTUM 1e-2
#define OPT_STEPS_ALL 5 /* the whole matrix: warmup, decay and the end */
#define SP_STR_(x) #x
#define SP_STR(x) SP_STR_(x)
#define OPT_STEPS_SUBSET 20
#define OPT_PARALLEL 3

static const char *const k_opt_flags[2][20] = {
    {"--optimizer", "adamw", "--weight-decay", "0.1", "--lr-schedule", "cosine",
     "--warmup-steps", "2", "--min-lr", "0.001", "--clip-grad-norm", "1",
     "--grad-accum", "2", NULL},
    {"--optimizer", "adamw", "--weight-decay", "0.1", "--lr-schedule", "cosine",
     "--warmup-steps", "2", "--min-lr", "0.001", "--clip-grad-norm", "1",
     "--grad-accum", "2", "--no-sync", NULL}};
static const char *const k_opt_flags20[2][20] = {
    {"--optimizer", "adamw", "--weight-decay", "0.1", "--lr-schedule", "cosine",
     "--warmup-steps", "3", "--min-lr", "0.001", "--clip-grad-norm", "1",
     "--grad-accum", "2", NULL},
    {"--optimizer", "adamw", "--weight-decay", "0.1", "--lr-schedule", "cosine",
     "--warmup-steps", "3", "--min-lr", "0.001", "--clip-grad-norm", "1",
     "--grad-accum", "2", "--no-sync", NULL}};

static const char *const k_sgd_flags[2][20] = {
    {"--momentum", "0.9", "--weight-decay", "0.01", "--clip-grad-norm", "1",
     "--grad-accum", "2", NULL},
    {"--momentum", "0.9", "--weight-decay", "0.01", "--clip-grad-norm", "1",
     "--grad-accum", "2", "--no-sync", NULL}};

typedef struct opt_matrix {
  sp_tjob_parity_cfg c[128];
  char label[128][96];
  const char *labels[128];
  size_t n;
} opt_matrix;

/* One configuration: AdamW (sgd false) or SGD with momentum (true). */
static void opt_add(opt_matrix *m, size_t s, bool mp, int n, int nosync,
                    uint32_t steps, bool sgd) {
  assert_true(m->n < 128);
  sp_tjob_parity_cfg *c = &m->c[m->n];
  const char *const *flags = sgd                         ? k_sgd_flags[nosync]
                             : steps == OPT_STEPS_SUBSET ? k_opt_flags20[nosync]
                                                         : k_opt_flags[nosync];
  double tol = sgd ? (mp ? TOL_BF16_MOMENTUM : 1e-6) : mp ? 0.1 : 1e-6;
  *c = (sp_tjob_parity_cfg){.model = MLP,
                            .strategy = k_strategies[s],
                            .group = hybrid_group(n),
                            .mp = mp,
                            .n = n,
                            .steps = steps,
                            .batch = BATCH,
                            .lr = sgd ? LR : "0.01",
                            .wflags = flags,
                            .tol = tol,
                            .rms_tol = mp && !sgd ? 3e-2 : 0,
                            .loss_tol = sgd  ? tol
                                        : mp ? 5e-3
                                             : 1e-6,
                            .timeout_s = JOB_TIMEOUT_S};
  snprintf(m->label[m->n], sizeof m->label[0], "%-13s %-4s N=%d %-7s %2u st %s",
           k_strategies[s], mp ? "bf16" : "f32", n, nosync ? "no_sync" : "sync",
           steps, sgd ? "SGD" : "AdamW");
  m->labels[m->n] = m->label[m->n];
  m->n++;
}

static void opt_run(opt_matrix *m, const char *what) {
  sp_tjob_errors worst[2] = {{0, 0, 0}, {0, 0, 0}};
  /* the float32 and the bfloat16 runs' largest errors apart */
  for (int mp = 0; mp <= 1; mp++) {
    opt_matrix *part = calloc(1, sizeof *part);
    assert_non_null(part);
    for (size_t i = 0; i < m->n; i++)
      if (m->c[i].mp == (mp == 1)) {
        part->c[part->n] = m->c[i];
        part->labels[part->n++] = m->labels[i];
      }
    g_parity_worst = &worst[mp];
    sp_tjob_parity_many(part->c, part->labels, part->n, OPT_PARALLEL);
    g_parity_worst = NULL;
    free(part);
  }
  printf(
      "  %s: largest errors float32: params %.2e, loss %.2e; bfloat16: "
      "params %.2e (rms %.2e), loss %.2e\n",
      what, worst[0].params, worst[0].loss, worst[1].params, worst[1].rms,
      worst[1].loss);
}

/* Every strategy, W = 1..4, float32 and bfloat16, both accumulation
 * modes, for a few steps. */
static void test_parity_optim(void **state) {
  (void)state;
  opt_matrix *m = calloc(1, sizeof *m);
  assert_non_null(m);
  for (int nosync = 0; nosync <= 1; nosync++)
    for (size_t s = 0; s < 4; s++)
      for (int mp = 0; mp <= 1; mp++)
        for (int n = 1; n <= 4; n++)
          opt_add(m, s, mp, n, nosync, OPT_STEPS_ALL, false);
  opt_run(m, "AdamW, every configuration, " SP_STR(OPT_STEPS_ALL) " steps");
  free(m);
}

/* 20 steps: every strategy at W = 4 (HYBRID_SHARD: 2 replicas) in both
 * modes, W = 3 (padding, a rounding divide), and bfloat16. */
static void test_parity_optim_20_steps(void **state) {
  (void)state;
  opt_matrix *m = calloc(1, sizeof *m);
  assert_non_null(m);
  for (int nosync = 0; nosync <= 1; nosync++) {
    for (size_t s = 0; s < 4; s++)
      opt_add(m, s, false, 4, nosync, OPT_STEPS_SUBSET, false);
    opt_add(m, 0, false, 3, nosync, OPT_STEPS_SUBSET, false);
    opt_add(m, 0, true, 4, nosync, OPT_STEPS_SUBSET, false);
    opt_add(m, 3, true, 4, nosync, OPT_STEPS_SUBSET, false);
  }
  /* SGD with momentum and weight decay (L2), clipped and accumulated */
  for (int nosync = 0; nosync <= 1; nosync++) {
    opt_add(m, 0, false, 4, nosync, OPT_STEPS_SUBSET, true);
    opt_add(m, 3, true, 4, nosync, OPT_STEPS_SUBSET, true);
  }
  opt_run(m, "AdamW and SGD, " SP_STR(OPT_STEPS_SUBSET) " steps");
  free(m);
}

/* ---- checkpoints ---- */

static bool have_numpy(void) {
  return access("/usr/bin/python3", X_OK) == 0 &&
         system("/usr/bin/python3 -c 'import numpy' 2>/dev/null") == 0;
}

/* The independent Python reader must load the file and see every tensor
 * with the dtype, shape and bytes our reader sees. */
static void check_with_python(const char *path) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s '%s' --hex-limit 100000000",
           ST_READER, path);
  char *out;
  int st = sp_test_shell(cmd, &out);
  if (st != 0) fail_msg("st_reader.py %s: status %d", path, st);
  json_error_t err;
  json_t *root = json_loads(out, 0, &err);
  if (!root) fail_msg("st_reader.py output: %s", err.text);
  json_t *tensors = json_object_get(root, "tensors");
  sp_safetensors_file *f;
  sp_diag d = {{0}};
  assert_int_equal(sp_safetensors_open(path, &f, &d), 0);
  assert_int_equal(json_object_size(tensors), sp_safetensors_tensor_count(f));
  /* the metadata too (the step count and state names among it) */
  json_t *meta = json_object_get(root, "metadata");
  assert_int_equal(json_object_size(meta), sp_safetensors_metadata_count(f));
  for (size_t i = 0; i < sp_safetensors_metadata_count(f); i++) {
    const sp_safetensors_kv *kv = sp_safetensors_metadata_at(f, i);
    const char *pv = json_string_value(json_object_get(meta, kv->key));
    if (!pv || strcmp(pv, kv->value) != 0)
      fail_msg("%s: metadata %s: Python sees %s", path, kv->key,
               pv ? pv : "nothing");
  }
  for (size_t i = 0; i < sp_safetensors_tensor_count(f); i++) {
    const sp_safetensors_tensor *t = sp_safetensors_tensor_at(f, i);
    json_t *pt = json_object_get(tensors, t->name);
    if (!pt) fail_msg("%s: Python did not see %s", path, t->name);
    assert_string_equal(json_string_value(json_object_get(pt, "dtype")),
                        sp_dtype_st_name(t->dtype));
    json_t *shape = json_object_get(pt, "shape");
    assert_int_equal(json_array_size(shape), t->ndim);
    for (size_t k = 0; k < t->ndim; k++)
      assert_int_equal(json_integer_value(json_array_get(shape, k)),
                       t->shape[k]);
    const char *hex = json_string_value(json_object_get(pt, "hex"));
    assert_non_null(hex);
    assert_int_equal(strlen(hex), 2 * t->nbytes);
    for (size_t k = 0; k < t->nbytes; k++) {
      unsigned v;
      sscanf(hex + 2 * k, "%2x", &v);
      if (v != t->data[k])
        fail_msg("%s: %s byte %zu differs", path, t->name, k);
    }
  }
  sp_safetensors_close(f);
  json_decref(root);
  free(out);
}

static const char *const k_buffer_job[] = {
    "--wrap-type",    "Linear",         "--param-dtype",
    "bfloat16",       "--reduce-dtype", "float32",
    "--buffer-dtype", "bfloat16",       NULL};

/* The buffer test of the seed: buffers named running_mean in float64,
 * float16 and bfloat16 submodules, counters in int64 and int32, bools;
 * trained with buffer_dtype bfloat16. */
static void test_buffers_and_checkpoints(void **state) {
  (void)state;
  if (!have_numpy()) {
    printf("  (the Python reader part needs /usr/bin/python3 with numpy)\n");
  }
  char *dir = sp_test_mkdtemp();
  /* with an optimizer state, so the Python reader sees its tensors and
   * the step count too */
  const char *wflags[] = {"--steps",
                          "4",
                          "--global-batch",
                          "24",
                          "--checkpoint-dir",
                          dir,
                          "--checkpoint",
                          "full",
                          "--checkpoint",
                          "sharded",
                          "--checkpoint",
                          "local",
                          "--test-state",
                          "exp_avg",
                          NULL};
  sp_tjob_run(MLP_BUFFERS, k_buffer_job, 3, wflags, JOB_TIMEOUT_S);

  sp_tjob_check_buffers(
      MLP_BUFFERS, 3, 4, 24, 0.05, dir, "sharded/rank-0-of-3.safetensors",
      "local/local-1-of-3.safetensors", "sharded - single process");
  /* SHARDED: rank 0 holds the buffers, the others only parameter chunks */
  sp_model *m;
  sp_diag d = {{0}};
  assert_int_equal(sp_model_load_file(MLP_BUFFERS, &m, &d), 0);
  sp_safetensors_file *rank2 =
      sp_tjob_open_st(dir, "sharded/rank-2-of-3.safetensors");
  for (size_t b = 0; b < m->n_buffers; b++)
    assert_null(sp_safetensors_find(rank2, m->buffers[b].fqn));
  sp_safetensors_close(rank2);
  sp_model_free(m);

  if (have_numpy()) {
    const char *files[] = {
        "full/model.safetensors",          "sharded/rank-0-of-3.safetensors",
        "sharded/rank-1-of-3.safetensors", "sharded/rank-2-of-3.safetensors",
        "local/local-0-of-3.safetensors",  "local/local-1-of-3.safetensors",
        "local/local-2-of-3.safetensors"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
      char *path = sp_test_path(dir, files[i]);
      check_with_python(path);
      free(path);
    }
  }
  sp_test_rmtree(dir);
  free(dir);
}

/* FULL and SHARDED load into another world size, LOCAL into the same plan
 * only: load, save FULL without training, compare with the original. */
static void test_checkpoint_reload(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *src = sp_test_path(dir, "src");
  const char *wflags[] = {"--steps",
                          "3",
                          "--checkpoint-dir",
                          src,
                          "--checkpoint",
                          "full",
                          "--checkpoint",
                          "sharded",
                          "--checkpoint",
                          "local",
                          NULL};
  sp_tjob_run(MLP_BUFFERS, k_buffer_job, 2, wflags, JOB_TIMEOUT_S);
  struct {
    const char *kind;
    int n;
  } cases[] = {{"full", 3}, {"sharded", 3}, {"sharded", 4}, {"local", 2}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char name[64];
    snprintf(name, sizeof name, "%s-%d", cases[i].kind, cases[i].n);
    char *dst = sp_test_path(dir, name);
    char *from = sp_test_path(src, cases[i].kind);
    const char *lf[] = {"--steps",
                        "0",
                        "--load",
                        from,
                        "--load-kind",
                        cases[i].kind,
                        "--checkpoint-dir",
                        dst,
                        "--checkpoint",
                        "full",
                        NULL};
    sp_tjob_run(MLP_BUFFERS, k_buffer_job, cases[i].n, lf, JOB_TIMEOUT_S);
    sp_tjob_same_tensors(src, "full/model.safetensors", dst,
                         "full/model.safetensors");
    printf(
        "  %s checkpoint of 2 ranks loaded into %d ranks: every tensor "
        "equal\n",
        cases[i].kind, cases[i].n);
    free(from);
    free(dst);
  }
  /* LOCAL into another world size: refused, naming the plan */
  {
    sp_tjob j;
    char *from = sp_test_path(src, "local");
    const char *lf[] = {"--steps",      "0",           "--load",
                        from,           "--load-kind", "local",
                        "--checkpoint", "none",        NULL};
    sp_tjob_start(&j, MLP_BUFFERS, k_buffer_job, 3, lf, NULL);
    assert_int_equal(sp_tjob_wait(&j, 60), 0);
    for (int r = 0; r < 3; r++) assert_int_equal(j.status[r], 1);
    free(from);
  }
  free(src);
  sp_test_rmtree(dir);
  free(dir);
}

/* Storage handled as a device's ("cpu-staged": host memory, but every
 * host access staged as on a GPU): training, checkpoints and loads must
 * give exactly the plain CPU run's files, so the staging paths a GPU
 * takes (initialisation, FULL/SHARDED/LOCAL writes, loads) are checked
 * on a machine without one. */
static void test_staged_storage(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *plain = sp_test_path(dir, "plain"),
       *staged = sp_test_path(dir, "staged");
  const char *wp[] = {"--steps",
                      "3",
                      "--checkpoint-dir",
                      plain,
                      "--checkpoint",
                      "full",
                      "--checkpoint",
                      "sharded",
                      "--checkpoint",
                      "local",
                      NULL};
  sp_tjob_run(MLP_BUFFERS, k_buffer_job, 2, wp, JOB_TIMEOUT_S);
  const char *ws[] = {"--device",
                      "cpu-staged",
                      "--steps",
                      "3",
                      "--checkpoint-dir",
                      staged,
                      "--checkpoint",
                      "full",
                      "--checkpoint",
                      "sharded",
                      "--checkpoint",
                      "local",
                      NULL};
  sp_tjob_run(MLP_BUFFERS, k_buffer_job, 2, ws, JOB_TIMEOUT_S);
  const char *files[] = {
      "full/model.safetensors", "sharded/rank-0-of-2.safetensors",
      "sharded/rank-1-of-2.safetensors", "local/local-0-of-2.safetensors",
      "local/local-1-of-2.safetensors"};
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
    sp_tjob_same_tensors(plain, files[i], staged, files[i]);
  /* loads into staged storage: FULL into 3 ranks, LOCAL into 2 */
  struct {
    const char *kind;
    const char *n;
    int ranks;
  } cases[] = {{"full", "full-3", 3},
               {"sharded", "sharded-3", 3},
               {"local", "local-2", 2}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *from = sp_test_path(plain, cases[i].kind);
    char *dst = sp_test_path(dir, cases[i].n);
    const char *lf[] = {"--device",    "cpu-staged",   "--steps",
                        "0",           "--load",       from,
                        "--load-kind", cases[i].kind,  "--checkpoint-dir",
                        dst,           "--checkpoint", "full",
                        NULL};
    sp_tjob_run(MLP_BUFFERS, k_buffer_job, cases[i].ranks, lf, JOB_TIMEOUT_S);
    sp_tjob_same_tensors(plain, "full/model.safetensors", dst,
                         "full/model.safetensors");
    free(from);
    free(dst);
  }
  printf(
      "  cpu-staged storage: checkpoints byte-equal to the plain CPU "
      "run's; FULL, SHARDED and LOCAL loads round-trip\n");
  free(plain);
  free(staged);
  sp_test_rmtree(dir);
  free(dir);
}

/* Runs argv with stderr into a string; returns the exit status. */
static int run_capture(char *const argv[], char **err) {
  char *dir = sp_test_mkdtemp();
  char *path = sp_test_path(dir, "stderr");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, path, O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) fail_msg("cannot start %s: %s", argv[0], strerror(rc));
  int st;
  waitpid(pid, &st, 0);
  *err = sp_test_read_file(path);
  free(path);
  sp_test_rmtree(dir);
  free(dir);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* --device errors are messages and exit codes, never crashes: a malformed
 * name is bad usage (2); a GPU that is not there (or a build without
 * CUDA) fails the rank (1) before it attaches. */
static void test_device_errors(void **state) {
  (void)state;
  char *err;
  char *bad[] = {SP_BIN_DIR "/shardplane-worker",
                 "--coordinator",
                 "127.0.0.1:1",
                 "--rank",
                 "0",
                 "--device",
                 "gpu0",
                 NULL};
  assert_int_equal(run_capture(bad, &err), 2);
  assert_non_null(strstr(err, "--device \"gpu0\": expected cpu or cuda:N"));
  free(err);
  int n = 0;
  assert_int_equal(sp_cuda_device_count(&n), 0);
  if (n > 0) {
    printf(
        "  (a CUDA device is present: the no-device messages are not "
        "checked)\n");
    return;
  }
  char *nodev[] = {SP_BIN_DIR "/shardplane-worker",
                   "--coordinator",
                   "127.0.0.1:1",
                   "--rank",
                   "0",
                   "--device",
                   "cuda:0",
                   NULL};
  assert_int_equal(run_capture(nodev, &err), 1);
  printf("  %s", err);
  assert_true(strstr(err, "--device cuda:0: no CUDA device") ||
              strstr(err, "built without CUDA"));
  free(err);
  char *run[] = {SP_BIN_DIR "/shardplane",
                 "run",
                 "--nproc",
                 "1",
                 "--model",
                 MLP,
                 "--device",
                 "cuda",
                 NULL};
  assert_int_equal(run_capture(run, &err), 1);
  printf("  %s", err);
  assert_non_null(strstr(err, "--device cuda: no CUDA device"));
  free(err);
}

/* A worker killed mid-step: the others must fail within the heartbeat
 * timeout with a message naming what happened, and nothing may hang.
 * The slack over the timeout: 1 s. Under the sanitizers the survivors'
 * way out of the abort is slow whatever the leak check (3.1 s in all
 * alone, 2.9 s with detect_leaks=0, against 45 ms optimized) and slower
 * beside the suite's other tests (7.85 s seen in a clean-clone run):
 * there the bound only says that nothing hangs. */
#if defined(__SANITIZE_ADDRESS__)
#define KILL_SLACK_S 10.0
#else
#define KILL_SLACK_S 1.0
#endif

static void test_killed_worker(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  const char *cflags[] = {"--wrap-type", "Linear", "--heartbeat-timeout-ms",
                          "1000", NULL};
  const char *wflags[] = {"--steps", "100000000",         "--checkpoint",
                          "none",    "--comm-timeout-ms", "30000",
                          NULL};
  sp_tjob j;
  sp_tjob_start(&j, MLP, cflags, 3, wflags, dir);
  /* let them attach and train a while */
  sp_test_sleep_ms(1500);
  for (int r = 0; r < 3; r++) {
    int st;
    if (waitpid(j.w[r], &st, WNOHANG) == j.w[r])
      fail_msg("rank %d ended before the kill", r);
  }
  double t0 = sp_clock_s();
  kill(j.w[1], SIGKILL);
  int ok = sp_tjob_wait(&j, 10);
  double took = sp_clock_s() - t0;
  printf(
      "  rank 1 killed: the other ranks ended after %.0f ms (heartbeat "
      "timeout 1000 ms)\n",
      took * 1000);
  assert_int_equal(ok, 0);
  assert_int_equal(j.status[1], 128 + SIGKILL);
  for (int r = 0; r < 3; r += 2) {
    assert_int_equal(j.status[r], 1);
    char name[32];
    snprintf(name, sizeof name, "rank-%d.err", r);
    char *path = sp_test_path(dir, name);
    char *err = sp_test_read_file(path);
    printf("  rank %d: %s", r, err);
    char want[32];
    snprintf(want, sizeof want, "rank %d", r);
    assert_non_null(strstr(err, want));
    free(err);
    free(path);
  }
  assert_true(took < 1.0 + KILL_SLACK_S);
  sp_test_rmtree(dir);
  free(dir);
}

/* A spec the worker cannot compute (ResNet-50: convolutions, BatchNorm
 * kept in full precision under bf16 mixed precision) runs, with
 * --synthetic, the synthetic-gradient cycle: the same unshard / reduce /
 * cast schedule, and a FULL checkpoint with every FQN in its original
 * dtype. */
static void test_synthetic_resnet50(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  const char *cflags[] = {"--wrap-type", "Bottleneck", "--param-dtype",
                          "bfloat16", NULL};
  const char *wflags[] = {"--steps", "2",           "--checkpoint-dir",
                          dir,       "--synthetic", NULL};
  sp_tjob_run(SP_EXAMPLES "/models/resnet50.json", cflags, 2, wflags,
              JOB_TIMEOUT_S);
  sp_model *m;
  sp_diag d = {{0}};
  assert_int_equal(
      sp_model_load_file(SP_EXAMPLES "/models/resnet50.json", &m, &d), 0);
  sp_safetensors_file *full = sp_tjob_open_st(dir, "full/model.safetensors");
  size_t want = m->n_params;
  for (size_t b = 0; b < m->n_buffers; b++) want += m->buffers[b].flag;
  assert_int_equal(sp_safetensors_tensor_count(full), want);
  for (size_t p = 0; p < m->n_params; p++) {
    const sp_safetensors_tensor *t =
        sp_safetensors_find(full, m->params[p].fqn);
    assert_non_null(t);
    assert_int_equal(t->dtype, m->params[p].dtype);
    assert_int_equal(t->numel, m->params[p].numel);
  }
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_safetensors_tensor *t =
        sp_safetensors_find(full, m->buffers[b].fqn);
    if (!m->buffers[b].flag) {
      assert_null(t);
      continue;
    }
    assert_non_null(t);
    assert_int_equal(t->dtype, m->buffers[b].dtype);
  }
  printf(
      "  resnet50, 2 ranks, synthetic gradients: %zu tensors in the FULL "
      "checkpoint, each in its original dtype\n",
      want);
  sp_safetensors_close(full);
  sp_model_free(m);
  sp_test_rmtree(dir);
  free(dir);
}

/* A spec that is neither a GPT-2 nor a sequential MLP (examples/mlp.json
 * with a bias of the wrong shape) is refused by every worker without
 * --synthetic, before the rendezvous: exit 1, naming why and the flag;
 * nothing is trained and no checkpoint written. */
static void test_untrainable_spec_refused(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  json_error_t je;
  json_t *m = json_load_file(MLP, 0, &je);
  assert_non_null(m);
  size_t i;
  json_t *p;
  json_array_foreach(json_object_get(m, "params"), i, p) {
    if (strcmp(json_string_value(json_object_get(p, "fqn")), "layers.0.bias") ==
        0)
      json_array_set_new(json_object_get(p, "shape"), 0, json_integer(65));
  }
  char *spec = sp_test_path(dir, "broken.json");
  assert_int_equal(json_dump_file(m, spec, 0), 0);
  json_decref(m);
  char *ck = sp_test_path(dir, "ck");
  const char *cflags[] = {"--wrap-type", "Linear", NULL};
  const char *wflags[] = {"--steps", "2", "--checkpoint-dir", ck, NULL};
  sp_tjob j;
  sp_tjob_start(&j, spec, cflags, 2, wflags, dir);
  assert_int_equal(sp_tjob_wait(&j, JOB_TIMEOUT_S), 0);
  for (int r = 0; r < 2; r++) {
    assert_int_equal(j.status[r], 1);
    char name[32];
    snprintf(name, sizeof name, "rank-%d.err", r);
    char *path = sp_test_path(dir, name);
    char *err = sp_test_read_file(path);
    if (r == 0) printf("  %s", err);
    assert_non_null(
        strstr(err, "not a sequential MLP: Linear \"layers.0\": bias shape"));
    assert_non_null(strstr(err, "--synthetic"));
    free(err);
    free(path);
  }
  assert_int_equal(access(ck, F_OK), -1);
  free(ck);
  free(spec);
  sp_test_rmtree(dir);
  free(dir);
}

/* --stats memory: what rank 0's runtime counted in a real job equals the
 * memory model's prediction for the coordinator's plan, category by
 * category, and the second step allocated nothing; its RSS grew. The MLP
 * trains for real (its trainer leaves the root's layers to the root unit);
 * ResNet-50 (the synthetic cycle, `synthetic`) has units of many sizes and
 * full-precision BatchNorm units under bfloat16. */
static void check_memory_stats(const char *model, const char *const *cflags,
                               int n, bool synthetic, bool ckpt,
                               const char *label) {
  char *dir = sp_test_mkdtemp();
  char *stats = sp_test_path(dir, "stats.json");
  /* SGD without clipping (the GPT-2 specs' defaults are AdamW and
   * clipping, whose per-unit norms the runtime counts too): no optimizer
   * state, as the model's default options */
  const char *wflags[16] = {"--steps", "2",       "--checkpoint",
                            "none",    "--stats", stats};
  size_t nw = 6;
  if (synthetic) wflags[nw++] = "--synthetic";
  if (!synthetic) {
    wflags[nw++] = "--optimizer";
    wflags[nw++] = "sgd";
    wflags[nw++] = "--clip-grad-norm";
    wflags[nw++] = "0";
  }
  if (ckpt) wflags[nw++] = "--activation-checkpointing";
  sp_tjob_run(model, cflags, n, wflags, JOB_TIMEOUT_S);
  sp_model *m;
  sp_plan *pl;
  sp_job job;
  sp_job_init(&job);
  sp_diag d = {{0}};
  char ws[16];
  snprintf(ws, sizeof ws, "%d", n);
  assert_int_equal(sp_model_load_file(model, &m, &d), 0);
  assert_int_equal(sp_job_apply_flag(&job, "world-size", ws, &d), 0);
  for (size_t i = 0; cflags[i]; i += 2)
    assert_int_equal(sp_job_apply_flag(&job, cflags[i] + 2, cflags[i + 1], &d),
                     0);
  assert_int_equal(sp_plan_build(m, &job, &pl, &d), 0);
  sp_mem_estimate e;
  assert_int_equal(sp_mem_estimate_plan(pl, NULL, &e, &d), 0);
  json_error_t je;
  json_t *root = json_load_file(stats, 0, &je);
  assert_non_null(root);
  json_t *mem = json_object_get(root, "memory");
  json_t *c = json_object_get(json_object_get(mem, "train"), "counted");
  assert_non_null(c);
  for (int k = 0; k < SP_MEM_N_CATS; k++) {
    json_t *cat = json_object_get(c, sp_mem_cat_name((sp_mem_cat)k));
    uint64_t got = (uint64_t)json_integer_value(json_object_get(cat, "peak"));
    if (got != e.acct.cat[k].peak)
      fail_msg("%s: %s peak %llu bytes, the model says %llu", label,
               sp_mem_cat_label((sp_mem_cat)k), (unsigned long long)got,
               (unsigned long long)e.acct.cat[k].peak);
  }
  uint64_t reserved = (uint64_t)json_integer_value(
      json_object_get(json_object_get(c, "reserved"), "peak"));
  uint64_t total = (uint64_t)json_integer_value(
      json_object_get(json_object_get(c, "total"), "peak"));
  assert_int_equal(reserved, e.acct.reserved.peak);
  assert_int_equal(total, e.acct.total.peak);
  assert_int_equal(
      json_integer_value(json_object_get(c, "allocs")),
      json_integer_value(json_object_get(mem, "allocs_after_first_step")));
  json_int_t before = json_integer_value(json_object_get(mem, "rss_before"));
  json_int_t hwm = json_integer_value(
      json_object_get(json_object_get(mem, "train"), "rss_hwm"));
  assert_true(before > 0 && hwm > before);
  /* the trainer's activations, as the worker's flags lay them out: what
   * the memory model predicts for the job, category by category */
  sp_train_flags tf;
  sp_train_flags_init(&tf);
  tf.checkpointing = ckpt;
  sp_mem_opts mo;
  sp_train_shape sh;
  sp_train_mem tm;
  sp_mlp_train_cfg cfg;
  sp_mlp_train_cfg_init(&cfg, 2, 24, 0.05);
  sp_train_mem_job(&cfg, &tf, false, &mo, &sh);
  if (sp_train_mem_predict(pl, &mo, &sh, &tm, &d) != 0) fail_msg("%s", d.msg);
  json_t *acts = json_object_get(mem, "activations_by_category");
  for (int k = 0; k < SP_ACT_N_CATS; k++) {
    uint64_t got = (uint64_t)json_integer_value(
        json_object_get(acts, sp_act_cat_name((sp_act_cat)k)));
    if (got != (synthetic ? 0 : tm.act.cat[k]))
      fail_msg("%s: %s %llu bytes, the model says %llu", label,
               sp_act_cat_label((sp_act_cat)k), (unsigned long long)got,
               (unsigned long long)tm.act.cat[k]);
  }
  assert_int_equal(tm.runtime.acct.reserved.peak, reserved);
  printf(
      "  %s, %d ranks: counted = predicted, peak %llu bytes in use, %llu "
      "reserved; RSS grew %.1f MiB\n",
      label, n, (unsigned long long)total, (unsigned long long)reserved,
      (double)(hwm - before) / (1024.0 * 1024.0));
  json_decref(root);
  sp_plan_free(pl);
  sp_job_clear(&job);
  sp_model_free(m);
  sp_test_rmtree(dir);
  free(stats);
  free(dir);
}

static void test_memory_stats(void **state) {
  (void)state;
  const char *mlp[] = {
      "--wrap-type",   "Linear",   "--strategy", "SHARD_GRAD_OP",
      "--param-dtype", "bfloat16", NULL};
  check_memory_stats(MLP, mlp, 3, false, false, "mlp SHARD_GRAD_OP bfloat16");
  const char *resnet[] = {"--wrap-type", "Bottleneck",     "--param-dtype",
                          "bfloat16",    "--reduce-dtype", "float32",
                          NULL};
  check_memory_stats(SP_EXAMPLES "/models/resnet50.json", resnet, 2, true,
                     false, "resnet50 FULL_SHARD bfloat16/float32");
}

/* The GPT-2 trainer's memory against the model for every strategy, W = 1
 * to 4, with and without activation checkpointing, float32 and bfloat16
 * parameters: the runtime's counted bytes and the trainer's activations by
 * category equal the prediction (56 jobs of gpt2-tiny; HYBRID_SHARD with
 * shard groups of 2 at even W; W = 1 is NO_SHARD whatever is asked, as
 * FSDP does). */
/* Under the sanitizers each job costs seconds: there the pairs float32
 * without checkpointing and bfloat16 with it (28 jobs), which still
 * exercise both layouts and both dtypes under ASan. */
#if defined(__SANITIZE_ADDRESS__)
#define MEM_CASE_STEP 3
#else
#define MEM_CASE_STEP 1
#endif

static void test_train_memory_gpt2(void **state) {
  (void)state;
  static const char *const strategies[] = {"FULL_SHARD", "SHARD_GRAD_OP",
                                           "NO_SHARD", "HYBRID_SHARD"};
  for (int s = 0; s < 4; s++)
    for (int w = 1; w <= 4; w++)
      for (int k = 0; k < 4; k += MEM_CASE_STEP) {
        int ckpt = k / 2, bf16 = k % 2;
        const char *st = strategies[s];
        if (!strcmp(st, "HYBRID_SHARD") && w % 2 != 0) continue;
        const char *flags[9] = {"--wrap-type", "GPT2Block", "--strategy", st};
        size_t nf = 4;
        if (!strcmp(st, "HYBRID_SHARD")) {
          flags[nf++] = "--shard-group-size";
          flags[nf++] = "2";
        }
        if (bf16) {
          flags[nf++] = "--param-dtype";
          flags[nf++] = "bfloat16";
        }
        char label[96];
        snprintf(label, sizeof label, "gpt2-tiny %s %s%s", st,
                 bf16 ? "bfloat16" : "float32", ckpt ? " checkpointing" : "");
        check_memory_stats(SP_EXAMPLES "/models/gpt2-tiny.json", flags, w,
                           false, ckpt, label);
      }
}

int main(int argc, char **argv) {
  /* one test by name: test_worker test_parity_optim */
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parity),
      cmocka_unit_test(test_parity_optim),
      cmocka_unit_test(test_parity_optim_20_steps),
      cmocka_unit_test(test_buffers_and_checkpoints),
      cmocka_unit_test(test_checkpoint_reload),
      cmocka_unit_test(test_staged_storage),
      cmocka_unit_test(test_device_errors),
      cmocka_unit_test(test_killed_worker),
      cmocka_unit_test(test_synthetic_resnet50),
      cmocka_unit_test(test_untrainable_spec_refused),
      cmocka_unit_test(test_memory_stats),
      cmocka_unit_test(test_train_memory_gpt2),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
