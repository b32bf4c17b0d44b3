/* The `shardplane` command, run as a process: exit codes, errors naming the
 * file at fault, and the JSON plan. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>
#include <jansson.h>

#include "support/testutil.h"

static char *g_dir;

typedef struct result {
  int code;
  char *out, *err;
} result;

/* Runs `PROG ARGS` (PROG one of the programs the build makes, ARGS a
 * shell fragment; killed after 30 s) and captures both streams. */
static result run_prog(const char *prog, const char *args) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "timeout 30 %s/%s %s >%s/out 2>%s/err", SP_BIN_DIR,
           prog, args, g_dir, g_dir);
  int st = system(cmd);
  assert_true(WIFEXITED(st));
  char p[1024];
  result r = {WEXITSTATUS(st), NULL, NULL};
  snprintf(p, sizeof p, "%s/out", g_dir);
  r.out = sp_test_read_file(p);
  snprintf(p, sizeof p, "%s/err", g_dir);
  r.err = sp_test_read_file(p);
  return r;
}

/* Runs `shardplane ARGS` (a shell fragment) and captures both streams. */
static result run(const char *args) { return run_prog("shardplane", args); }

static void done(result *r) {
  free(r->out);
  free(r->err);
}

#define MODEL(name) SP_EXAMPLES "/models/" name ".json"

/* Fails unless every line of text fits in 80 columns. */
static void assert_fits_80(const char *text, const char *what) {
  for (const char *l = text; *l;) {
    size_t n = strcspn(l, "\n");
    if (n > 80) fail_msg("%s: a line of %zu columns: %.*s", what, n, (int)n, l);
    l += n + (l[n] == '\n');
  }
}

static void test_usage_and_help(void **state) {
  (void)state;
  result r = run("");
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "usage"));
  done(&r);
  r = run("--help");
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "plan"));
  assert_fits_80(r.out, "shardplane --help");
  /* every command's summary starts in the same column, "incarnations"
   * (the longest name) included */
  const char *list = strstr(r.out, "commands:\n");
  assert_non_null(list);
  size_t col = 0, rows = 0;
  for (const char *l = list + 10; l[0] == ' ' && l[1] == ' ';) {
    size_t name = 2 + strcspn(l + 2, " ");
    size_t at = name + strspn(l + name, " ");
    if (col == 0) col = at;
    if (at != col)
      fail_msg("summary at column %zu, not %zu: %.*s", at, col,
               (int)strcspn(l, "\n"), l);
    rows++;
    l += strcspn(l, "\n") + 1;
  }
  assert_int_equal(rows, 14);
  done(&r);
  r = run("frobnicate");
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "frobnicate"));
  done(&r);
  r = run("plan --help");
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "--world-size"));
  done(&r);
  /* the exit codes line of a command that exits 5 says so; others' do not */
  r = run("why --help");
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out,
                         "4 coordinator unreachable,\n"
                         "            5 an open alert, or the job "
                         "failed\n"));
  done(&r);
  r = run("analyze --help");
  assert_non_null(strstr(r.out, "5 the dump shows a divergence\n"));
  done(&r);
  r = run("status --help");
  assert_null(strstr(r.out, "            5 "));
  done(&r);
  /* without --model, plan asks a coordinator (test_cli_remote); job
   * options then are bad usage */
  r = run("plan --world-size 2");
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--model"));
  done(&r);
  r = run("plan --model " MODEL("gpt2") " --world-size 0");
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--world-size"));
  done(&r);
  r = run("plan --model " MODEL("gpt2") " --param-dtype int8");
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "int8"));
  done(&r);
  r = run("plan --model " MODEL("gpt2") " --bogus");
  assert_int_equal(r.code, 2);
  done(&r);
  /* the coordinator's help names its limits */
  r = run_prog("shardplane-coordinator", "--help");
  assert_int_equal(r.code, 0);
  static const char *const k_limit_flags[] = {
      "--max-connections", "--preface-timeout-ms", "--idle-timeout-ms",
      "--request-timeout-ms", "--max-buffered-mib"};
  for (size_t i = 0; i < sizeof k_limit_flags / sizeof k_limit_flags[0]; i++)
    if (strstr(r.out, k_limit_flags[i]) == NULL)
      fail_msg("shardplane-coordinator --help does not mention %s",
               k_limit_flags[i]);
  done(&r);
}

