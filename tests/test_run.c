/* `shardplane run`, the README's main-job command, as a user runs it: a
 * whole job to its checkpoint, the training flags passed to the workers,
 * bad usage, a worker killed mid-run (and, with --max-restarts, the job
 * restarted from its last checkpoint), Ctrl-C.
 */
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "base/clock.h"
#include "plan/model.h"
#include "base/proc.h"
#include "lib/shardplane.h"
#include "rpc/rpc.h"
#include "support/job_fixture.h"
#include "support/mlp_reference.h"
#include "support/testutil.h"
#include "worker/mlp.h"
#include "worker/train_flags.h"

extern char **environ;

#define SHARDPLANE SP_BIN_DIR "/shardplane"
#define MLP SP_EXAMPLES "/mlp.json"
#define GPT2_TINY SP_EXAMPLES "/models/gpt2-tiny.json"

/* Starts argv (NULL-terminated) with stdout and stderr in dir/out,
 * dir/err. */
static pid_t start_cmd(const char *dir, char *const *argv) {
  char *out = sp_test_path(dir, "out"), *err = sp_test_path(dir, "err");
  pid_t pid = sp_test_spawn_logged(out, err, argv);
  free(out);
  free(err);
  return pid;
}

/* Starts `shardplane run ARGS` with stdout and stderr in dir/out, dir/err. */
static pid_t start_run(const char *dir, const char *const *args) {
  char *argv[64];
  size_t k = 0;
  argv[k++] = SHARDPLANE;
  argv[k++] = "run";
  for (size_t i = 0; args[i]; i++) argv[k++] = (char *)args[i];
  argv[k] = NULL;
  return start_cmd(dir, argv);
}

/* Exit status (128 + signal when killed), or -1 after timeout_s (then the
 * run is killed). */
static int wait_run(pid_t pid, double timeout_s) {
  return sp_test_wait_exit(pid, timeout_s);
}

static char *slurp(const char *dir, const char *name) {
  char *path = sp_test_path(dir, name);
  char *s = sp_test_read_file(path);
  free(path);
  return s;
}

/* Waits until dir/name contains needle. */
static void wait_for_output(const char *dir, const char *name,
                            const char *needle, double timeout_s) {
  double end = sp_clock_s() + timeout_s;
  while (sp_clock_s() < end) {
    char *s = slurp(dir, name);
    bool found = strstr(s, needle) != NULL;
    free(s);
    if (found) return;
    usleep(20000);
  }
  fail_msg("no \"%s\" in %s within %.0f s", needle, name, timeout_s);
}

/* The worker processes `run` started: children of parent, by rank. */
static int find_workers(pid_t parent, pid_t *pids, int cap) {
  int n = 0, kids[256];
  size_t nk = sp_test_children(parent, kids, 256);
  for (size_t k = 0; k < nk; k++) {
    char buf[4096];
    long len = sp_test_proc_file(kids[k], "cmdline", buf, sizeof buf);
    if (len < 0) continue;
    /* by its program, not its name in stat: the worker names its
     * training thread, the main one */
    size_t n0 = strlen(buf);
    if (n0 < 17 || strcmp(buf + n0 - 17, "shardplane-worker") != 0) continue;
    for (long i = 0; i + 7 < len; i++)
      if (strcmp(buf + i, "--rank") == 0) {
        int r = atoi(buf + i + 7);
        if (r >= 0 && r < cap) {
          pids[r] = kids[k];
          n++;
        }
        break;
      }
  }
  return n;
}

static bool alive(pid_t pid) { return kill(pid, 0) == 0; }

/* Whether every line of a run's output is whole and says who wrote it:
 * run's own ("shardplane run: ..."), a worker's, prefixed with the time
 * and the rank ("12:03:04.567 [rank1]: ..."), or the coordinator's alert
 * ("12:03:04.567 [alert]: LOST: ..."). Prints the first that is not. */
static bool every_line_attributed(const char *text) {
  for (const char *l = text; *l;) {
    size_t n = strcspn(l, "\n");
    int h, m, sec, ms, rank, end = 0, alert = 0;
    sscanf(l, "%2d:%2d:%2d.%3d [alert]: %n", &h, &m, &sec, &ms, &alert);
    bool ok = strncmp(l, "shardplane run: ", 16) == 0 ||
              (alert > 0 && (size_t)alert <= n) ||
              (sscanf(l, "%2d:%2d:%2d.%3d [rank%d]: %n", &h, &m, &sec, &ms,
                      &rank, &end) == 5 &&
               end > 0 && (size_t)end <= n);
    if (!ok) {
      printf("  not attributed: \"%.*s\"\n", (int)n, l);
      return false;
    }
    l += n + (l[n] == '\n');
  }
  return true;
}