/* A usage error is its line and "try 'PROG --help'", exit 2: the whole
 * help (149 lines for run, 90 for the coordinator) buried that line. */
static void test_usage_errors_are_short(void **state) {
  (void)state;
  static const struct {
    const char *prog, *args, *says, *try;
  } cases[] = {
      {"shardplane", "run --bogus", "'--bogus'", "shardplane run"},
      {"shardplane", "run --nproc 2", "--model is required", "shardplane run"},
      {"shardplane", "run --nproc 2 --model " MODEL("gpt2-tiny") " extra",
       "\"extra\"", "shardplane run"},
      {"shardplane", "plan --model " MODEL("gpt2") " --bogus", "'--bogus'",
       "shardplane plan"},
      {"shardplane", "agent --bogus", "'--bogus'", "shardplane agent"},
      {"shardplane", "agent --coordinator 127.0.0.1:1 -- true",
       "--nproc-per-node", "shardplane agent"},
      {"shardplane", "token", "missing subcommand", "shardplane token"},
      {"shardplane", "token create --bogus", "'--bogus'", "shardplane token"},
      /* getopt's line names the command, not "create:" */
      {"shardplane", "token create --json",
       "shardplane token: unrecognized "
       "option '--json'",
       "shardplane token"},
      {"shardplane", "token frob", "unknown subcommand \"frob\"",
       "shardplane token"},
      {"shardplane", "token create --role admin", "--token-file",
       "shardplane token"},
      {"shardplane", "status --bogus", "'--bogus'", "shardplane status"},
      {"shardplane", "store", "missing the operation", "shardplane store"},
      {"shardplane", "frobnicate", "\"frobnicate\"", "shardplane"},
      {"shardplane-coordinator", "--model " MODEL("gpt2-tiny"),
       "choose the transport", "shardplane-coordinator"},
      {"shardplane-coordinator", "--model " MODEL("gpt2-tiny") " --insecure",
       "--token-file", "shardplane-coordinator"},
      {"shardplane-coordinator", "--bogus", "'--bogus'",
       "shardplane-coordinator"},
      {"shardplane-coordinator", "--insecure --no-auth", "--model",
       "shardplane-coordinator"},
      {"shardplane-worker", "--bogus", "'--bogus'", "shardplane-worker"},
      {"shardplane-worker", "--steps 3", "--rank is required",
       "shardplane-worker"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    result r = run_prog(cases[i].prog, cases[i].args);
    size_t lines = 0;
    for (const char *c = r.err; *c; c++) lines += *c == '\n';
    char want[128];
    snprintf(want, sizeof want, "try '%s --help'\n", cases[i].try);
    const char *at = strstr(r.err, want);
    if (r.code != 2 || lines > 3 || strstr(r.err, cases[i].says) == NULL ||
        at == NULL || at[strlen(want)] != '\0')
      fail_msg("%s %s: exit %d, %zu lines on stderr:\n%s", cases[i].prog,
               cases[i].args, r.code, lines, r.err);
    done(&r);
  }
}

static void test_failures_name_the_cause(void **state) {
  (void)state;
  result r = run("plan --model /nonexistent/spec.json");
  assert_int_equal(r.code, 1);
  assert_non_null(strstr(r.err, "/nonexistent/spec.json"));
  done(&r);
  char path[1024];
  snprintf(path, sizeof path, "%s/bad.json", g_dir);
  const char *bad =
      "{\"format\":\"shardplane.model/v1\",\"modules\":[{\"fqn\":"
      "\"\",\"type\":\"N\"}],\"params\":[{\"fqn\":\"w\","
      "\"shape\":[2,-1],\"dtype\":\"float32\"}]}";
  sp_test_write_file(path, bad, strlen(bad));
  char args[2048];
  snprintf(args, sizeof args, "plan --model %s", path);
  r = run(args);
  assert_int_equal(r.code, 1);
  assert_non_null(strstr(r.err, "bad.json"));
  assert_non_null(strstr(r.err, "params[0].shape[1]"));
  done(&r);
  /* a flag naming no module of the model is bad usage */
  r = run("plan --model " MODEL("gpt2") " --wrap-type NoSuchBlock");
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "NoSuchBlock"));
  done(&r);
  r = run("plan --model " MODEL("gpt2") " --world-size 4 --rank 4");
  assert_int_equal(r.code, 3);
  assert_non_null(strstr(r.err, "--rank"));
  done(&r);
  r = run("plan --model " MODEL("gpt2") " --unit nope");
  assert_int_equal(r.code, 3);
  done(&r);
}

static void test_json_plan_llama70b(void **state) {
  (void)state;
  result r = run("plan --model " MODEL(
      "llama2_70b") " --world-size 1024 "
                    "--wrap-type LlamaDecoderLayer --param-dtype bfloat16 "
                    "--reduce-dtype float32 --rank 1023 --json");
  assert_int_equal(r.code, 0);
  json_error_t e;
  json_t *j = json_loads(r.out, 0, &e);
  if (j == NULL) fail_msg("bad JSON: %s", e.text);
  assert_int_equal(strlen(json_string_value(json_object_get(j, "version"))),
                   16);
  json_t *units = json_object_get(j, "units");
  assert_int_equal(json_array_size(units), 81);
  json_t *u1 = json_array_get(units, 1);
  assert_string_equal(json_string_value(json_object_get(u1, "module")),
                      "model.layers.0");
  json_t *mp = json_object_get(u1, "mixed_precision");
  assert_string_equal(json_string_value(json_object_get(mp, "param_dtype")),
                      "bfloat16");
  assert_string_equal(json_string_value(json_object_get(mp, "reduce_dtype")),
                      "float32");
  assert_int_equal(json_array_size(json_object_get(j, "ranks")), 1024);
  json_t *bufs = json_object_get(j, "buffers");
  assert_int_equal(json_array_size(bufs), 80);
  json_t *b0 = json_array_get(bufs, 0);
  assert_string_equal(json_string_value(json_object_get(b0, "original_dtype")),
                      "float32");
  /* rank 1023's shard lists every unit */
  assert_int_equal(json_array_size(json_object_get(j, "shard")), 81);
  json_decref(j);
  done(&r);
}

static void test_job_file_and_override(void **state) {
  (void)state;
  char path[1024], args[2048];
  snprintf(path, sizeof path, "%s/job.json", g_dir);
  const char *job =
      "{\"format\":\"shardplane.job/v1\",\"world_size\":4,"
      "\"wrap\":{\"types\":[\"Bottleneck\"]},"
      "\"mixed_precision\":{\"param_dtype\":\"bfloat16\","
      "\"buffer_dtype\":\"bfloat16\"}}";
  sp_test_write_file(path, job, strlen(job));
  snprintf(args, sizeof args, "plan --model %s --job %s --world-size 6 --json",
           MODEL("resnet50"), path);
  result r = run(args);
  assert_int_equal(r.code, 0);
  json_t *j = json_loads(r.out, 0, NULL);
  assert_non_null(j);
  json_t *jj = json_object_get(j, "job");
  assert_int_equal(json_integer_value(json_object_get(jj, "world_size")), 6);
  /* BatchNorm stays float32 (its own full-precision unit); the step
   * counters stay int64 */
  json_t *bufs = json_object_get(j, "buffers");
  size_t i;
  json_t *b;
  int checked = 0;
  json_array_foreach(bufs, i, b) {
    const char *fqn = json_string_value(json_object_get(b, "fqn"));
    const char *orig = json_string_value(json_object_get(b, "original_dtype"));
    const char *comp = json_string_value(json_object_get(b, "compute_dtype"));
    if (strstr(fqn, "num_batches_tracked")) {
      assert_string_equal(orig, "int64");
      assert_string_equal(comp, "int64");
    } else {
      assert_string_equal(orig, "float32");
      assert_string_equal(comp, "float32");
    }
    checked++;
  }
  assert_int_equal(checked, 159);
  json_decref(j);
  done(&r);
  /* a broken job file is named in the error */
  sp_test_write_file(path, "{\"world_size\": -2}", 18);
  r = run(args);
  assert_int_equal(r.code, 1);
  assert_non_null(strstr(r.err, "job.json"));
  assert_non_null(strstr(r.err, "world_size"));
  done(&r);
}