static void test_run_to_checkpoint(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  const char *args[] = {"--nproc",          "2", "--model", MLP, "--steps", "3",
                        "--checkpoint-dir", ck,  NULL};
  int st = wait_run(start_run(dir, args), 120);
  char *out = slurp(dir, "out"), *err = slurp(dir, "err");
  printf("%s%s", out, err);
  assert_int_equal(st, 0);
  assert_non_null(strstr(out, "[rank0]: step 3/3"));
  assert_non_null(strstr(out, "loss"));
  assert_true(every_line_attributed(out));
  assert_non_null(strstr(out, "checkpoint in"));
  assert_non_null(strstr(out, ck));
  assert_null(strstr(out, "--generate")); /* the MLP makes no text */
  char *model = sp_test_path(ck, "full/model.safetensors");
  struct stat sb;
  assert_int_equal(stat(model, &sb), 0);
  assert_true(sb.st_size > 0);
  free(model);
  free(out);
  free(err);
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* A GPT-2 run's last line is the command that samples text from its
 * checkpoint, and it works; --temperature 0 samples greedily (the same
 * text whatever the seed), and the flag's errors say so. */
static void test_run_gpt2_says_how_to_sample(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  const char *model = SP_EXAMPLES "/models/gpt2-tiny.json";
  const char *args[] = {"--nproc",     "2",         "--model",          model,
                        "--wrap-type", "GPT2Block", "--steps",          "3",
                        "--log-every", "0",         "--checkpoint-dir", ck,
                        NULL};
  int st = wait_run(start_run(dir, args), 120);
  char *out = slurp(dir, "out"), *err = slurp(dir, "err");
  printf("%s%s", out, err);
  assert_int_equal(st, 0);
  char want[4096];
  snprintf(want, sizeof want,
           "shardplane run: sample text from it with "
           "shardplane-worker --generate --load %s/full --model %s --prompt "
           "\"The \" --tokens 300\n",
           ck, model);
  const char *at = strstr(out, want);
  assert_non_null(at);
  assert_int_equal(at[strlen(want)], '\0'); /* the last line */
  free(out);
  free(err);
  char load[1024], *text[2] = {NULL, NULL};
  snprintf(load, sizeof load, "%s/full", ck);
  for (int i = 0; i < 2; i++) {
    char *gen[] = {SP_BIN_DIR "/shardplane-worker",
                   "--generate",
                   "--load",
                   load,
                   "--model",
                   (char *)model,
                   "--prompt",
                   "The ",
                   "--tokens",
                   "20",
                   "--temperature",
                   "0",
                   "--seed",
                   i ? "7" : "0",
                   NULL};
    assert_int_equal(sp_test_wait_exit(start_cmd(dir, gen), 60), 0);
    text[i] = slurp(dir, "out");
    assert_int_equal(strncmp(text[i], "The ", 4), 0);
    assert_int_equal(strlen(text[i]), 4 + 20 + 1);
  }
  assert_string_equal(text[0], text[1]);
  free(text[0]);
  free(text[1]);
  char *bad[] = {SP_BIN_DIR "/shardplane-worker",
                 "--generate",
                 "--load",
                 load,
                 "--model",
                 (char *)model,
                 "--temperature",
                 "-1",
                 NULL};
  assert_int_equal(sp_test_wait_exit(start_cmd(dir, bad), 60), 2);
  err = slurp(dir, "err");
  assert_string_equal(err,
                      "shardplane-worker: --temperature \"-1\": expected "
                      "a finite number >= 0 (0: greedy)\n");
  free(err);
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* A GPT-2 trains on its spec's defaults alone: without --wrap-type the
 * spec's no_split_modules make its blocks the units (the tools' default
 * before, every Linear, made lm_head one and every GPT-2 run failed at
 * once: "transformer.wte.weight: in unit 1 (lm_head), which is not its
 * block"), and without --lr or --optimizer its "training" recipe (AdamW
 * at 6e-4, warmup and cosine, clipping) trains, the loss falling. */
static void test_run_gpt2_spec_defaults(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  enum { STEPS = 30 };
  const char *args[] = {
      "--nproc",      "2", "--model",      GPT2_TINY, "--steps", "30",
      "--eval-every", "0", "--checkpoint", "none",    NULL};
  int st = wait_run(start_run(dir, args), 180);
  char *out = slurp(dir, "out"), *err = slurp(dir, "err");
  printf("%s%s", out, err);
  assert_null(strstr(err, "which is not its block"));
  assert_int_equal(st, 0);
  /* rank 0 says what the spec chose, as the flags that change it */
  assert_non_null(strstr(out,
                         "[rank0]: rank 0: from the training defaults of "
                         "gpt2-tiny: --optimizer adamw --lr 0.0006 "
                         "--weight-decay 0.1 --betas 0.9,0.95 --eps 1e-08 "
                         "--lr-schedule cosine --warmup-steps 2 --min-lr "
                         "6e-05 --clip-grad-norm 1\n"));
  double loss[STEPS];
  for (int i = 0; i < STEPS; i++) {
    char want[64];
    snprintf(want, sizeof want, "step %d/%d  loss ", i + 1, STEPS);
    const char *at = strstr(out, want);
    if (at == NULL) fail_msg("no \"%s\" in the run's output", want);
    loss[i] = strtod(at + strlen(want), NULL);
  }
  double first = (loss[0] + loss[1] + loss[2]) / 3;
  double last = (loss[STEPS - 3] + loss[STEPS - 2] + loss[STEPS - 1]) / 3;
  printf("  loss %.4f at the start, %.4f at the end\n", first, last);
  assert_true(last < first - 0.5);
  free(out);
  free(err);
  sp_test_rmtree(dir);
  free(dir);
}

/* --checkpoint-dir naming a file is bad usage named by its flag before
 * anything starts; a failure inside the directory later names the flag
 * too (the coordinator's state dir, where a file is in the way). */
static void test_run_checkpoint_dir_not_a_directory(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *file = sp_test_path(dir, "afile");
  sp_test_write_file(file, "x", 1);
  const char *args[] = {"--nproc",          "2",  "--model", MLP,
                        "--checkpoint-dir", file, NULL};
  assert_int_equal(wait_run(start_run(dir, args), 60), 2);
  char *out = slurp(dir, "out"), *err = slurp(dir, "err");
  printf("%s%s", out, err);
  char want[2048];
  snprintf(want, sizeof want,
           "shardplane run: --checkpoint-dir \"%s\": "
           "expected a directory: it is a file\n",
           file);
  assert_string_equal(err, want);
  assert_string_equal(out, ""); /* no coordinator, no worker */
  free(out);
  free(err);

  char *ck = sp_test_path(dir, "ck");
  assert_int_equal(mkdir(ck, 0700), 0);
  char *in_the_way = sp_test_path(ck, "coordinator-state");
  sp_test_write_file(in_the_way, "x", 1);
  const char *later[] = {"--nproc",          "2", "--model", MLP,
                         "--checkpoint-dir", ck,  NULL};
  assert_int_equal(wait_run(start_run(dir, later), 60), 1);
  err = slurp(dir, "err");
  printf("%s", err);
  snprintf(want, sizeof want, " in --checkpoint-dir %s: ", ck);
  assert_non_null(strstr(err, want));
  free(err);
  free(in_the_way);
  free(ck);
  free(file);
  sp_test_rmtree(dir);
  free(dir);
}

/* A checkpoint of one optimizer resumed with another: refused, naming
 * the state and the flag that loads anyway; with --load-params-only the
 * job continues after the checkpoint's step with a fresh optimizer. */
static void test_run_load_params_only(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  const char *sgd[] = {"--nproc",          "2", "--model", MLP, "--steps", "3",
                       "--checkpoint-dir", ck,  NULL};
  assert_int_equal(wait_run(start_run(dir, sgd), 120), 0);
  const char *adamw[] = {"--nproc",      "2",     "--model", MLP,
                         "--steps",      "5",     "--load",  ck,
                         "--optimizer",  "adamw", "--lr",    "0.001",
                         "--checkpoint", "none",  NULL,      NULL};
  const size_t last = sizeof adamw / sizeof adamw[0] - 2;
  assert_int_equal(wait_run(start_run(dir, adamw), 120), 1);
  char *err = slurp(dir, "err");
  printf("%s", err);
  assert_non_null(strstr(err, "optimizer state \"exp_avg\""));
  assert_non_null(strstr(err, "--load-params-only"));
  free(err);
  char *out;
  adamw[last] = "--load-params-only";
  assert_int_equal(wait_run(start_run(dir, adamw), 120), 0);
  out = slurp(dir, "out");
  printf("%s", out);
  assert_non_null(strstr(out, "resuming after step 3 of 5"));
  assert_non_null(strstr(out, "[rank0]: step 5/5"));
  assert_null(strstr(out, "[rank0]: step 3/5"));
  free(out);
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* The training flags reach every worker: a run with AdamW, warmup-cosine,
 * clipping and no_sync accumulation prints the loss curve the unsharded
 * reference run of the same settings has (and not SGD's). */
static void test_run_training_flags(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  const char *train[] = {"--optimizer",   "adamw",  "--weight-decay",   "0.1",
                         "--lr-schedule", "cosine", "--warmup-steps",   "1",
                         "--min-lr",      "0.001",  "--clip-grad-norm", "1",
                         "--grad-accum",  "2",      "--no-sync",        NULL};
  const char *args[64] = {"--nproc",      "2",   "--model", MLP,
                          "--steps",      "4",   "--lr",    "0.01",
                          "--checkpoint", "none"};
  size_t k = 10;
  for (size_t i = 0; train[i]; i++) args[k++] = train[i];
  args[k] = NULL;
  int st = wait_run(start_run(dir, args), 120);
  char *out = slurp(dir, "out"), *err = slurp(dir, "err");
  printf("%s%s", out, err);
  assert_int_equal(st, 0);
  /* the reference run of the same flags, through the worker's parser */
  struct option opts[64];
  size_t n = sp_train_options(opts, 64);
  sp_train_flags t;
  sp_train_flags_init(&t);
  sp_diag d = {{0}};
  for (size_t i = 0; train[i]; i++)
    for (size_t o = 0; strncmp(train[i], "--", 2) == 0 && o < n; o++)
      if (strcmp(train[i] + 2, opts[o].name) == 0)
        assert_int_equal(
            sp_train_flag(&t, opts[o].val,
                          opts[o].has_arg ? train[i + 1] : NULL, &d),
            0);
  sp_mlp_train_cfg cfg;
  assert_int_equal(
      sp_train_flags_finish(&t, 4, 0.01, 24, 2, "--nproc", &cfg, &d), 0);
  sp_model *m;
  assert_int_equal(sp_model_load_file(MLP, &m, &d), 0);
  sp_job job;
  sp_job_init(&job);
  sp_strlist_add(&job.wrap_types, "Linear");
  double losses[4];
  assert_int_equal(
      sp_mlp_reference_train(m, &job, &cfg, losses, NULL, NULL, &d), 0);
  for (int s = 0; s < 4; s++) {
    char want[64];
    snprintf(want, sizeof want, "step %d/4  loss %.6f", s + 1, losses[s]);
    if (!strstr(out, want)) fail_msg("no \"%s\" in the run's output", want);
  }
  printf(
      "  the run's loss curve is the reference's with the same training "
      "flags\n");
  sp_job_clear(&job);
  sp_model_free(m);
  free(out);
  free(err);
  sp_test_rmtree(dir);
  free(dir);
}

static void test_run_bad_usage(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  struct {
    const char *args[8];
    int status;
    const char *msg;
  } cases[] = {
      {{"--nproc", "2", NULL}, 2, "--model is required"},
      {{"--model", MLP, NULL}, 2, "--nproc is required"},
      {{"--nproc", "0", "--model", MLP, NULL}, 2, "--nproc"},
      {{"--nproc", "2", "--model", "/nonexistent/m.json", NULL},
       1,
       "/nonexistent/m.json"},
      {{"--nproc", "2", "--model", MLP, "--strategy", "SIDEWAYS", NULL},
       2,
       "SIDEWAYS"},
      {{"--nproc", "2", "--model", MLP, "--wrap-module", "no.such", NULL},
       2,
       "no.such"},
      /* faults are checked before a worker starts, as they will check them */
      {{"--nproc", "2", "--model", MLP, "--inject", "bogus", NULL},
       2,
       "--inject \"bogus\": expected KIND:KEY=VALUE"},
      {{"--nproc", "2", "--model", MLP, "--inject", "stall:rank=5,step=2",
        NULL},
       2,
       "rank 5 is not one of the job's 2 ranks"},
      {{"--nproc", "2", "--model", MLP, "--stop-grace", "0", NULL},
       2,
       "--stop-grace \"0\""},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int st = wait_run(start_run(dir, cases[i].args), 30);
    char *err = slurp(dir, "err");
    printf("  exit %d: %s", st, err);
    assert_int_equal(st, cases[i].status);
    assert_non_null(strstr(err, cases[i].msg));
    free(err);
  }
  const char *help[] = {"--help", NULL};
  assert_int_equal(wait_run(start_run(dir, help), 30), 0);
  char *out = slurp(dir, "out");
  assert_non_null(strstr(out, "--nproc"));
  free(out);
  sp_test_rmtree(dir);
  free(dir);
}

/* A copy of the spec `from` in dir/name with parameter fqn's dimension
 * `dim` set to `size`; the caller frees the path. */
static char *spec_with_shape(const char *dir, const char *name,
                             const char *from, const char *fqn, size_t dim,
                             json_int_t size) {
  json_error_t je;
  json_t *m = json_load_file(from, 0, &je);
  assert_non_null(m);
  size_t i;
  json_t *p;
  bool found = false;
  json_array_foreach(json_object_get(m, "params"), i, p) {
    if (strcmp(json_string_value(json_object_get(p, "fqn")), fqn) != 0)
      continue;
    json_array_set_new(json_object_get(p, "shape"), dim, json_integer(size));
    found = true;
  }
  assert_true(found);
  char *path = sp_test_path(dir, name);
  assert_int_equal(json_dump_file(m, path, 0), 0);
  json_decref(m);
  return path;
}

/* Whether the run started nothing: no coordinator, no worker line. */
static void assert_nothing_started(const char *dir) {
  char *out = slurp(dir, "out"), *err = slurp(dir, "err");
  if (strstr(out, "[rank") || strstr(err, "[rank") ||
      strstr(out, "coordinator on") || strstr(err, "coordinator on"))
    fail_msg("the run started processes:\n%s%s", out, err);
  free(out);
  free(err);
}

/* A spec the workers cannot train (an MLP with one bias of the wrong
 * shape) is refused before any process starts, exit 1 (a bad spec),
 * naming why and --synthetic; with --synthetic the workers run the
 * synthetic-gradient cycle on it. */
static void test_run_untrainable_spec(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *spec = spec_with_shape(dir, "broken.json", MLP, "layers.0.bias", 0, 65);
  const char *args[] = {"--nproc",      "2",    "--model", spec, "--steps", "2",
                        "--checkpoint", "none", NULL,      NULL};
  double t0 = sp_clock_s();
  assert_int_equal(wait_run(start_run(dir, args), 30), 1);
  double took = sp_clock_s() - t0;
  char *err = slurp(dir, "err");
  printf("  refused in %.2f s: %s", took, err);
  assert_true(took < 10.0);
  assert_non_null(
      strstr(err, "not a sequential MLP: Linear \"layers.0\": bias shape"));
  assert_non_null(strstr(err, "--synthetic"));
  assert_non_null(strstr(err, spec));
  free(err);
  assert_nothing_started(dir);
  args[8] = "--synthetic";
  assert_int_equal(wait_run(start_run(dir, args), 60), 0);
  char *out = slurp(dir, "out");
  assert_non_null(strstr(out, "step 2/2"));
  assert_non_null(strstr(out, "(synthetic gradients)"));
  free(out);
  free(spec);
  sp_test_rmtree(dir);
  free(dir);
}

/* A job the memory model says cannot fit is refused before anything
 * starts, in well under 2 s, with the need per rank by category, what is
 * available and the flags that lower it (the default GPT-2 124M job of 24
 * x 1024 tokens on a 24 GiB machine was an OOM kill minutes in). 256 ranks
 * of one 1024-token sequence need some 470 GiB: no test machine has it. */
static void test_run_refused_for_memory(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  const char *args[] = {"--nproc",
                        "256",
                        "--model",
                        SP_EXAMPLES "/models/gpt2.json",
                        "--wrap-type",
                        "GPT2Block",
                        "--global-batch",
                        "256",
                        "--checkpoint",
                        "none",
                        NULL};
  double t0 = sp_clock_s();
  assert_int_equal(wait_run(start_run(dir, args), 30), 2);
  double took = sp_clock_s() - t0;
  char *err = slurp(dir, "err");
  printf("  refused in %.3f s: %s", took, err);
  assert_true(took < 2.0);
  const char *want[] = {"256 ranks x",
                        "saved activations",
                        "logits",
                        "runtime",
                        "1 x 1024 tokens",
                        "is available",
                        "--grad-accum",
                        "--seq-len",
                        "--activation-checkpointing",
                        "--param-dtype bfloat16",
                        "--nproc",
                        "--no-memory-check"};
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    if (strstr(err, want[i]) == NULL)
      fail_msg("the refusal does not say \"%s\"", want[i]);
  free(err);
  assert_nothing_started(dir);
  sp_test_rmtree(dir);
  free(dir);
}

/* What the workers would refuse only after their rendezvous, though no
 * worker is needed to see it, is refused before anything starts: exit 2,
 * naming the flag that fixes it. */
static void test_run_checked_before_start(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  /* a GPT-2 of 128 tokens, and a text with a byte past them */
  char *small_vocab = spec_with_shape(dir, "vocab128.json", GPT2_TINY,
                                      "transformer.wte.weight", 0, 128);
  char *text = sp_test_path(dir, "text.bin");
  char bytes[400];
  memset(bytes, 'a', sizeof bytes);
  bytes[123] = (char)200;
  sp_test_write_file(text, bytes, sizeof bytes);
  struct {
    const char *args[16];
    const char *msg;
  } cases[] = {
      /* a wrap policy given wins over the spec's no_split_modules */
      {{"--model", GPT2_TINY, "--wrap-type", "Linear", NULL},
       "--wrap-type GPT2Block"},
      {{"--model", GPT2_TINY, "--wrap-type", "GPT2Block", "--global-batch", "3",
        NULL},
       "--global-batch \"3\": expected a multiple of --nproc 2"},
      {{"--model", GPT2_TINY, "--wrap-type", "GPT2Block", "--seq-len", "65",
        NULL},
       "--seq-len 65: at most the model's context, 64"},
      {{"--model", GPT2_TINY, "--wrap-type", "GPT2Block", "--data",
        "/nonexistent/corpus.txt", NULL},
       "--data /nonexistent/corpus.txt"},
      {{"--model", small_vocab, "--wrap-type", "GPT2Block", "--seq-len", "8",
        "--data", text, NULL},
       "byte 200 at offset 123 is outside the model's vocabulary of 128"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *args[24] = {"--nproc",      "2",   "--steps", "1",
                            "--checkpoint", "none"};
    size_t k = 6;
    for (size_t a = 0; cases[i].args[a]; a++) args[k++] = cases[i].args[a];
    args[k] = NULL;
    double t0 = sp_clock_s();
    int st = wait_run(start_run(dir, args), 30);
    double took = sp_clock_s() - t0;
    char *err = slurp(dir, "err");
    printf("  exit %d in %.2f s: %s", st, took, err);
    assert_int_equal(st, 2);
    assert_true(took < 10.0); /* nothing to wait for: no process started */
    if (strstr(err, cases[i].msg) == NULL)
      fail_msg("case %zu: no \"%s\" in \"%s\"", i, cases[i].msg, err);
    free(err);
    assert_nothing_started(dir);
  }
  free(text);
  free(small_vocab);
  sp_test_rmtree(dir);
  free(dir);
}

/* How soon a run ends once a worker died: the others must exit too.
 * Under AddressSanitizer the survivors' way out from the abort to their
 * last line takes about 2 s against 45 ms in the optimized build (2.57 s
 * in all alone, 3.94 s in a clean-clone run beside the suite's other
 * tests, and test_worker's like case 7.85 s): there the bound only says
 * that nothing hangs. The optimized build keeps 1 s. */
#if defined(__SANITIZE_ADDRESS__)
#define EXIT_BOUND_S 10.0
#else
#define EXIT_BOUND_S 1.0
#endif

/* A dead worker ends the run with a message naming the rank, and every
 * other process goes away. */
static void test_run_worker_killed(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  const char *args[] = {"--nproc",
                        "3",
                        "--model",
                        MLP,
                        "--steps",
                        "100000000",
                        "--heartbeat-timeout-ms",
                        "1000",
                        "--log-every",
                        "50",
                        "--checkpoint-dir",
                        ck,
                        NULL};
  pid_t run = start_run(dir, args);
  wait_for_output(dir, "out", "step 100/", 60);
  pid_t w[3] = {0};
  assert_int_equal(find_workers(run, w, 3), 3);
  double t0 = sp_clock_s();
  kill(w[1], SIGKILL);
  int st = wait_run(run, 10);
  double took = sp_clock_s() - t0;
  char *err = slurp(dir, "err");
  printf("  run ended %.0f ms after the kill, exit %d: %s", took * 1000, st,
         err);
  assert_int_equal(st, 1);
  assert_non_null(strstr(err, "rank 1 was killed by signal 9"));
  assert_true(took < EXIT_BOUND_S);
  /* the other ranks' errors show, each line whole and naming its rank */
  assert_non_null(strstr(err, "[rank0]: shardplane-worker: rank 0: "));
  assert_non_null(strstr(err, "[rank2]: shardplane-worker: rank 2: "));
  assert_true(every_line_attributed(err));
  for (int r = 0; r < 3; r++) assert_false(alive(w[r]));
  free(err);
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* cmd's stdout; fails the test unless cmd exits 0 */
static char *command_output(const char *cmd) {
  char *out;
  int st = sp_test_shell(cmd, &out);
  if (st != 0) fail_msg("%s: status %d: %s", cmd, st, out);
  return out;
}

/* `shardplane incarnations` asked, with the admin token, of the
 * coordinator whose address a running `shardplane run` printed in dir/out
 * (text, or JSON with --json as flags). */
static char *run_incarnations(const char *dir, const char *flags) {
  char *out = slurp(dir, "out");
  const char *at = strstr(out, "coordinator on ");
  const char *tok = strstr(out, "admin token in ");
  assert_non_null(at);
  assert_non_null(tok);
  char cmd[8192];
  snprintf(cmd, sizeof cmd,
           "%s incarnations --insecure --coordinator %.*s --token-file %.*s "
           "%s",
           SHARDPLANE, (int)strcspn(at + 15, "\n"), at + 15,
           (int)strcspn(tok + 15, " \n"), tok + 15, flags);
  free(out);
  return command_output(cmd);
}

/* A worker killed mid-training with --max-restarts 1: run names the rank
 * and the signal, the coordinator records that they ended incarnation 0,
 * every rank starts again from the last checkpoint the job wrote (its
 * step said), and the job ends with the parameters of an undisturbed run,
 * byte for byte (a resumed run continues bit-exactly). */
static void test_run_restart(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck"), *ref = sp_test_path(dir, "ref");
  /* rank 0 a straggler (4x its step), for time to kill mid-run; the
   * numbers do not change */
  const char *args[] = {"--nproc",
                        "2",
                        "--model",
                        MLP,
                        "--steps",
                        "12",
                        "--checkpoint-dir",
                        ck,
                        "--checkpoint-every",
                        "2",
                        "--inject",
                        "slow:rank=0,factor=4",
                        "--max-restarts",
                        "1",
                        "--ranks-every",
                        "0",
                        NULL};
  pid_t run = start_run(dir, args);
  wait_for_output(dir, "out", "checkpoint (FULL) of step 4:", 60);
  pid_t w[2] = {0};
  assert_int_equal(find_workers(run, w, 2), 2);
  assert_int_equal(kill(w[1], SIGKILL), 0);
  /* asked while incarnation 1 trains: run's coordinator ends with it */
  wait_for_output(dir, "err", "incarnation 1: starting the workers again", 30);
  char *table = run_incarnations(dir, "");
  char *js = run_incarnations(dir, "--json");
  int st = wait_run(run, 120);
  char *out = slurp(dir, "out"), *err = slurp(dir, "err");
  printf("%s", err);
  assert_int_equal(st, 0);
  assert_non_null(strstr(err,
                         "rank 1 was killed by signal 9 (Killed); "
                         "the coordinator decides on a restart"));
  assert_non_null(strstr(err,
                         "incarnation 0 ended (rank 1 was killed by "
                         "signal 9 (Killed))"));
  /* the step incarnation 1 starts from, said by run and by rank 0 */
  const char *loads = strstr(err, "incarnation 1 loads ");
  assert_non_null(loads);
  const char *after = strstr(loads, "after step ");
  assert_non_null(after);
  long k = atol(after + 11);
  assert_true(k >= 4 && k < 12);
  char want[96];
  snprintf(want, sizeof want, "[rank0]: resuming after step %ld of 12", k);
  assert_non_null(strstr(out, want));
  assert_non_null(strstr(out, "[rank0]: step 12/12"));
  assert_true(every_line_attributed(out));
  /* the operator's view of the same record, in words and in JSON */
  printf("%s%s\n", table, js);
  assert_non_null(strstr(table,
                         "incarnation 1 is current; 1 of 1 restart "
                         "used\n"));
  assert_non_null(strstr(table, "rank 1 was killed by signal 9 (Killed)"));
  assert_non_null(strstr(table, "running"));
  json_error_t je;
  json_t *li = json_loads(js, 0, &je);
  assert_non_null(li);
  json_int_t cur, restarts, maxr, rank, sig;
  int ended;
  json_t *incs;
  assert_int_equal(
      json_unpack(li, "{s:I,s:I,s:I,s:o}", "current", &cur, "restarts",
                  &restarts, "max_restarts", &maxr, "incarnations", &incs),
      0);
  assert_int_equal(cur, 1);
  assert_int_equal(restarts, 1);
  assert_int_equal(maxr, 1);
  assert_int_equal(json_array_size(incs), 2);
  assert_int_equal(json_unpack(json_array_get(incs, 0), "{s:b,s:I,s:I}",
                               "ended", &ended, "rank", &rank, "signal", &sig),
                   0);
  assert_true(ended);
  assert_int_equal(rank, 1);
  assert_int_equal(sig, SIGKILL);
  json_decref(li);
  free(table);
  free(js);
  free(out);
  free(err);

  const char *undisturbed[] = {
      "--nproc",          "2", "--model",       MLP, "--steps", "12",
      "--checkpoint-dir", ref, "--ranks-every", "0", NULL};
  assert_int_equal(wait_run(start_run(dir, undisturbed), 120), 0);
  char *fa = sp_test_path(ck, "full"), *fr = sp_test_path(ref, "full");
  sp_tjob_same_tensors(fa, "model.safetensors", fr, "model.safetensors");
  free(fa);
  free(fr);
  free(ck);
  free(ref);
  sp_test_rmtree(dir);
  free(dir);
}

/* Waits until dir/name holds needle n times. */
static void wait_for_count(const char *dir, const char *name,
                           const char *needle, int n, double timeout_s) {
  double end = sp_clock_s() + timeout_s;
  while (sp_clock_s() < end) {
    char *s = slurp(dir, name);
    int k = 0;
    for (const char *at = strstr(s, needle); at; at = strstr(at + 1, needle))
      k++;
    free(s);
    if (k >= n) return;
    usleep(20000);
  }
  fail_msg("no %d \"%s\" in %s within %.0f s", n, needle, name, timeout_s);
}

/* Restarts outlive a restart of run's coordinator (run registers again)
 * and, used up, end the job with exit 1, naming the rank and the signal.
 * A restart with no checkpoint the job wrote starts from step 0 and says
 * so, though the directory holds an earlier job's. */
static void test_run_restarts_used_up(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  const char *before[] = {
      "--nproc",          "2", "--model",       MLP, "--steps", "1",
      "--checkpoint-dir", ck,  "--ranks-every", "0", NULL};
  assert_int_equal(wait_run(start_run(dir, before), 120), 0);
  const char *args[] = {"--nproc",
                        "2",
                        "--model",
                        MLP,
                        "--steps",
                        "100000000",
                        "--log-every",
                        "10",
                        "--checkpoint-dir",
                        ck,
                        "--max-restarts",
                        "1",
                        "--ranks-every",
                        "0",
                        NULL};
  pid_t run = start_run(dir, args);
  /* rank 1 of incarnation 0, then rank 0 of incarnation 1, at step 10;
   * before the first, the coordinator (its pid is in its state dir's lock
   * file) */
  for (int inc = 0; inc < 2; inc++) {
    wait_for_count(dir, "out", "[rank0]: step 10/", inc + 1, 60);
    if (inc == 0) {
      char *lock = sp_test_path(ck, "coordinator-state/coordinator.lock");
      char *coord = sp_test_read_file(lock);
      assert_true(atol(coord) > 0);
      assert_int_equal(kill((pid_t)atol(coord), SIGKILL), 0);
      wait_for_output(dir, "err",
                      "registered again (node 0, incarnation "
                      "0)",
                      30);
      free(coord);
      free(lock);
    }
    pid_t w[2] = {0};
    assert_int_equal(find_workers(run, w, 2), 2);
    assert_int_equal(kill(w[1 - inc], SIGKILL), 0);
  }
  int st = wait_run(run, 30);
  char *out = slurp(dir, "out"), *err = slurp(dir, "err");
  printf("%s", err);
  assert_int_equal(st, 1);
  assert_non_null(strstr(err,
                         "incarnation 1 starts afresh from step 0: no "
                         "checkpoint written in "));
  assert_null(strstr(out, "resuming after step"));
  assert_non_null(strstr(err,
                         "the job ended: rank 0 was killed by signal 9 "
                         "(Killed); no restarts left (--max-restarts "
                         "1)"));
  free(out);
  free(err);
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* A rank that stalls: run passes --inject to the workers and the stall
 * settings to the coordinator, which aborts the job and writes its dump to
 * the run's dumps folder; run's exit message names rank 2 (not rank 0,
 * the first to exit, a victim), and analyze reads the dump and names
 * rank 2 too. Meanwhile run's lines on the ranks show them held at step 3. */
static void test_run_stall_named(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  const char *args[] = {"--nproc",
                        "3",
                        "--model",
                        MLP,
                        "--steps",
                        "1000",
                        "--inject",
                        "stall:rank=2,step=3",
                        "--stall-timeout-ms",
                        "2000",
                        "--on-stall",
                        "abort",
                        "--checkpoint",
                        "none",
                        "--checkpoint-dir",
                        ck,
                        "--ranks-every",
                        "0.5",
                        NULL};
  pid_t run = start_run(dir, args);
  int st = wait_run(run, 90);
  char *err = slurp(dir, "err");
  printf("  run exit %d:\n%s", st, err);
  assert_int_equal(st, 1);
  char *run_out = slurp(dir, "out");
  if (!strstr(run_out, "[ranks]: step 3: "))
    fail_msg("no line on the ranks held at step 3 in:\n%s", run_out);
  free(run_out);
  /* run's own line that stops the job */
  const char *line = strstr(err, "shardplane run: ");
  while (line && !strstr(line, "stopping the job"))
    line = strstr(line + 1, "shardplane run: ");
  assert_non_null(line);
  size_t n = strcspn(line, "\n");
  char *first = strndup(line, n);
  if (!strstr(first, "rank 2"))
    fail_msg("run's message does not name rank 2: \"%s\"", first);
  free(first);
  char *dumps = sp_test_path(ck, "dumps");
  char *dump = sp_test_first_file(dumps, ".json");
  if (!dump) fail_msg("no dump in %s", dumps);
  char *argv[] = {SHARDPLANE, "analyze", dump, NULL};
  pid_t a = start_cmd(dir, argv);
  int ast = wait_run(a, 30);
  char *out = slurp(dir, "out");
  printf("  analyze %s: exit %d\n%s", dump, ast, out);
  assert_int_equal(ast, 5);
  assert_non_null(strstr(out, "rank 2 did not"));
  free(out);
  free(dump);
  free(dumps);
  free(err);
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* The step count in a FULL checkpoint's metadata, or -1. */
static long ckpt_step(const char *ck) {
  char *path = sp_test_path(ck, "full/model.safetensors");
  FILE *fp = fopen(path, "rb");
  free(path);
  if (!fp) return -1;
  char buf[8192];
  size_t n = fread(buf, 1, sizeof buf - 1, fp);
  fclose(fp);
  buf[n] = '\0';
  char *at = n > 8 ? strstr(buf + 8, "\"shardplane.optim_steps\":\"") : NULL;
  return at ? atol(at + strlen("\"shardplane.optim_steps\":\"")) : -1;
}

/* Ctrl-C: run forwards it, every worker stops after the same step with a
 * checkpoint of it, run exits 130 naming the flags that continue; the
 * continued job starts after that step and trains up to --steps in all.
 * SIGTERM the same, with 143. */
static void test_run_interrupted(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  const int sigs[] = {SIGINT, SIGTERM};
  for (int i = 0; i < 2; i++) {
    const char *args[] = {"--nproc",          "2",         "--model",     MLP,
                          "--steps",          "100000000", "--log-every", "50",
                          "--checkpoint-dir", ck,          NULL};
    pid_t run = start_run(dir, args);
    wait_for_output(dir, "out", "step 50/", 60);
    pid_t w[2] = {0};
    assert_int_equal(find_workers(run, w, 2), 2);
    kill(run, sigs[i]);
    int st = wait_run(run, 30);
    char *err = slurp(dir, "err"), *out = slurp(dir, "out");
    printf("  exit %d: %s", st, err);
    assert_int_equal(st, 128 + sigs[i]);
    assert_non_null(strstr(err, "interrupted"));
    for (int r = 0; r < 2; r++) assert_false(alive(w[r]));
    long k = ckpt_step(ck);
    assert_true(k >= 50);
    char want[128];
    snprintf(want, sizeof want,
             "[rank0]: stopping after step %ld of "
             "100000000",
             k);
    assert_non_null(strstr(out, want));
    assert_non_null(strstr(out, "continue from it with --load"));
    free(err);
    free(out);
    /* --steps counts all steps: K + 3 trains three more */
    char total[32];
    snprintf(total, sizeof total, "%ld", k + 3);
    const char *more[] = {"--nproc",          "2",   "--model", MLP,
                          "--steps",          total, "--load",  ck,
                          "--checkpoint-dir", ck,    NULL};
    run = start_run(dir, more);
    assert_int_equal(wait_run(run, 60), 0);
    out = slurp(dir, "out");
    snprintf(want, sizeof want, "[rank0]: resuming after step %ld of %ld", k,
             k + 3);
    assert_non_null(strstr(out, want));
    snprintf(want, sizeof want, "step %ld/%ld", k + 1, k + 3);
    assert_non_null(strstr(out, want));
    snprintf(want, sizeof want, "step %ld/%ld", k, k + 3);
    assert_null(strstr(out, want));
    assert_int_equal(ckpt_step(ck), k + 3);
    printf(
        "  %s after step %ld: checkpoint there; --load %s --steps %ld "
        "trained steps %ld..%ld\n",
        strsignal(sigs[i]), k, "ck", k + 3, k + 1, k + 3);
    free(out);
    sp_test_rmtree(ck);
  }
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* Ctrl-C on a job with a stalled rank: the other ranks wait in a
 * collective on it, so none reaches the step boundary where they would
 * checkpoint. run ends within the default --stop-grace (10 s, not the
 * collective library's 60 s timeout), stops every rank, and its one last
 * line says no checkpoint was written and which ranks were stopped. */
static void test_run_interrupted_stalled(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  const char *args[] = {
      "--nproc",     "3",      "--model",          MLP,
      "--steps",     "100000", "--inject",         "stall:rank=1,step=5",
      "--log-every", "50",     "--checkpoint-dir", ck,
      NULL};
  pid_t run = start_run(dir, args);
  wait_for_output(dir, "err", "--inject stall: blocking", 60);
  pid_t w[3] = {0};
  assert_int_equal(find_workers(run, w, 3), 3);
  double t0 = sp_clock_s();
  kill(run, SIGINT);
  int st = wait_run(run, 40);
  double took = sp_clock_s() - t0;
  char *err = slurp(dir, "err"), *out = slurp(dir, "out");
  printf("  exit %d %.1f s after SIGINT:\n%s%s", st, took, err, out);
  assert_int_equal(st, 128 + SIGINT);
  assert_true(took < 10 + 3);
  for (int r = 0; r < 3; r++) assert_false(alive(w[r]));
  assert_non_null(strstr(err,
                         "ranks 0, 1, 2 have not reached a step "
                         "boundary within the 10 s of --stop-grace"));
  /* one last line, and it is true: no checkpoint, and why */
  const char *last = strstr(out, "shardplane run: stopped by SIGINT after ");
  assert_non_null(last);
  assert_non_null(strstr(last,
                         "without a checkpoint: ranks 0, 1, 2 had not "
                         "reached a step boundary"));
  assert_null(strstr(out, "checkpoint in"));
  assert_null(strstr(err, "no FULL checkpoint"));
  assert_int_equal(ckpt_step(ck), -1);
  free(err);
  free(out);
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* Under AddressSanitizer a gpt2-mini step takes about 10 s and, beside
 * another test, a rank's silences within one step scatter past the 3x
 * margin "still moving" allows over its earlier steps (a clean-clone run
 * saw a 5 s silence after a first step whose longest was under 1.7 s):
 * that build checks that the last line tells the truth either way, the
 * optimized one that the ranks are let reach their step boundary. */
#if defined(__SANITIZE_ADDRESS__)
#define CHECK_STILL_MOVING 0
#else
#define CHECK_STILL_MOVING 1
#endif

/* Ctrl-C in a step longer than --stop-grace (a GPT-2 of 6 blocks, about
 * 2 s a step here): the coordinator still hears from every rank, so the
 * ranks get past the grace to their step boundary and checkpoint there,
 * rather than being stopped mid-step without one. */
static void test_run_interrupted_long_step(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  const char *args[] = {"--nproc",
                        "2",
                        "--model",
                        SP_EXAMPLES "/models/gpt2-mini.json",
                        "--wrap-type",
                        "GPT2Block",
                        "--global-batch",
                        "16",
                        "--steps",
                        "1000",
                        "--stop-grace",
                        "0.5",
                        "--checkpoint-dir",
                        ck,
                        NULL};
  pid_t run = start_run(dir, args);
  wait_for_output(dir, "out", "[rank0]: step 1/1000", 120);
  double t0 = sp_clock_s();
  kill(run, SIGINT);
  int st = wait_run(run, 120);
  double took = sp_clock_s() - t0;
  char *err = slurp(dir, "err"), *out = slurp(dir, "out");
  printf("  exit %d %.1f s after SIGINT:\n%s%s", st, took, err, out);
  assert_int_equal(st, 128 + SIGINT);
  assert_non_null(strstr(err, "the ranks are still moving"));
  long k = ckpt_step(ck);
  if (CHECK_STILL_MOVING) {
    assert_null(strstr(err, "not reached a step boundary"));
    assert_true(k >= 1);
  }
  const char *last = strstr(out, "shardplane run: stopped by SIGINT after ");
  assert_non_null(last);
  char want[96];
  if (k >= 1)
    snprintf(want, sizeof want, "at step %ld; checkpoint in ", k);
  else
    snprintf(want, sizeof want, "without a checkpoint");
  assert_non_null(strstr(last, want));
  free(err);
  free(out);
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* The same where the stall threshold is long (as a job of long steps has
 * it: five of its slowest steps): a stalled rank is told from a moving one
 * by its own silences, not by the threshold, so the stop still comes soon
 * after the grace rather than a minute later. */
static void test_run_interrupted_stalled_long_threshold(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  const char *args[] = {"--nproc",
                        "2",
                        "--model",
                        MLP,
                        "--steps",
                        "100000",
                        "--inject",
                        "stall:rank=1,step=5",
                        "--log-every",
                        "50",
                        "--stall-timeout-ms",
                        "60000",
                        "--stop-grace",
                        "2",
                        "--checkpoint-dir",
                        ck,
                        NULL};
  pid_t run = start_run(dir, args);
  wait_for_output(dir, "err", "--inject stall: blocking", 60);
  double t0 = sp_clock_s();
  kill(run, SIGINT);
  int st = wait_run(run, 90);
  double took = sp_clock_s() - t0;
  char *err = slurp(dir, "err");
  printf("  exit %d %.1f s after SIGINT (threshold 60 s):\n%s", st, took, err);
  assert_int_equal(st, 128 + SIGINT);
  /* the grace, then the silence limit's floor of 5 s at the most */
  assert_true(took < 2 + 8);
  assert_non_null(strstr(err, "not reached a step boundary"));
  free(err);
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* `shardplane why` of the job run started (its address and admin token
 * read from run's first lines in dir/out): its stdout, malloc'd. */
static char *ask_why(const char *dir) {
  char *out = slurp(dir, "out");
  char addr[64] = "", token[512] = "";
  const char *a = strstr(out, "coordinator on "), *t = strstr(out, "token in ");
  if (a) sscanf(a + strlen("coordinator on "), "%63s", addr);
  if (t) sscanf(t + strlen("token in "), "%511s", token);
  free(out);
  if (!addr[0] || !token[0]) fail_msg("run printed no address or token");
  char *wd = sp_test_path(dir, "why");
  mkdir(wd, 0700);
  char *argv[] = {SHARDPLANE,   "why",          "--coordinator", addr,
                  "--insecure", "--token-file", token,           NULL};
  int st = wait_run(start_cmd(wd, argv), 20);
  char *said = slurp(wd, "out");
  printf("  why: exit %d: %s", st, said);
  free(wd);
  return said;
}

/* The time of day of the line of text holding needle ("12:03:04.567
 * [rank1]: ..."), in seconds; fails when there is none. */
static double line_time(const char *text, const char *needle) {
  const char *at = strstr(text, needle);
  if (!at) fail_msg("no \"%s\" in:\n%s", needle, text);
  while (at > text && at[-1] != '\n') at--;
  int h, m, sec, ms;
  if (sscanf(at, "%2d:%2d:%2d.%3d", &h, &m, &sec, &ms) != 4)
    fail_msg("no time on the line of \"%s\"", needle);
  return h * 3600.0 + m * 60.0 + sec + ms / 1000.0;
}

/* A stall as run's user sees it: before the threshold `why` says there
 * has been no progress (not "healthy"); once the coordinator opens the
 * alert, run prints it at once (within the threshold + 1 s of the stall's
 * start), naming the rank; the alert's age is current whenever it is read,
 * not the age it had when it opened. */
static void test_run_stall_told(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck");
  const char *args[] = {"--nproc",
                        "3",
                        "--model",
                        MLP,
                        "--steps",
                        "100000",
                        "--inject",
                        "stall:rank=1,step=5",
                        "--log-every",
                        "50",
                        "--stall-timeout-ms",
                        "6000",
                        "--stop-grace",
                        "1",
                        "--checkpoint",
                        "none",
                        "--checkpoint-dir",
                        ck,
                        NULL};
  pid_t run = start_run(dir, args);
  wait_for_output(dir, "err", "--inject stall: blocking", 60);
  sp_test_sleep_ms(3000);
  char *why = ask_why(dir);
  assert_non_null(strstr(why, "no progress for "));
  assert_non_null(strstr(why, "is at step 5"));
  assert_null(strstr(why, "healthy"));
  free(why);
  wait_for_output(dir, "err", "[alert]: STALL: rank 1 has not issued", 20);
  char *err = slurp(dir, "err");
  double late = line_time(err, "[alert]: STALL:") -
                line_time(err, "--inject stall: blocking");
  printf(
      "  the alert line came %.2f s after the stall began (threshold "
      "6 s)\n",
      late);
  assert_true(late > 5.5 && late < 6 + 1);
  free(err);
  sp_test_sleep_ms(3000);
  why = ask_why(dir);
  const char *age = strstr(why, "waiting in it for ");
  assert_non_null(age);
  int secs = atoi(age + strlen("waiting in it for "));
  assert_true(secs >= 8);
  free(why);
  kill(run, SIGINT);
  assert_int_equal(wait_run(run, 30), 128 + SIGINT);
  free(ck);
  sp_test_rmtree(dir);
  free(dir);
}

/* A coordinator started by hand, as a user does, for model (plus the
 * NULL-terminated flags); its address goes to addr. */
static void start_coordinator(sp_proc *c, const char *model,
                              const char *const *flags, char *addr,
                              size_t cap) {
  char *argv[32] = {SP_BIN_DIR "/shardplane-coordinator",
                    "--listen",
                    "127.0.0.1:0",
                    "--quiet",
                    "--model",
                    (char *)model,
                    "--insecure",
                    "--no-auth"};
  size_t n = 8;
  for (size_t i = 0; flags && flags[i] && n < 31; i++)
    argv[n++] = (char *)flags[i];
  argv[n] = NULL;
  sp_diag d = {{0}};
  if (sp_proc_spawn(c, argv, false, true, "listening on 127.0.0.1:%d", &d) < 0)
    fail_msg("cannot start the coordinator: %s", d.msg);
  snprintf(addr, cap, "127.0.0.1:%d", c->port);
}

/* stdout of a shell command line, which must exit 0; malloc'd. */

/* The plan a hand-started coordinator serves for examples/mlp.json, the
 * one `shardplane plan --model` computes and the one `shardplane run`
 * trains are the same: one default wrap policy (every Linear a unit), so
 * a checkpoint of one loads into the others. */
static void test_run_same_plan_as_coordinator(void **state) {
  (void)state;
  sp_proc coord;
  char addr[64], cmd[1024];
  start_coordinator(&coord, MLP, NULL, addr, sizeof addr);
  snprintf(cmd, sizeof cmd,
           "%s/shardplane status --insecure --coordinator "
           "%s --json",
           SP_BIN_DIR, addr);
  char *status = command_output(cmd);
  sp_proc_stop(&coord, 5000);
  json_t *js = json_loads(status, 0, NULL);
  assert_non_null(js);
  const char *coord_version =
      json_string_value(json_object_get(js, "plan_version"));
  assert_non_null(coord_version);
  json_int_t coord_units = json_integer_value(json_object_get(js, "units"));

  char *offline_out =
      command_output(SP_BIN_DIR "/shardplane plan --model " MLP " --json");
  json_t *jo = json_loads(offline_out, 0, NULL);
  assert_non_null(jo);

  char *dir = sp_test_mkdtemp();
  const char *args[] = {"--nproc",      "1",    "--model", MLP, "--steps", "1",
                        "--checkpoint", "none", NULL};
  int st = wait_run(start_run(dir, args), 120);
  char *out = slurp(dir, "out");
  printf("  coordinator: plan %s, %lld units\n  run: %s", coord_version,
         (long long)coord_units, out);
  assert_int_equal(st, 0);
  char want[64];
  snprintf(want, sizeof want, "plan %s", coord_version);
  assert_non_null(strstr(out, want));
  /* the root, and one unit per Linear layer */
  sp_model *m;
  sp_diag d = {{0}};
  assert_int_equal(sp_model_load_file(MLP, &m, &d), 0);
  json_int_t linear = 0;
  for (size_t i = 0; i < m->n_modules; i++)
    linear += strcmp(m->modules[i].type, "Linear") == 0;
  sp_model_free(m);
  assert_true(linear > 1);
  assert_int_equal(coord_units, 1 + linear);
  assert_string_equal(json_string_value(json_object_get(jo, "version")),
                      coord_version);
  assert_int_equal(json_array_size(json_object_get(jo, "units")), 1 + linear);
  free(out);
  json_decref(jo);
  json_decref(js);
  free(offline_out);
  free(status);
  sp_test_rmtree(dir);
  free(dir);
}

/* The "--load DIR --load-kind K" a run printed for its checkpoint of
 * kind `kind`: DIR, malloc'd (NULL when it printed none). */
static char *printed_load(const char *out, const char *kind) {
  char tail[64];
  snprintf(tail, sizeof tail, " --load-kind %s\n", kind);
  const char *end = strstr(out, tail);
  if (!end) return NULL;
  const char *start = end;
  while (start > out && strncmp(start, "--load ", 7) != 0) start--;
  if (strncmp(start, "--load ", 7) != 0) return NULL;
  return strndup(start + 7, (size_t)(end - start - 7));
}

/* The directory after "checkpoint in " in a run's output, malloc'd. */
static char *printed_dir(const char *out) {
  const char *at = strstr(out, "checkpoint in ");
  if (!at) fail_msg("no \"checkpoint in\" in: %s", out);
  at += strlen("checkpoint in ");
  return strndup(at, strcspn(at, "\n"));
}

/* shardplane-worker RANK 0 of a one-rank job served by addr, started
 * from --load load (plus --load-kind kind unless NULL), no steps, no
 * checkpoint; its exit status, its stderr in dir/err. */
static int worker_load(const char *dir, const char *addr, const char *load,
                       const char *kind) {
  char *argv[] = {SP_BIN_DIR "/shardplane-worker",
                  "--coordinator",
                  (char *)addr,
                  "--insecure",
                  "--rank",
                  "0",
                  "--steps",
                  "0",
                  "--checkpoint",
                  "none",
                  "--load",
                  (char *)load,
                  kind ? "--load-kind" : NULL,
                  (char *)kind,
                  NULL};
  return wait_run(start_cmd(dir, argv), 60);
}

/* worker_load with a coordinator of its own: a job whose one rank
 * finished is over, and its coordinator refuses a second attach. */
static int load_alone(const char *dir, const char *load, const char *kind) {
  sp_proc coord;
  char addr[64];
  start_coordinator(&coord, MLP, NULL, addr, sizeof addr);
  int st = worker_load(dir, addr, load, kind);
  sp_proc_stop(&coord, 5000);
  return st;
}

/* The bytes of a file (binary), malloc'd; *len their count. */
static uint8_t *file_bytes(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) fail_msg("cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *b = malloc(n > 0 ? (size_t)n : 1);
  assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  *len = (size_t)n;
  return b;
}

/* What a run prints loads: the flags it prints for its checkpoint start
 * a job from it, and so does the run's directory itself as --load (its
 * full/ folder found, or, when it holds several kinds, --load-kind asked
 * for). */
static void test_run_checkpoint_loads(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ck = sp_test_path(dir, "ck"), *ck2 = sp_test_path(dir, "ck2");
  const char *args[] = {"--nproc",          "1", "--model", MLP, "--steps", "1",
                        "--checkpoint-dir", ck,  NULL};
  assert_int_equal(wait_run(start_run(dir, args), 120), 0);
  char *out = slurp(dir, "out");
  printf("%s", out);
  char *load = printed_load(out, "full");
  assert_non_null(load);
  free(out);
  /* the printed flags, given to run */
  const char *again[] = {"--nproc",     "1",    "--model",      MLP,
                         "--steps",     "1",    "--load",       load,
                         "--load-kind", "full", "--checkpoint", "none",
                         NULL};
  assert_int_equal(wait_run(start_run(dir, again), 120), 0);

  const char *both[] = {"--nproc",
                        "1",
                        "--model",
                        MLP,
                        "--steps",
                        "1",
                        "--checkpoint-dir",
                        ck2,
                        "--checkpoint",
                        "full",
                        "--checkpoint",
                        "sharded",
                        NULL};
  assert_int_equal(wait_run(start_run(dir, both), 120), 0);
  out = slurp(dir, "out");
  char *load_sharded = printed_load(out, "sharded");
  assert_non_null(load_sharded);
  free(out);
  /* each kind's step, from its header or index (what a restart says) */
  sp_ckpt_found found;
  assert_int_equal(sp_ckpt_find(ck2, &found), 2);
  assert_int_equal(found.steps[SP_CKPT_FULL], 1);
  assert_int_equal(found.steps[SP_CKPT_SHARDED], 1);

  /* the printed folder, and the run's directory, to the worker */
  assert_int_equal(load_alone(dir, load, "full"), 0);
  int st = load_alone(dir, ck, NULL);
  char *err = slurp(dir, "err");
  printf("  shardplane-worker --load %s: exit %d %s\n", ck, st, err);
  assert_int_equal(st, 0);
  free(err);
  assert_int_equal(load_alone(dir, load_sharded, "sharded"), 0);
  assert_int_equal(load_alone(dir, ck2, "sharded"), 0);
  /* two kinds there: which one is asked for, not guessed */
  st = load_alone(dir, ck2, NULL);
  err = slurp(dir, "err");
  printf("  shardplane-worker --load %s: exit %d: %s", ck2, st, err);
  assert_int_equal(st, 2);
  assert_non_null(strstr(err, "--load-kind full or sharded"));
  free(err);
  free(load);
  free(load_sharded);
  free(ck);
  free(ck2);
  sp_test_rmtree(dir);
  free(dir);
}

/* A second run with another configuration loses nothing: the default
 * directory differs per configuration, and a directory holding a
 * checkpoint of another plan is refused, naming it and --checkpoint-dir,
 * its checkpoint left as it was. */
static void test_run_keeps_other_checkpoints(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char cwd[4096];
  assert_non_null(getcwd(cwd, sizeof cwd));
  assert_int_equal(chdir(dir), 0); /* the default directory is relative */
  const char *a[] = {"--nproc", "2", "--model", MLP, "--steps", "1", NULL};
  const char *b[] = {"--nproc", "2",          "--model",       MLP, "--steps",
                     "1",       "--strategy", "SHARD_GRAD_OP", NULL};
  int st_a = wait_run(start_run(dir, a), 120);
  char *out_a = slurp(dir, "out");
  int st_b = wait_run(start_run(dir, b), 120);
  char *out_b = slurp(dir, "out");
  assert_int_equal(chdir(cwd), 0);
  printf("%s%s", out_a, out_b);
  assert_int_equal(st_a, 0);
  assert_int_equal(st_b, 0);
  char *ck_a = printed_dir(out_a), *ck_b = printed_dir(out_b);
  assert_string_not_equal(ck_a, ck_b);
  char *dir_a = sp_test_path(dir, ck_a);
  char *model_a = sp_test_path(dir_a, "full/model.safetensors");
  size_t kept_len;
  uint8_t *kept = file_bytes(model_a, &kept_len);

  /* configuration b into a's directory: refused */
  const char *b_into_a[] = {
      "--nproc",          "2",   "--model",    MLP,
      "--steps",          "1",   "--strategy", "SHARD_GRAD_OP",
      "--checkpoint-dir", dir_a, NULL};
  int st = wait_run(start_run(dir, b_into_a), 120);
  char *err = slurp(dir, "err");
  printf("  exit %d: %s", st, err);
  assert_int_equal(st, 2);
  assert_non_null(strstr(err, dir_a));
  assert_non_null(strstr(err, "--checkpoint-dir"));
  size_t now_len;
  uint8_t *now = file_bytes(model_a, &now_len);
  assert_true(now_len == kept_len && memcmp(now, kept, now_len) == 0);
  free(now);
  /* the same configuration again: its own directory is rewritten */
  const char *a_again[] = {"--nproc", "2", "--model",          MLP,
                           "--steps", "1", "--checkpoint-dir", dir_a,
                           NULL};
  assert_int_equal(wait_run(start_run(dir, a_again), 120), 0);
  free(err);
  free(ck_a);
  free(ck_b);
  free(kept);
  free(model_a);
  free(dir_a);
  free(out_a);
  free(out_b);
  sp_test_rmtree(dir);
  free(dir);
}

/* The running job's coordinator takes tokens: the admin token run prints
 * works for `shardplane status`, no token does not, and the tokens are
 * gone once the job ends. */
static void test_run_admin_token(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  const char *args[] = {"--nproc", "2",       "--model",      MLP,
                        "--steps", "1000000", "--checkpoint", "none",
                        NULL};
  pid_t pid = start_run(dir, args);
  wait_for_output(dir, "out", "admin token in ", 30);
  char *out = slurp(dir, "out");
  const char *at = strstr(out, "coordinator on ");
  assert_non_null(at);
  char addr[64];
  snprintf(addr, sizeof addr, "%.*s", (int)strcspn(at + 15, "\n"), at + 15);
  at = strstr(out, "admin token in ") + 15;
  char token[4096];
  snprintf(token, sizeof token, "%.*s", (int)strcspn(at, " \n"), at);
  free(out);
  struct stat sb;
  assert_int_equal(stat(token, &sb), 0);
  assert_int_equal(sb.st_mode & 0777, 0600);
  char cmd[8192];
  snprintf(cmd, sizeof cmd,
           "%s status --coordinator %s --token-file %s --insecure --json",
           SHARDPLANE, addr, token);
  char *status = command_output(cmd);
  json_t *js = json_loads(status, 0, NULL);
  assert_non_null(js);
  assert_int_equal(json_integer_value(json_object_get(
                       json_object_get(js, "ranks"), "attached")) +
                       json_integer_value(json_object_get(
                           json_object_get(js, "ranks"), "never_attached")),
                   2);
  json_decref(js);
  free(status);
  snprintf(cmd, sizeof cmd,
           "%s status --coordinator %s --insecure 2>&1 | grep -q "
           "UNAUTHENTICATED",
           SHARDPLANE, addr);
  assert_int_equal(system(cmd), 0);
  /* the token file the coordinator reads holds no token */
  char tokens[4096];
  snprintf(tokens, sizeof tokens, "%.*s/tokens",
           (int)(strrchr(token, '/') - token), token);
  char *secret = sp_test_read_file(token), *hashes = sp_test_read_file(tokens);
  secret[strcspn(secret, "\n")] = '\0';
  assert_null(strstr(hashes, secret));
  free(secret);
  free(hashes);
  kill(pid, SIGINT);
  assert_int_equal(wait_run(pid, 30), 130);
  assert_int_equal(stat(token, &sb), -1);
  assert_int_equal(stat(tokens, &sb), -1);
  sp_test_rmtree(dir);
  free(dir);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_run_to_checkpoint),
      cmocka_unit_test(test_run_training_flags),
      cmocka_unit_test(test_run_load_params_only),
      cmocka_unit_test(test_run_bad_usage),
      cmocka_unit_test(test_run_untrainable_spec),
      cmocka_unit_test(test_run_refused_for_memory),
      cmocka_unit_test(test_run_checked_before_start),
      cmocka_unit_test(test_run_gpt2_says_how_to_sample),
      cmocka_unit_test(test_run_gpt2_spec_defaults),
      cmocka_unit_test(test_run_checkpoint_dir_not_a_directory),
      cmocka_unit_test(test_run_worker_killed),
      cmocka_unit_test(test_run_restart),
      cmocka_unit_test(test_run_restarts_used_up),
      cmocka_unit_test(test_run_stall_named),
      cmocka_unit_test(test_run_interrupted),
      cmocka_unit_test(test_run_interrupted_stalled),
      cmocka_unit_test(test_run_interrupted_stalled_long_threshold),
      cmocka_unit_test(test_run_stall_told),
      cmocka_unit_test(test_run_interrupted_long_step),
      cmocka_unit_test(test_run_same_plan_as_coordinator),
      cmocka_unit_test(test_run_checkpoint_loads),
      cmocka_unit_test(test_run_keeps_other_checkpoints),
      cmocka_unit_test(test_run_admin_token),
  };
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  return cmocka_run_group_tests(tests, NULL, NULL);
}