/* A misspelt key of a job file is an error naming the key, the file and
 * the nearest known key, from every program that reads job files, before
 * anything starts; the example job files still load. */
static void test_job_file_unknown_keys(void **state) {
  (void)state;
  char path[1024], args[2048];
  snprintf(path, sizeof path, "%s/J.json", g_dir);
  const char *job =
      "{\"format\":\"shardplane.job/v1\",\"world_size\":2,"
      "\"stratgy\":\"NO_SHARD\",\"mixed_precison\":{"
      "\"param_dtype\":\"bfloat16\"}}";
  sp_test_write_file(path, job, strlen(job));
  char want[1100];
  snprintf(want, sizeof want,
           "%s: unknown key \"stratgy\" (did you mean \"strategy\"?)", path);
  snprintf(args, sizeof args, "plan --model %s --job %s", MODEL("resnet50"),
           path);
  result r = run(args);
  assert_int_equal(r.code, 1);
  if (strstr(r.err, want) == NULL)
    fail_msg("plan --job: \"%s\", want \"%s\"", r.err, want);
  done(&r);
  snprintf(args, sizeof args,
           "run --nproc 2 --model %s --job %s --checkpoint none",
           SP_EXAMPLES "/mlp.json", path);
  r = run(args);
  assert_int_equal(r.code, 1);
  if (strstr(r.err, want) == NULL)
    fail_msg("run --job: \"%s\", want \"%s\"", r.err, want);
  assert_null(strstr(r.out, "[rank"));
  done(&r);
  snprintf(args, sizeof args,
           "--model %s --job %s --listen 127.0.0.1:0 --insecure",
           SP_EXAMPLES "/mlp.json", path);
  r = run_prog("shardplane-coordinator", args);
  assert_int_equal(r.code, 1);
  if (strstr(r.err, want) == NULL)
    fail_msg("shardplane-coordinator --job: \"%s\", want \"%s\"", r.err, want);
  done(&r);
  /* a key nested in "wrap" or "mixed_precision" too */
  job = "{\"wrap\":{\"type\":[\"Bottleneck\"]}}";
  sp_test_write_file(path, job, strlen(job));
  snprintf(args, sizeof args, "plan --model %s --job %s", MODEL("resnet50"),
           path);
  r = run(args);
  assert_int_equal(r.code, 1);
  assert_non_null(strstr(r.err,
                         "unknown key \"type\" in wrap (did you mean "
                         "\"types\"?)"));
  done(&r);
  static const char *const k_examples[][2] = {{"llama2_7b_fsdp8", "llama2_7b"},
                                              {"resnet50_hybrid", "resnet50"}};
  for (size_t i = 0; i < 2; i++) {
    snprintf(args, sizeof args,
             "plan --model %s/models/%s.json --job "
             "%s/jobs/%s.json",
             SP_EXAMPLES, k_examples[i][1], SP_EXAMPLES, k_examples[i][0]);
    r = run(args);
    if (r.code != 0) fail_msg("%s: exit %d: %s", args, r.code, r.err);
    done(&r);
  }
}

static void test_human_output(void **state) {
  (void)state;
  result r = run("plan --model " MODEL(
      "gpt2") " --world-size 3 "
              "--wrap-type GPT2Block --unit transformer.h.0 --rank 2");
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "version"));
  assert_non_null(strstr(r.out, "transformer.h.0.attn.bias"));
  assert_non_null(strstr(r.out, "lm_head.weight")); /* the shared param */
  assert_non_null(strstr(r.out, "rank 2 shard"));
  assert_non_null(strstr(r.out, "transformer.h.0.mlp.c_proj.weight"));
  done(&r);
}

#define MLP SP_EXAMPLES "/mlp.json"
/* so that an old worker which took a bad value fails at once */
#define WORKER "--coordinator 127.0.0.1:1 --rank 0 "
#define RUN "run --nproc 2 --model " MLP " "
#define GPT2RUN "run --nproc 2 --model " MODEL("gpt2-tiny") " "
#define COORD "--listen 127.0.0.1:0 --quiet --model " MLP " "

/* Every flag error of shardplane-worker, shardplane run, shardplane plan
 * and shardplane-coordinator names the flag, the value and what is
 * allowed, and exits 2. */
static void test_flag_errors(void **state) {
  (void)state;
  static const struct {
    const char *prog, *args, *want;
  } cases[] = {
      {"shardplane-worker", "--rank -1",
       "--rank \"-1\": expected an integer in [0, 1048575]"},
      {"shardplane-worker", WORKER "--steps -3",
       "--steps \"-3\": expected an integer in [0, 1000000000]"},
      {"shardplane-worker", WORKER "--global-batch 0",
       "--global-batch \"0\": expected an integer in [1, 1048576]"},
      {"shardplane-worker", WORKER "--lr nan",
       "--lr \"nan\": expected a finite number >= 0"},
      {"shardplane-worker", WORKER "--checkpoint bogus",
       "--checkpoint \"bogus\": expected one of none, full, sharded, local"},
      {"shardplane-worker", WORKER "--load-kind bogus",
       "--load-kind \"bogus\": expected one of full, sharded, local"},
      {"shardplane-worker", WORKER "--log-every x",
       "--log-every \"x\": expected an integer in [0, 1000000000]"},
      {"shardplane-worker", WORKER "--comm-timeout-ms -5",
       "--comm-timeout-ms \"-5\": expected an integer in [1, 86400000]"},
      {"shardplane-worker", WORKER "--report-toggle 0",
       "--report-toggle \"0\": expected an integer in [1, 1000000000]"},
      {"shardplane-worker", WORKER "--device gpu0",
       "--device \"gpu0\": expected cpu or cuda:N"},
      {"shardplane-worker", WORKER "--checkpoint-dir ''",
       "--checkpoint-dir \"\": expected a directory"},
      {"shardplane-worker", "--rank 0 --coordinator nohost",
       "--coordinator \"nohost\": expected HOST:PORT"},
      {"shardplane", RUN "--steps -3",
       "shardplane run: --steps \"-3\": expected an integer in [1, "
       "1000000000]"},
      {"shardplane", "run --nproc 0 --model " MLP,
       "--nproc \"0\": expected an integer in [1, 256]"},
      {"shardplane", RUN "--global-batch x",
       "--global-batch \"x\": expected an integer in [1, 1048576]"},
      {"shardplane", RUN "--global-batch 25",
       "--global-batch \"25\": expected a multiple of --nproc 2"},
      {"shardplane", RUN "--lr -1",
       "--lr \"-1\": expected a finite number >= 0"},
      {"shardplane", RUN "--log-every -1",
       "--log-every \"-1\": expected an integer in [0, 1000000000]"},
      {"shardplane", RUN "--heartbeat-timeout-ms 0",
       "--heartbeat-timeout-ms \"0\": expected an integer in [1, 3600000]"},
      /* the training flags: the worker's, checked by run as well */
      {"shardplane-worker", WORKER "--optimizer adam",
       "--optimizer \"adam\": expected one of sgd, adamw"},
      {"shardplane-worker", WORKER "--betas 0.9",
       "--betas \"0.9\": expected two numbers B1,B2, each in [0, 1)"},
      {"shardplane-worker", WORKER "--optimizer adamw --betas 0.9,1",
       "--betas \"0.9,1\": expected two numbers B1,B2, each in [0, 1)"},
      {"shardplane-worker", WORKER "--momentum 0.9 --optimizer adamw",
       "--momentum \"0.9\": only with --optimizer sgd"},
      /* a flag a spec's default could make meaningful waits for the
       * spec; one the flags alone make meaningless is refused at once */
      {"shardplane-worker", WORKER "--optimizer sgd --eps 1e-6",
       "--eps \"1e-6\": only with --optimizer adamw"},
      {"shardplane-worker", WORKER "--optimizer adamw --eps 0",
       "--eps \"0\": expected a finite number > 0"},
      {"shardplane-worker", WORKER "--weight-decay -1",
       "--weight-decay \"-1\": expected a finite number >= 0"},
      {"shardplane-worker", WORKER "--lr-schedule linear",
       "--lr-schedule \"linear\": expected one of constant, cosine"},
      {"shardplane-worker", WORKER "--lr-schedule constant --warmup-steps 5",
       "--warmup-steps \"5\": only with --lr-schedule cosine"},
      {"shardplane-worker", WORKER "--lr-schedule cosine --warmup-steps 50",
       "--warmup-steps \"50\": expected at most --steps 20"},
      {"shardplane-worker", WORKER "--lr 0.05 --lr-schedule cosine --min-lr 1",
       "--min-lr \"1\": expected at most --lr 0.05"},
      {"shardplane-worker", WORKER "--clip-grad-norm -1",
       "--clip-grad-norm \"-1\": expected a finite number >= 0 (0: off)"},
      {"shardplane-worker", WORKER "--grad-accum 0",
       "--grad-accum \"0\": expected an integer in [1, 1024]"},
      {"shardplane-worker", WORKER "--grad-accum 5",
       "--global-batch \"24\": expected a multiple of --grad-accum 5"},
      {"shardplane-worker", WORKER "--no-sync",
       "--no-sync: only with --grad-accum K, K > 1"},
      {"shardplane-worker", WORKER "--no-decay ''",
       "--no-decay \"\": expected an FQN glob"},
      {"shardplane", RUN "--grad-accum 5",
       "--global-batch \"24\": expected a multiple of 10: --nproc 2 times "
       "--grad-accum 5"},
      {"shardplane", RUN "--optimizer sgd --betas 0.9,0.99",
       "--betas \"0.9,0.99\": only with --optimizer adamw"},
      {"shardplane", RUN "--warmup-steps 5",
       "--warmup-steps \"5\": only with --lr-schedule cosine"},
      /* against a spec's training defaults: run knows the spec */
      {"shardplane", GPT2RUN "--momentum 0.9",
       "--momentum \"0.9\": only with --optimizer sgd (adamw has --betas); "
       "adamw is training.optimizer of " MODEL("gpt2-tiny")},
      {"shardplane", GPT2RUN "--min-lr 0.001",
       "--min-lr \"0.001\": expected at most the lr 0.0006, training.lr of " MODEL(
           "gpt2-tiny") " (--lr sets another)"},
      {"shardplane", GPT2RUN "--lr-schedule constant --warmup-steps 5",
       "--warmup-steps \"5\": only with --lr-schedule cosine"},
      {"shardplane", RUN "--checkpoint bogus",
       "--checkpoint \"bogus\": expected one of none, full, sharded, local"},
      {"shardplane", RUN "--device tpu",
       "--device \"tpu\": expected one of cpu, cuda"},
      {"shardplane", RUN "--strategy FOO",
       "--strategy \"FOO\": expected one of FULL_SHARD, SHARD_GRAD_OP, "
       "NO_SHARD, HYBRID_SHARD"},
      {"shardplane", RUN "--world-size 2", "--world-size \"2\""},
      {"shardplane", RUN "--backend mpi",
       "--backend \"mpi\": expected one of gloo, nccl"},
      {"shardplane", RUN "--backend nccl", "--backend \"nccl\": expected gloo"},
      {"shardplane", RUN "--param-dtype int8",
       "--param-dtype \"int8\": expected a floating dtype: one of float32, "
       "bfloat16, float16, float64"},
      {"shardplane", RUN "--shard-group-size 0",
       "--shard-group-size \"0\": expected an integer in [1, 1048576]"},
      {"shardplane", RUN "--wrap-type Conv2d",
       "--wrap-type \"Conv2d\": expected a module type of model mlp: "},
      {"shardplane", RUN "--wrap-module no.such",
       "--wrap-module \"no.such\": expected the FQN of a module of model "
       "mlp: \"layers\", \"layers.0\""},
      {"shardplane", "plan --model " MLP " --rank -1",
       "shardplane plan: --rank \"-1\": expected an integer in [0, 1048575]"},
      {"shardplane", "plan --model " MLP " --world-size 0",
       "--world-size \"0\": expected an integer in [1, 1048576]"},
      {"shardplane", "plan --model " MLP " --reduce-dtype int32",
       "--reduce-dtype \"int32\": expected a floating dtype"},
      {"shardplane", "plan --model " MLP " --wrap-type Nope",
       "--wrap-type \"Nope\": expected a module type of model mlp"},
      {"shardplane", "plan --model " MLP " --strategy HYBRID_SHARD",
       "(--shard-group-size): HYBRID_SHARD needs"},
      {"shardplane", "plan --timeout-ms 0",
       "--timeout-ms \"0\": expected an integer in [1, 86400000]"},
      {"shardplane", "plan --coordinator nohost",
       "--coordinator \"nohost\": expected HOST:PORT"},
      {"shardplane-coordinator", "--model " MLP " --listen nohost",
       "--listen \"nohost\": expected HOST:PORT"},
      {"shardplane-coordinator", COORD "--heartbeat-timeout-ms 0",
       "--heartbeat-timeout-ms \"0\": expected an integer in [1, 3600000]"},
      {"shardplane-coordinator", COORD "--heartbeat-interval-ms x",
       "--heartbeat-interval-ms \"x\": expected an integer in [1, 3600000]"},
      {"shardplane-coordinator", COORD "--max-connections 0",
       "--max-connections \"0\": expected an integer in [1, 1048576] "
       "(connections)"},
      {"shardplane-coordinator", COORD "--preface-timeout-ms x",
       "--preface-timeout-ms \"x\": expected an integer in [1, 3600000]"},
      {"shardplane-coordinator", COORD "--idle-timeout-ms -1",
       "--idle-timeout-ms \"-1\": expected an integer in [1, 86400000]"},
      {"shardplane-coordinator", COORD "--request-timeout-ms 0",
       "--request-timeout-ms \"0\": expected an integer in [1, 3600000]"},
      {"shardplane-coordinator", COORD "--max-buffered-mib 2000000",
       "--max-buffered-mib \"2000000\": expected an integer in [1, 1048576] "
       "(MiB)"},
      {"shardplane-coordinator", COORD "--strategy FOO",
       "--strategy \"FOO\": expected one of FULL_SHARD, SHARD_GRAD_OP, "
       "NO_SHARD, HYBRID_SHARD"},
      {"shardplane-coordinator", COORD "--world-size -4",
       "--world-size \"-4\": expected an integer in [1, 1048576]"},
      {"shardplane-coordinator", COORD "--wrap-type Nope",
       "--wrap-type \"Nope\": expected a module type of model mlp"},
      {"shardplane-coordinator", COORD "--model ''",
       "--model \"\": expected a model spec"},
  };
  int bad = 0;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    result r = run_prog(cases[i].prog, cases[i].args);
    if (r.code != 2 || strstr(r.err, cases[i].want) == NULL) {
      printf("  %s %s: exit %d, stderr \"%s\"; want exit 2 and \"%s\"\n",
             cases[i].prog, cases[i].args, r.code, r.err, cases[i].want);
      bad++;
    }
    done(&r);
  }
  assert_int_equal(bad, 0);
  /* run sets the world size itself: --help does not offer it */
  result r = run("run --help");
  assert_int_equal(r.code, 0);
  assert_null(strstr(r.out, "--world-size"));
  assert_non_null(strstr(r.out, "--strategy"));
  done(&r);
}

/* `plan --memory`: the model's numbers as a table and as JSON, and its
 * options refused with the flag, the value and what is allowed. */
static void test_plan_memory(void **state) {
  (void)state;
  result r = run("plan --model " MODEL(
      "gpt2") " --wrap-type GPT2Block "
              "--world-size 8 --memory --optimizer adamw --json");
  assert_int_equal(r.code, 0);
  json_error_t je;
  json_t *j = json_loads(r.out, 0, &je);
  assert_non_null(j);
  json_t *m = json_object_get(j, "memory");
  assert_string_equal(json_string_value(json_object_get(m, "optimizer")),
                      "adamw");
  json_t *cats = json_object_get(m, "categories");
  /* 2 float32 moments of every rank's 15554976 elements */
  assert_int_equal(json_integer_value(json_object_get(
                       json_object_get(cats, "optimizer"), "peak")),
                   124439808);
  assert_int_equal(json_integer_value(json_object_get(
                       json_object_get(cats, "sharded_params"), "peak")),
                   62219904);
  /* the SGD figure of test_memory.c plus the moments */
  assert_int_equal(
      json_integer_value(json_object_get(json_object_get(m, "total"), "peak")),
      572599344 + 124439808);
  json_decref(j);
  done(&r);
  r = run("plan --model " MODEL(
      "gpt2") " --wrap-type GPT2Block "
              "--world-size 8 --memory --optimizer sgd");
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "unsharded grads"));
  assert_non_null(strstr(r.out, "572599344"));
  assert_non_null(strstr(r.out, "in-flight floor"));
  done(&r);
  /* without --optimizer, the one run would train with: the spec's AdamW */
  r = run("plan --model " MODEL("gpt2") " --world-size 8 --memory");
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "optimizer adamw"));
  assert_non_null(strstr(r.out, "whole peak per rank"));
  done(&r);
  r = run("plan --model " MODEL("gpt2") " --memory --optimizer adam");
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--optimizer \"adam\""));
  assert_non_null(strstr(r.err, "sgd-momentum or adamw"));
  done(&r);
  r = run("plan --model " MODEL("gpt2") " --memory --max-inflight-gathers 0");
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--max-inflight-gathers \"0\""));
  assert_non_null(strstr(r.err, "1 to 65536"));
  done(&r);
  r = run("plan --model " MODEL("gpt2") " --no-sync");
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--no-sync"));
  assert_non_null(strstr(r.err, "needs --memory"));
  done(&r);
  r = run("plan --model " MODEL("gpt2") " --memory --rank 0");
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--rank"));
  done(&r);
}

int main(void) {
  g_dir = sp_test_mkdtemp();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_usage_and_help),
      cmocka_unit_test(test_usage_errors_are_short),
      cmocka_unit_test(test_failures_name_the_cause),
      cmocka_unit_test(test_json_plan_llama70b),
      cmocka_unit_test(test_job_file_and_override),
      cmocka_unit_test(test_job_file_unknown_keys),
      cmocka_unit_test(test_human_output),
      cmocka_unit_test(test_flag_errors),
      cmocka_unit_test(test_plan_memory),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  sp_test_rmtree(g_dir);
  free(g_dir);
  return rc;
}
