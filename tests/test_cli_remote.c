/* The `shardplane` command against a real coordinator: both run as child
 * processes on loopback. Checks outputs (JSON parsed with jansson) and exit
 * codes of status, plan, where, buffers, store and watch, and the codes for
 * not found (3), unreachable (4) and bad usage (2).
 *
 * Every wait is bounded and every child is reaped, also when an assertion
 * fails: a child still running at the end is killed by the teardown. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "rpc/rpc.h"
#include "shardplane/v1/coordinator.pb-c.h"
#include "support/testutil.h"

#define MODEL(name) SP_EXAMPLES "/models/" name ".json"
#define COORD_BIN SP_BIN_DIR "/shardplane-coordinator"
#define CLI_BIN SP_BIN_DIR "/shardplane"
#define METHOD(m) "/shardplane.v1.Coordinator/" m

/* Generous for sanitizer builds; a healthy run takes milliseconds. */
#define CHILD_TIMEOUT_MS 20000
#define START_TIMEOUT_MS 20000

static char *g_dir;
static char g_addr[64]; /* the gpt2 coordinator every test shares */
static pid_t g_coord = -1;
/* test_diagnosis_live's coordinator and workers */
static pid_t g_live[3] = {-1, -1, -1};
static void stop_live_job(void);

static int64_t now_ms(void) { return (int64_t)(sp_clock_s() * 1e3); }

/* Waits up to timeout_ms for pid; kills and reaps it past that. Returns
 * the wait status, or -1 when it had to be killed. */
static int wait_child(pid_t pid, int timeout_ms) {
  int64_t end = now_ms() + timeout_ms;
  int st;
  for (;;) {
    pid_t w = waitpid(pid, &st, WNOHANG);
    if (w == pid) return st;
    if (w < 0 && errno != EINTR) return -1;
    if (now_ms() >= end) break;
    sp_test_sleep_ms(2);
  }
  kill(pid, SIGKILL);
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return -1;
}

/* fork + exec argv with stdout/stderr to the given files (NULL: a pipe for
 * stdout, returned in *out_fd; /dev/null for stderr). */
static pid_t spawn(char *const argv[], const char *out_path,
                   const char *err_path, int *out_fd) {
  int pfd[2] = {-1, -1};
  if (out_path == NULL) assert_int_equal(pipe(pfd), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int out =
        out_path ? open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600) : pfd[1];
    int err = open(err_path ? err_path : "/dev/null",
                   O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (out < 0 || err < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0) _exit(127);
    if (pfd[0] >= 0) close(pfd[0]);
    execv(argv[0], argv);
    _exit(127);
  }
  if (out_path == NULL) {
    close(pfd[1]);
    *out_fd = pfd[0];
  }
  return pid;
}

/* Starts a coordinator on a free port; its address goes to addr. */
static pid_t start_coordinator(char *const extra[], char *addr, size_t cap) {
  /* the command's credentials are test_coord_auth's and test_run's
   * subject; here the coordinator serves anyone, in cleartext */
  char *argv[32] = {COORD_BIN, "--listen",   "127.0.0.1:0",
                    "--quiet", "--insecure", "--no-auth"};
  size_t n = 6;
  for (size_t i = 0; extra[i] != NULL && n < 31; i++) argv[n++] = extra[i];
  argv[n] = NULL;
  int fd;
  pid_t pid = spawn(argv, NULL, NULL, &fd);
  /* "listening on 127.0.0.1:PORT\n", read with a deadline */
  char line[256];
  size_t len = 0;
  int64_t end = now_ms() + START_TIMEOUT_MS;
  while (len < sizeof line - 1 && memchr(line, '\n', len) == NULL) {
    struct pollfd p = {fd, POLLIN, 0};
    int left = (int)(end - now_ms());
    if (left <= 0 || poll(&p, 1, left) <= 0) break;
    ssize_t r = read(fd, line + len, sizeof line - 1 - len);
    if (r <= 0) break;
    len += (size_t)r;
  }
  close(fd);
  line[len] = '\0';
  const char *at = strstr(line, "listening on ");
  if (at == NULL) {
    wait_child(pid, 1);
    fail_msg("the coordinator did not start: \"%s\"", line);
  }
  snprintf(addr, cap, "%.*s", (int)strcspn(at + 13, "\n"), at + 13);
  return pid;
}

/* SIGTERM, then the exit status within the timeout (-1: had to kill). */
static int stop_coordinator(pid_t pid) {
  kill(pid, SIGTERM);
  return wait_child(pid, CHILD_TIMEOUT_MS);
}

typedef struct result {
  int code;
  char *out, *err;
  int64_t ms;
} result;

/* Runs `shardplane ARGS...` (NULL-terminated), bounded in time. The
 * coordinators here are cleartext: a remote subcommand gets --insecure
 * last (an offline plan, with --model, takes no connection flags). */
static result run(const char *arg, ...) {
  char *argv[32] = {CLI_BIN};
  size_t n = 1;
  bool offline = false;
  size_t dashes = 0; /* where "--" is, if anywhere */
  va_list ap;
  va_start(ap, arg);
  for (const char *a = arg; a != NULL && n < 30; a = va_arg(ap, const char *)) {
    if (strcmp(a, "--") == 0 && dashes == 0) dashes = n;
    argv[n++] = (char *)a;
    offline |= strcmp(a, "--model") == 0;
  }
  va_end(ap);
  if (arg != NULL && arg[0] != '-' && !offline) {
    size_t at = dashes ? dashes : n;
    memmove(&argv[at + 1], &argv[at], (n - at) * sizeof argv[0]);
    argv[at] = "--insecure";
    n++;
  }
  argv[n] = NULL;
  char out[1024], err[1024];
  snprintf(out, sizeof out, "%s/out", g_dir);
  snprintf(err, sizeof err, "%s/err", g_dir);
  int64_t t0 = now_ms();
  pid_t pid = spawn(argv, out, err, NULL);
  int st = wait_child(pid, CHILD_TIMEOUT_MS);
  result r = {-1, sp_test_read_file(out), sp_test_read_file(err),
              now_ms() - t0};
  if (st < 0) fail_msg("shardplane %s did not finish", arg);
  assert_true(WIFEXITED(st));
  r.code = WEXITSTATUS(st);
  return r;
}

static void done(result *r) {
  free(r->out);
  free(r->err);
}

static json_t *parse(const result *r) {
  json_error_t e;
  json_t *j = json_loads(r->out, 0, &e);
  if (j == NULL) fail_msg("bad JSON (%s): %s", e.text, r->out);
  return j;
}

static const char *jstr(json_t *o, const char *key) {
  const char *s = json_string_value(json_object_get(o, key));
  if (s == NULL) fail_msg("no string \"%s\"", key);
  return s;
}

static json_int_t jint(json_t *o, const char *key) {
  json_t *v = json_object_get(o, key);
  if (!json_is_integer(v)) fail_msg("no integer \"%s\"", key);
  return json_integer_value(v);
}

/* ---- the shared coordinator: gpt2, 4 ranks in shard groups of 2 ---- */

static int setup(void **state) {
  (void)state;
  g_dir = sp_test_mkdtemp();
  char *extra[] = {"--model",
                   MODEL("gpt2"),
                   "--world-size",
                   "4",
                   "--strategy",
                   "HYBRID_SHARD",
                   "--shard-group-size",
                   "2",
                   "--wrap-type",
                   "GPT2Block",
                   NULL};
  g_coord = start_coordinator(extra, g_addr, sizeof g_addr);
  /* the default address every command below uses */
  setenv("SHARDPLANE_COORDINATOR", g_addr, 1);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  stop_live_job();
  if (g_coord > 0) stop_coordinator(g_coord);
  g_coord = -1;
  sp_test_rmtree(g_dir);
  free(g_dir);
  return 0;
}

static void test_status(void **state) {
  (void)state;
  result r = run("status", "--json", NULL);
  assert_int_equal(r.code, 0);
  json_t *j = parse(&r);
  assert_string_equal(jstr(j, "coordinator"), g_addr);
  assert_int_equal(strlen(jstr(j, "plan_version")), 16);
  assert_int_equal(jint(j, "units"), 13);
  json_t *m = json_object_get(j, "model");
  assert_string_equal(jstr(m, "name"), "gpt2");
  assert_int_equal(jint(m, "params"), 148);
  json_t *job = json_object_get(j, "job");
  assert_int_equal(jint(job, "world_size"), 4);
  assert_string_equal(jstr(job, "strategy"), "HYBRID_SHARD");
  json_t *ranks = json_object_get(j, "ranks");
  assert_int_equal(jint(ranks, "never_attached"), 4);
  assert_int_equal(jint(ranks, "attached"), 0);
  assert_int_equal(jint(j, "alerts"), 0);
  json_decref(j);
  done(&r);
  r = run("status", NULL);
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "4 never attached"));
  assert_non_null(strstr(r.out, "HYBRID_SHARD (shard groups of 2)"));
  done(&r);
}

/* The coordinator's plan prints as the same plan computed offline. */
static void test_plan_matches_offline(void **state) {
  (void)state;
  result r = run("plan", "--rank", "1", "--json", NULL);
  assert_int_equal(r.code, 0);
  json_t *remote = parse(&r);
  done(&r);
  r = run("plan", "--model", MODEL("gpt2"), "--world-size", "4", "--strategy",
          "HYBRID_SHARD", "--shard-group-size", "2", "--wrap-type", "GPT2Block",
          "--rank", "1", "--json", NULL);
  assert_int_equal(r.code, 0);
  json_t *offline = parse(&r);
  done(&r);
  json_t *shard = json_object_get(remote, "shard");
  assert_int_equal(json_array_size(shard), 13);
  assert_int_equal(json_array_size(json_object_get(remote, "buffers")), 24);
  json_t *aliases = json_object_get(remote, "aliases");
  assert_int_equal(json_array_size(aliases), 1);
  assert_string_equal(jstr(json_array_get(aliases, 0), "fqn"),
                      "lm_head.weight");
  /* only the source differs: a spec path here, a coordinator there */
  json_t *rm = json_object_get(remote, "model");
  assert_true(json_is_null(json_object_get(rm, "path")));
  assert_string_equal(jstr(rm, "coordinator"), g_addr);
  json_object_del(remote, "model");
  json_object_del(offline, "model");
  assert_true(json_equal(remote, offline));
  json_decref(remote);
  json_decref(offline);

  /* the memory model: the coordinator's answer for the same options is
   * the offline one */
  r = run("plan", "--memory", "--optimizer", "sgd-momentum", "--no-sync",
          "--json", NULL);
  assert_int_equal(r.code, 0);
  remote = parse(&r);
  done(&r);
  r = run("plan", "--model", MODEL("gpt2"), "--world-size", "4", "--strategy",
          "HYBRID_SHARD", "--shard-group-size", "2", "--wrap-type", "GPT2Block",
          "--memory", "--optimizer", "sgd-momentum", "--no-sync", "--json",
          NULL);
  assert_int_equal(r.code, 0);
  offline = parse(&r);
  done(&r);
  json_t *mem = json_object_get(remote, "memory");
  assert_string_equal(jstr(mem, "optimizer"), "sgd-momentum");
  assert_true(json_is_true(json_object_get(mem, "no_sync")));
  assert_true(jint(json_object_get(mem, "total"), "peak") > 0);
  /* the trainer's activations need the spec, which the coordinator's plan
   * does not carry: counted offline only, and the remote answer says so */
  json_t *omem = json_object_get(offline, "memory");
  assert_true(json_is_null(json_object_get(mem, "trainer")));
  assert_non_null(
      strstr(jstr(mem, "trainer_not_counted"), "give --model M.json"));
  assert_string_equal(jstr(json_object_get(omem, "trainer"), "family"),
                      "gpt2");
  assert_true(json_integer_value(json_object_get(omem, "peak")) >
              json_integer_value(json_object_get(mem, "peak")));
  for (int i = 0; i < 2; i++) {
    json_t *m = i ? omem : mem;
    json_object_del(m, "trainer");
    json_object_del(m, "trainer_not_counted");
    json_object_del(m, "peak");
  }
  json_object_del(remote, "model");
  json_object_del(offline, "model");
  assert_true(json_equal(remote, offline));
  json_decref(remote);
  json_decref(offline);
  r = run("plan", "--memory", "--optimizer", "lion", NULL);
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "lion"));
  done(&r);
  r = run("plan", "--memory", "--seq-len", "128", NULL);
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--seq-len sizes the trainer's activations"));
  done(&r);

  r = run("plan", "--unit", "transformer.h.0", NULL);
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "unit 1 (transformer.h.0)"));
  assert_non_null(strstr(r.out, "coordinator"));
  done(&r);
  r = run("plan", "--rank", "4", NULL);
  assert_int_equal(r.code, 3);
  assert_non_null(strstr(r.err, "--rank 4"));
  done(&r);
  r = run("plan", "--unit", "nope", NULL);
  assert_int_equal(r.code, 3);
  done(&r);
  r = run("plan", "--world-size", "2", NULL); /* job flags need --model */
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--model"));
  done(&r);
}

static void test_where(void **state) {
  (void)state;
  /* unit 4's flat parameter is split in two shards; each shard is held by
   * one rank of each shard group: shard s by ranks s and s+2 */
  result r = run("where", "transformer.h.3.mlp.c_fc.weight", "--json", NULL);
  assert_int_equal(r.code, 0);
  json_t *j = parse(&r);
  assert_int_equal(jint(j, "unit"), 4);
  assert_false(json_is_true(json_object_get(j, "is_alias")));
  json_t *slices = json_object_get(j, "slices");
  assert_int_equal(json_array_size(slices), 2);
  json_int_t total = 0;
  for (size_t s = 0; s < 2; s++) {
    json_t *sl = json_array_get(slices, s);
    json_t *ranks = json_object_get(sl, "ranks");
    assert_int_equal(jint(sl, "shard"), s);
    assert_int_equal(json_array_size(ranks), 2);
    assert_int_equal(json_integer_value(json_array_get(ranks, 0)), s);
    assert_int_equal(json_integer_value(json_array_get(ranks, 1)), s + 2);
    total += jint(sl, "numel");
  }
  assert_int_equal(total, jint(j, "numel"));
  assert_int_equal(total, 768 * 3072);
  json_decref(j);
  done(&r);

  /* the tied head resolves to the embedding it shares */
  r = run("where", "lm_head.weight", "--json", NULL);
  assert_int_equal(r.code, 0);
  j = parse(&r);
  assert_true(json_is_true(json_object_get(j, "is_alias")));
  assert_string_equal(jstr(j, "flattened_as"), "transformer.wte.weight");
  assert_int_equal(jint(j, "unit"), 0);
  json_decref(j);
  done(&r);
  r = run("where", "lm_head.weight", NULL);
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "tied: flattened as transformer.wte.weight"));
  assert_non_null(strstr(r.out, "1,3"));
  done(&r);

  r = run("where", "foo", NULL);
  assert_int_equal(r.code, 3);
  assert_non_null(strstr(r.err,
                         "shardplane where: no parameter \"foo\" "
                         "(NOT_FOUND)"));
  done(&r);
}

/* ResNet-50 with bfloat16 buffers: BatchNorm units stay in full precision,
 * so their float buffers keep float32; the step counters stay int64. */
static void test_buffers(void **state) {
  (void)state;
  char addr[64];
  char *extra[] = {
      "--model",  MODEL("resnet50"), "--world-size", "2", "--param-dtype",
      "bfloat16", "--buffer-dtype",  "bfloat16",     NULL};
  pid_t pid = start_coordinator(extra, addr, sizeof addr);
  result r = run("buffers", "--json", "--coordinator", addr, NULL);
  int code = r.code;
  json_t *j = code == 0 ? parse(&r) : NULL;
  done(&r);
  r = run("buffers", "--prefix", "layer1.0.bn1.", "--coordinator", addr, NULL);
  int code_prefix = r.code;
  bool has_rows = strstr(r.out, "layer1.0.bn1.num_batches_tracked") &&
                  strstr(r.out, "layer1.0.bn1.running_var");
  done(&r);
  int stop = stop_coordinator(pid);
  assert_int_equal(code, 0);
  assert_int_equal(code_prefix, 0);
  assert_true(has_rows);
  assert_int_equal(jint(j, "total"), 159);
  json_t *bufs = json_object_get(j, "buffers");
  assert_int_equal(json_array_size(bufs), 159);
  size_t i, counters = 0;
  json_t *b;
  json_array_foreach(bufs, i, b) {
    const char *fqn = jstr(b, "fqn");
    if (strstr(fqn, "num_batches_tracked")) {
      assert_string_equal(jstr(b, "original_dtype"), "int64");
      assert_string_equal(jstr(b, "compute_dtype"), "int64");
      counters++;
    } else {
      assert_string_equal(jstr(b, "original_dtype"), "float32");
      assert_string_equal(jstr(b, "compute_dtype"), "float32");
    }
  }
  assert_int_equal(counters, 53);
  json_decref(j);
  assert_true(stop >= 0 && WIFEXITED(stop));
  assert_int_equal(WEXITSTATUS(stop), 0);
}

/* A world of more than one ListRanks page (4,096 ranks) is read page by
 * page: every rank once, in order, so that the table folds them into one
 * range. (Ranks that never attached are small: 10,000 of them also fit in
 * one answer, as an old coordinator would give them.) */
static void test_ranks_in_pages(void **state) {
  (void)state;
  char addr[64];
  char *extra[] = {"--model", MODEL("gpt2"), "--world-size",
                   "10000",   "--wrap-type", "GPT2Block",
                   NULL};
  pid_t pid = start_coordinator(extra, addr, sizeof addr);
  result r = run("ranks", "--unit-states", "--coordinator", addr, NULL);
  int code = r.code;
  bool one_range = strstr(r.out, "\n0-9999 ") != NULL;
  if (code != 0 || !one_range) printf("%s%s", r.out, r.err);
  done(&r);
  int stop = stop_coordinator(pid);
  assert_int_equal(code, 0);
  assert_true(one_range);
  assert_true(stop >= 0 && WIFEXITED(stop));
  assert_int_equal(WEXITSTATUS(stop), 0);
}

static void test_store(void **state) {
  (void)state;
  result r = run("store", "set", "cli/greeting", "hello world", NULL);
  assert_int_equal(r.code, 0);
  done(&r);
  r = run("store", "get", "cli/greeting", NULL);
  assert_int_equal(r.code, 0);
  assert_string_equal(r.out, "hello world\n");
  done(&r);
  r = run("store", "get", "cli/greeting", "--json", NULL);
  assert_int_equal(r.code, 0);
  json_t *j = parse(&r);
  assert_string_equal(jstr(j, "value"), "hello world");
  json_decref(j);
  done(&r);
  r = run("store", "add", "cli/counter", "5", NULL);
  assert_int_equal(r.code, 0);
  assert_string_equal(r.out, "5\n");
  done(&r);
  r = run("store", "add", "cli/counter", "--", "-2", NULL);
  assert_int_equal(r.code, 0);
  assert_string_equal(r.out, "3\n");
  done(&r);
  r = run("store", "get", "cli/counter", NULL);
  assert_string_equal(r.out, "3\n");
  done(&r);
  /* the options before the operation, as README's order has it */
  r = run("store", "--coordinator", g_addr, "add", "cli/counter", "--", "-1",
          NULL);
  assert_int_equal(r.code, 0);
  assert_string_equal(r.out, "2\n");
  done(&r);
  r = run("store", "--insecure", "get", "cli/counter", NULL);
  assert_int_equal(r.code, 0);
  assert_string_equal(r.out, "2\n");
  done(&r);
  /* after "--" an option is a word: one line says so, and where they go */
  r = run("store", "add", "cli/counter", "--", "-1", "--coordinator", g_addr,
          NULL);
  assert_int_equal(r.code, 2);
  assert_string_equal(r.err,
                      "shardplane store: add: unexpected argument "
                      "\"--coordinator\": after \"--\" every word is an "
                      "argument; options go before \"--\"\n"
                      "try 'shardplane store --help'\n");
  done(&r);
  r = run("store", "add", "cli/counter", NULL);
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "add: missing DELTA (store add KEY DELTA)"));
  done(&r);
  r = run("store", "--json", NULL);
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "missing the operation"));
  done(&r);
  r = run("store", "delete", "cli/counter", NULL);
  assert_int_equal(r.code, 0);
  done(&r);
  r = run("store", "get", "cli/counter", NULL);
  assert_int_equal(r.code, 3);
  assert_non_null(strstr(r.err, "no key"));
  done(&r);
  /* A wait that runs out is "not found" (3), like a get without --wait;
   * it ends at the deadline, not before and not much after. */
  r = run("store", "get", "cli/never", "--wait", "--timeout-ms", "300", NULL);
  assert_int_equal(r.code, 3);
  assert_non_null(strstr(r.err, "DEADLINE_EXCEEDED"));
  assert_true(r.ms >= 250);
  assert_true(r.ms < 10000);
  done(&r);
}

static void test_unreachable_and_usage(void **state) {
  (void)state;
  /* a port nobody listens on: bind one, then close it */
  int s = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  assert_int_equal(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  assert_int_equal(getsockname(s, (struct sockaddr *)&sa, &len), 0);
  close(s);
  char closed[64];
  snprintf(closed, sizeof closed, "127.0.0.1:%u", ntohs(sa.sin_port));
  result r =
      run("status", "--coordinator", closed, "--timeout-ms", "300", NULL);
  assert_int_equal(r.code, 4);
  assert_non_null(strstr(r.err, closed));
  done(&r);
  r = run("store", "get", "k", "--wait", "--coordinator", closed,
          "--timeout-ms", "300", NULL);
  assert_int_equal(r.code, 4); /* not 3: nobody answered at all */
  done(&r);
  /* every remote command: 4 and one line saying so (trace, which asks
   * for the plan first, said it twice and exited 1) */
  static const char *const cmds[][3] = {
      {"trace", "--rank", "0"}, {"analyze", NULL, NULL},
      {"why", NULL, NULL},      {"incarnations", NULL, NULL},
      {"ranks", NULL, NULL},    {"where", "x", NULL},
  };
  for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
    r = run(cmds[i][0], "--coordinator", closed, "--timeout-ms", "300",
            cmds[i][1], cmds[i][2], NULL);
    size_t lines = 0;
    for (const char *c = r.err; *c; c++) lines += *c == '\n';
    if (r.code != 4 || lines != 1)
      fail_msg("%s against a closed port: exit %d:\n%s", cmds[i][0], r.code,
               r.err);
    done(&r);
  }

  const char *usage[][6] = {
      {"where", NULL},
      {"status", "extra", NULL},
      {"status", "--bogus", NULL},
      {"status", "--timeout-ms", "0", NULL},
      {"status", "--coordinator", "no-port", NULL},
      {"store", "add", "k", "x", NULL},
      {"store", "frobnicate", NULL},
      {"store", "get", "k", "--absent", NULL},
      {"watch", "--kind", "nope", NULL},
      {"ranks", "--json", "x", NULL},
  };
  for (size_t i = 0; i < sizeof usage / sizeof usage[0]; i++) {
    r = run(usage[i][0], usage[i][1], usage[i][2], usage[i][3], usage[i][4],
            NULL);
    if (r.code != 2)
      fail_msg("shardplane %s %s: exit %d, want 2", usage[i][0],
               usage[i][1] ? usage[i][1] : "", r.code);
    done(&r);
  }
  /* watch's flag errors read as every other: the flag, the value, what
   * is allowed */
  static const char *const watch_flags[][3] = {
      {"--kind", "nope",
       "--kind \"nope\": expected one of attached, lost, "
       "detached, transition, alert"},
      {"--count", "0", "--count \"0\": expected a positive integer"},
      {"--rank", "x", "--rank \"x\": expected an integer in [0, "},
  };
  for (size_t i = 0; i < sizeof watch_flags / sizeof watch_flags[0]; i++) {
    r = run("watch", watch_flags[i][0], watch_flags[i][1], NULL);
    if (r.code != 2 || strstr(r.err, watch_flags[i][2]) == NULL)
      fail_msg("watch %s %s: exit %d: %s", watch_flags[i][0], watch_flags[i][1],
               r.code, r.err);
    done(&r);
  }
  /* a rank outside the world is not found, as with `plan --rank` */
  r = run("watch", "--rank", "9", NULL);
  assert_int_equal(r.code, 3);
  done(&r);
  r = run("where", "--help", NULL);
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "--coordinator"));
  done(&r);
}

/* ---- a worker's side, through the blocking client ---- */

static ProtobufCMessage *unary(sp_rpc_sync *c, const char *method,
                               const ProtobufCMessage *req,
                               const ProtobufCMessageDescriptor *desc) {
  ProtobufCMessage *resp = NULL;
  sp_rpc_status st;
  assert_int_equal(sp_rpc_sync_unary(c, method, req, desc, 5000, &resp, &st),
                   0);
  if (st.code != SP_RPC_OK)
    fail_msg("%s: %s (%s)", method, st.message, sp_rpc_code_name(st.code));
  return resp;
}

static char *attach(sp_rpc_sync *c, const char *version) {
  Shardplane__V1__AttachRequest q = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
  q.rank = 0;
  q.world_size = 4;
  q.host = "testhost";
  q.pid = (uint32_t)getpid();
  q.device = "cpu";
  q.plan_version = (char *)version;
  Shardplane__V1__AttachResponse *a = (Shardplane__V1__AttachResponse *)unary(
      c, METHOD("Attach"), &q.base,
      &shardplane__v1__attach_response__descriptor);
  char *id = strdup(a->session_id);
  protobuf_c_message_free_unpacked(&a->base, NULL);
  return id;
}

static void detach(sp_rpc_sync *c, const char *session) {
  Shardplane__V1__DetachRequest q = SHARDPLANE__V1__DETACH_REQUEST__INIT;
  q.rank = 0;
  q.session_id = (char *)session;
  protobuf_c_message_free_unpacked(
      unary(c, METHOD("Detach"), &q.base,
            &shardplane__v1__detach_response__descriptor),
      NULL);
}

static void report(sp_rpc_sync *c, const char *session, int root_state) {
  Shardplane__V1__Transition t = SHARDPLANE__V1__TRANSITION__INIT;
  t.machine = SHARDPLANE__V1__MACHINE__MACHINE_ROOT;
  t.state = root_state;
  t.step = 1;
  Shardplane__V1__ReportTransitionRequest q =
      SHARDPLANE__V1__REPORT_TRANSITION_REQUEST__INIT;
  q.rank = 0;
  q.session_id = (char *)session;
  q.transition = &t;
  protobuf_c_message_free_unpacked(
      unary(c, METHOD("ReportTransition"), &q.base,
            &shardplane__v1__report_transition_response__descriptor),
      NULL);
}

/* Nothing says when the coordinator has registered a watch, so the worker
 * side repeats its event (kick) until the watcher has printed one and
 * exited (--count 1). Returns the watcher's exit status. */
static int watch_one(char *const argv[], const char *out,
                     void (*kick)(sp_rpc_sync *, void *), sp_rpc_sync *c,
                     void *arg) {
  char err[1100]; /* out is at most 1024 bytes */
  snprintf(err, sizeof err, "%s.err", out);
  pid_t pid = spawn(argv, out, err, NULL);
  int64_t end = now_ms() + CHILD_TIMEOUT_MS;
  int st = -1;
  while (now_ms() < end) {
    kick(c, arg);
    pid_t w = 0;
    for (int i = 0; i < 100 && (w = waitpid(pid, &st, WNOHANG)) == 0; i++)
      sp_test_sleep_ms(3);
    if (w == pid) return st;
  }
  return wait_child(pid, 1);
}

/* The watcher exited 0; else its stderr says why. */
static void expect_watch_ok(int st, const char *out) {
  if (st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0) return;
  char err[1100]; /* out is at most 1024 bytes */
  snprintf(err, sizeof err, "%s.err", out);
  char *text = sp_test_read_file(err);
  fail_msg("watch: status 0x%x: %s", (unsigned)st, text);
}

typedef struct worker {
  const char *version;
  char *session;
  int state; /* root state to report next */
} worker;

/* detach (if attached) and attach again: one RANK_ATTACHED event */
static void kick_attach(sp_rpc_sync *c, void *arg) {
  worker *w = arg;
  if (w->session != NULL) detach(c, w->session);
  free(w->session);
  w->session = attach(c, w->version);
}

/* IDLE -> FORWARD_BACKWARD -> IDLE ...: one TRANSITION event each */
static void kick_transition(sp_rpc_sync *c, void *arg) {
  worker *w = arg;
  report(c, w->session, w->state);
  w->state = w->state == 2 ? 1 : 2;
}

static void test_watch(void **state) {
  (void)state;
  sp_rpc_sync *c;
  assert_int_equal(sp_rpc_sync_open(g_addr, 5000, &c), 0);
  Shardplane__V1__GetJobRequest gq = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  Shardplane__V1__GetJobResponse *job = (Shardplane__V1__GetJobResponse *)unary(
      c, METHOD("GetJob"), &gq.base,
      &shardplane__v1__get_job_response__descriptor);
  worker w = {job->plan_version, NULL, 2};

  char out[1024];
  snprintf(out, sizeof out, "%s/watch", g_dir);
  char *argv[] = {CLI_BIN,  "watch",    "--insecure", "--count", "1",
                  "--kind", "attached", "--json",     NULL};
  int st = watch_one(argv, out, kick_attach, c, &w);
  expect_watch_ok(st, out);
  char *text = sp_test_read_file(out);
  size_t lines = 0;
  for (const char *p = text; *p; p++) lines += *p == '\n';
  assert_int_equal(lines, 1); /* --count 1: one event, one line */
  json_t *ev = json_loads(text, JSON_DISABLE_EOF_CHECK, NULL);
  if (ev == NULL) fail_msg("not a JSON line: %s", text);
  assert_string_equal(jstr(ev, "kind"), "RANK_ATTACHED");
  assert_int_equal(jint(ev, "rank"), 0);
  assert_non_null(strstr(jstr(ev, "message"), "testhost"));
  json_decref(ev);
  free(text);

  /* the human line of a transition, filtered to rank 0 */
  char *targv[] = {CLI_BIN,   "watch",      "--insecure", "--transitions",
                   "--kind",  "transition", "--rank",     "0",
                   "--count", "1",          NULL};
  st = watch_one(targv, out, kick_transition, c, &w);
  expect_watch_ok(st, out);
  text = sp_test_read_file(out);
  assert_non_null(strstr(text, "rank 0"));
  assert_non_null(strstr(text, "TRANSITION"));
  assert_non_null(strstr(text, "root -> "));
  free(text);

  /* the attached rank shows in status and ranks */
  result r = run("status", "--json", NULL);
  assert_int_equal(r.code, 0);
  json_t *j = parse(&r);
  assert_int_equal(jint(json_object_get(j, "ranks"), "attached"), 1);
  json_decref(j);
  done(&r);
  r = run("ranks", "--unit-states", NULL);
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "testhost"));
  assert_non_null(strstr(r.out, "1-3"));       /* the ranks never attached */
  assert_non_null(strstr(r.out, "IDLE 0-12")); /* every unit idle */
  done(&r);

  detach(c, w.session);
  free(w.session);
  protobuf_c_message_free_unpacked(&job->base, NULL);
  sp_rpc_sync_close(c);
}

/* A healthy job has no events for a long time: watch says at once what
 * it watches and that it waits, rather than printing nothing. */
static void test_watch_says_it_waits(void **state) {
  (void)state;
  char out[1024], err[1100];
  snprintf(out, sizeof out, "%s/watch-idle", g_dir);
  snprintf(err, sizeof err, "%s.err", out);
  char *argv[] = {CLI_BIN, "watch", "--insecure", NULL};
  pid_t pid = spawn(argv, out, err, NULL);
  char *text = NULL;
  int64_t end = now_ms() + CHILD_TIMEOUT_MS;
  while (now_ms() < end) {
    free(text);
    text = access(out, F_OK) == 0 ? sp_test_read_file(out) : NULL;
    if (text != NULL && strstr(text, "Ctrl-C stops\n") != NULL) break;
    sp_test_sleep_ms(20);
  }
  kill(pid, SIGINT);
  int st = wait_child(pid, CHILD_TIMEOUT_MS);
  printf("%s", text ? text : "(nothing)\n");
  assert_non_null(text);
  char head[256];
  snprintf(head, sizeof head, "coordinator %s, job WAITING: step ", g_addr);
  assert_non_null(strstr(text, head));
  assert_non_null(strstr(text, ", 0 of 4 ranks attached\n"));
  assert_non_null(strstr(text,
                         "waiting for events (attached, lost, "
                         "detached, alert of every rank); times UTC"));
  free(text);
  assert_true(st >= 0 && WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
}

/* An alert's time in status is on the wall clock (UTC, as watch prints
 * it), not the coordinator's uptime at the alert. */
static void test_status_alert_times(void **state) {
  (void)state;
  char addr[64];
  char *extra[] = {"--model", MODEL("gpt2"), "--world-size",
                   "4",       "--wrap-type", "GPT2Block",
                   NULL};
  pid_t coord = start_coordinator(extra, addr, sizeof addr);
  sp_rpc_sync *c;
  assert_int_equal(sp_rpc_sync_open(addr, 5000, &c), 0);
  Shardplane__V1__GetJobRequest gq = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  Shardplane__V1__GetJobResponse *job = (Shardplane__V1__GetJobResponse *)unary(
      c, METHOD("GetJob"), &gq.base,
      &shardplane__v1__get_job_response__descriptor);
  char *session = attach(c, job->plan_version);
  /* unit 0 from IDLE straight to BACKWARD_POST: an ILLEGAL_TRANSITION
   * alert */
  Shardplane__V1__Transition t = SHARDPLANE__V1__TRANSITION__INIT;
  t.machine = SHARDPLANE__V1__MACHINE__MACHINE_HANDLE;
  t.state = 4;
  t.step = 1;
  Shardplane__V1__ReportTransitionRequest q =
      SHARDPLANE__V1__REPORT_TRANSITION_REQUEST__INIT;
  q.session_id = session;
  q.transition = &t;
  ProtobufCMessage *resp = NULL;
  sp_rpc_status rst;
  assert_int_equal(
      sp_rpc_sync_unary(c, METHOD("ReportTransition"), &q.base,
                        &shardplane__v1__report_transition_response__descriptor,
                        5000, &resp, &rst),
      0);
  if (resp != NULL) protobuf_c_message_free_unpacked(resp, NULL);
  int64_t now_s = (int64_t)time(NULL);
  result r = run("status", "--coordinator", addr, NULL);
  result rj = run("status", "--coordinator", addr, "--json", NULL);
  detach(c, session);
  free(session);
  protobuf_c_message_free_unpacked(&job->base, NULL);
  sp_rpc_sync_close(c);
  assert_true(stop_coordinator(coord) >= 0);
  printf("%s", r.out);
  assert_int_equal(rst.code, SP_RPC_FAILED_PRECONDITION);
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out,
                         "alerts      1 (the last 1 below, times "
                         "UTC)\n"));
  const char *line = strstr(r.out, "UTC)\n");
  unsigned hh, mm, ss, us, rank;
  assert_int_equal(sscanf(line + 5, "  %2u:%2u:%2u.%6u  rank %u ", &hh, &mm,
                          &ss, &us, &rank),
                   5);
  assert_int_equal(rank, 0);
  int64_t at = hh * 3600 + mm * 60 + ss, day = now_s % 86400;
  int64_t off = llabs((long long)(at - day));
  if (off > 43200) off = 86400 - off; /* across midnight */
  if (off > 60)
    fail_msg(
        "alert at %02u:%02u:%02u UTC, now %lld s into the "
        "day",
        hh, mm, ss, (long long)day);
  assert_int_equal(rj.code, 0);
  json_t *j = parse(&rj);
  json_t *a = json_array_get(json_object_get(j, "recent_alerts"), 0);
  assert_non_null(a);
  json_int_t t_us = jint(a, "time_us");
  if (llabs((long long)(t_us / 1000000 - now_s)) > 60)
    fail_msg("time_us %lld, now %lld s", (long long)t_us, (long long)now_s);
  json_decref(j);
  done(&r);
  done(&rj);
}

/* ---- what `ranks` says after a job ---- */

/* A coordinator for model (plus extra, NULL-terminated) and world
 * shardplane-worker processes training steps steps (the synthetic-
 * gradient cycle with `synthetic`); returns once every worker exited 0,
 * with the coordinator still serving (stop it). Rank 0's stdout goes to
 * g_dir/rank0.out. */
static pid_t job_to_the_end(const char *model, char *const extra[], int world,
                            const char *steps, bool synthetic, char *addr,
                            size_t cap) {
  char *argv[32] = {"--model", (char *)model};
  size_t n = 2;
  for (size_t i = 0; extra[i] != NULL && n < 31; i++) argv[n++] = extra[i];
  argv[n] = NULL;
  pid_t coord = start_coordinator(argv, addr, cap);
  pid_t w[4];
  char out[1024], err[1024];
  for (int r = 0; r < world; r++) {
    char rank[8];
    snprintf(rank, sizeof rank, "%d", r);
    char *wa[] = {SP_BIN_DIR "/shardplane-worker",
                  "--coordinator",
                  addr,
                  "--insecure",
                  "--rank",
                  rank,
                  "--steps",
                  (char *)steps,
                  "--checkpoint",
                  "none",
                  synthetic ? "--synthetic" : NULL,
                  NULL};
    snprintf(out, sizeof out, "%s/rank%d.out", g_dir, r);
    snprintf(err, sizeof err, "%s/rank%d.err", g_dir, r);
    w[r] = spawn(wa, out, err, NULL);
  }
  for (int r = 0; r < world; r++) {
    int st = wait_child(w[r], 60000);
    if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      snprintf(err, sizeof err, "%s/rank%d.err", g_dir, r);
      char *e = sp_test_read_file(err);
      stop_coordinator(coord);
      fail_msg("rank %d: status %d: %s", r, st, e);
    }
  }
  return coord;
}

/* After a job of 3 steps `ranks` says step 3, the number of the worker's
 * last "step 3/3" line; a collective's count is elements per rank (the
 * shard a reduce-scatter leaves each rank, as the workers' errors count),
 * not the elements of all ranks. */
static void test_ranks_after_a_job(void **state) {
  (void)state;
  char addr[64];
  char *mlp_flags[] = {"--world-size", "3", NULL};
  pid_t coord = job_to_the_end(SP_EXAMPLES "/mlp.json", mlp_flags, 3, "3",
                               false, addr, sizeof addr);
  char path[1024];
  snprintf(path, sizeof path, "%s/rank0.out", g_dir);
  char *progress = sp_test_read_file(path);
  result r = run("ranks", "--coordinator", addr, "--json", NULL);
  assert_true(stop_coordinator(coord) >= 0);
  printf("%s", progress);
  assert_non_null(strstr(progress, "step 3/3"));
  free(progress);
  assert_int_equal(r.code, 0);
  json_t *j = parse(&r);
  json_t *ranks = json_object_get(j, "ranks");
  assert_int_equal(json_array_size(ranks), 3);
  for (size_t i = 0; i < 3; i++) {
    json_int_t step = jint(json_array_get(ranks, i), "step");
    if (step != 3)
      fail_msg("rank %zu: STEP %lld after 3 steps", i, (long long)step);
  }
  json_decref(j);
  done(&r);

  /* a spec the worker cannot compute, with --synthetic: the synthetic
   * cycle ends each step with the root unit's reduce-scatter */
  const char *tiny =
      "{\"format\":\"shardplane.model/v1\",\"name\":\"tiny\",\"modules\":"
      "[{\"fqn\":\"\",\"type\":\"Net\"},{\"fqn\":\"a\",\"type\":"
      "\"Block\"}],\"params\":[{\"fqn\":\"a.w\",\"shape\":[10,3],"
      "\"dtype\":\"float32\"},{\"fqn\":\"c\",\"shape\":[5],\"dtype\":"
      "\"float32\"}]}";
  snprintf(path, sizeof path, "%s/tiny.json", g_dir);
  sp_test_write_file(path, tiny, strlen(tiny));
  char *tiny_flags[] = {"--world-size", "3", "--wrap-type", "Block", NULL};
  coord = job_to_the_end(path, tiny_flags, 3, "2", true, addr, sizeof addr);
  r = run("ranks", "--coordinator", addr, "--json", NULL);
  result text = run("ranks", "--coordinator", addr, NULL);
  assert_true(stop_coordinator(coord) >= 0);
  result plan = run("plan", "--model", path, "--world-size", "3", "--wrap-type",
                    "Block", "--json", NULL);
  assert_int_equal(plan.code, 0);
  json_t *pj = parse(&plan);
  json_int_t shard =
      jint(json_array_get(json_object_get(pj, "units"), 0), "shard_numel");
  json_int_t numel =
      jint(json_array_get(json_object_get(pj, "units"), 0), "numel");
  json_decref(pj);
  done(&plan);
  assert_int_equal(r.code, 0);
  j = parse(&r);
  printf("%s", text.out);
  ranks = json_object_get(j, "ranks");
  for (size_t i = 0; i < 3; i++) {
    json_t *k = json_array_get(ranks, i);
    assert_int_equal(jint(k, "step"), 2);
    json_t *c = json_object_get(k, "last_collective");
    assert_string_equal(jstr(c, "op"), "REDUCE_SCATTER");
    assert_int_equal(jint(c, "unit"), 0);
    if (jint(c, "count") != shard)
      fail_msg(
          "rank %zu: count %lld; the root unit has %lld elements, %lld "
          "per rank",
          i, (long long)jint(c, "count"), (long long)numel, (long long)shard);
  }
  char want[64];
  snprintf(want, sizeof want, "REDUCE_SCATTER unit 0 float32 count %lld",
           (long long)shard);
  assert_non_null(strstr(text.out, want));
  /* a long last collective widens its column: every row ends where the
   * header does (SCORE is right-aligned), the columns after it aligned */
  size_t header = strcspn(text.out, "\n");
  for (const char *l = text.out + header + 1; *l; l += strcspn(l, "\n") + 1)
    if (strcspn(l, "\n") != header)
      fail_msg("a row of %zu columns under a header of %zu:\n%s",
               strcspn(l, "\n"), header, text.out);
  json_decref(j);
  done(&r);
  done(&text);
}

/* Four ranks of the same work on one machine score about 1.00, the
 * median rank's score, as `ranks --help` says: not 2 and more. */
static void test_ranks_scores_of_equal_ranks(void **state) {
  (void)state;
  char addr[64];
  char *flags[] = {"--world-size", "4", "--wrap-type", "GPT2Block", NULL};
  pid_t coord = job_to_the_end(MODEL("gpt2-tiny"), flags, 4, "40", false, addr,
                               sizeof addr);
  result r = run("ranks", "--coordinator", addr, "--json", NULL);
  result text = run("ranks", "--coordinator", addr, NULL);
  assert_true(stop_coordinator(coord) >= 0);
  printf("%s", text.out);
  assert_int_equal(r.code, 0);
  json_t *j = parse(&r);
  json_t *ranks = json_object_get(j, "ranks");
  assert_int_equal(json_array_size(ranks), 4);
  for (size_t i = 0; i < 4; i++) {
    double score = json_real_value(
        json_object_get(json_array_get(ranks, i), "straggler_score"));
    if (!(score >= 0.5 && score <= 2.0))
      fail_msg("rank %zu of 4 equal ranks scores %.2f", i, score);
  }
  json_decref(j);
  done(&r);
  done(&text);
}

/* The hang-diagnosis commands on a live job of 2 MLP ranks: why, status,
 * ranks, trace, watch and a live analyze, text and JSON. Timing-dependent
 * verdicts (a loaded machine makes stragglers) are checked for agreement
 * between the exit code and the answer, not for one value. */
/* Also from the teardown: a failed assertion leaves them running. */
static void stop_live_job(void) {
  for (int k = 1; k < 3; k++)
    if (g_live[k] > 0) {
      kill(g_live[k], SIGKILL);
      wait_child(g_live[k], CHILD_TIMEOUT_MS);
      g_live[k] = -1;
    }
  if (g_live[0] > 0) stop_coordinator(g_live[0]);
  g_live[0] = -1;
}

static void test_diagnosis_live(void **state) {
  (void)state;
  char addr[64];
  char *cflags[] = {"--model", SP_EXAMPLES "/mlp.json", "--world-size", "2",
                    NULL};
  pid_t coord = start_coordinator(cflags, addr, sizeof addr);
  pid_t *w = &g_live[1];
  g_live[0] = coord;
  for (int k = 0; k < 2; k++) {
    char rank[8], out[1024];
    snprintf(rank, sizeof rank, "%d", k);
    snprintf(out, sizeof out, "%s/live%d.out", g_dir, k);
    char *wa[] = {SP_BIN_DIR "/shardplane-worker",
                  "--coordinator",
                  addr,
                  "--insecure",
                  "--rank",
                  rank,
                  "--steps",
                  "1000000",
                  "--checkpoint",
                  "none",
                  "--log-every",
                  "0",
                  NULL};
    w[k] = spawn(wa, out, "/dev/null", NULL);
  }
  /* both ranks past the straggler window (16 steps): step times and
   * scores exist */
  int64_t end = now_ms() + START_TIMEOUT_MS;
  json_int_t step = 0;
  while (now_ms() < end) {
    result r = run("status", "--coordinator", addr, "--json", NULL);
    if (r.code == 0) {
      json_t *j = parse(&r);
      json_t *p = json_object_get(j, "progress");
      step = json_is_object(p) ? jint(p, "step") : 0;
      json_decref(j);
    }
    done(&r);
    if (step >= 20) break;
    sp_test_sleep_ms(50);
  }
  if (step < 20) {
    stop_live_job();
    fail_msg("the job did not reach step 20 (step %lld)", (long long)step);
  }

  result r = run("why", "--coordinator", addr, "--json", NULL);
  json_t *j = parse(&r);
  bool healthy = json_is_true(json_object_get(j, "healthy"));
  size_t open = json_array_size(json_object_get(j, "open_alerts"));
  assert_string_equal(jstr(j, "state"), "RUNNING");
  assert_int_equal(r.code, open > 0 ? 5 : 0);
  if (healthy)
    assert_non_null(
        strstr(jstr(j, "headline"), "healthy: all 2 ranks at step"));
  json_decref(j);
  done(&r);
  r = run("why", "--coordinator", addr, NULL);
  assert_true(r.code == 0 || r.code == 5);
  assert_true(strlen(r.out) > 0);
  done(&r);

  r = run("status", "--coordinator", addr, NULL);
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "state       RUNNING: step "));
  done(&r);

  r = run("ranks", "--coordinator", addr, "--json", NULL);
  assert_int_equal(r.code, 0);
  j = parse(&r);
  json_t *ranks = json_object_get(j, "ranks");
  assert_int_equal(json_array_size(ranks), 2);
  for (size_t i = 0; i < 2; i++) {
    json_t *k = json_array_get(ranks, i);
    double p50 = json_real_value(json_object_get(k, "step_p50_ms"));
    double p99 = json_real_value(json_object_get(k, "step_p99_ms"));
    if (!(p50 > 0 && p99 >= p50))
      fail_msg("rank %zu: step times p50 %g p99 %g", i, p50, p99);
    assert_true(json_real_value(json_object_get(k, "straggler_score")) > 0);
    assert_false(json_is_true(json_object_get(k, "victim")));
  }
  json_decref(j);
  done(&r);
  r = run("ranks", "--coordinator", addr, NULL);
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "P50"));
  assert_non_null(strstr(r.out, "SCORE"));
  done(&r);

  /* the worker's own clock: within a minute of ours */
  int64_t now_us = (int64_t)time(NULL) * 1000000;
  r = run("trace", "--coordinator", addr, "--rank", "1", "--last", "12",
          "--json", NULL);
  assert_int_equal(r.code, 0);
  j = parse(&r);
  assert_int_equal(jint(j, "rank"), 1);
  json_t *evs = json_object_get(j, "events");
  assert_true(json_array_size(evs) > 0 && json_array_size(evs) <= 12);
  for (size_t i = 0; i < json_array_size(evs); i++) {
    json_t *e = json_array_get(evs, i);
    json_int_t t = jint(e, "t_us");
    if (llabs((long long)(t - now_us)) > 60000000LL)
      fail_msg("event %zu: t_us %lld, now %lld", i, (long long)t,
               (long long)now_us);
    if (i > 0) assert_true(t >= jint(json_array_get(evs, i - 1), "t_us"));
    const char *type = jstr(e, "type");
    assert_true(strcmp(type, "transition") == 0 ||
                strcmp(type, "collective") == 0);
  }
  json_decref(j);
  done(&r);
  r = run("trace", "--coordinator", addr, "--rank", "0", "--last", "40", NULL);
  assert_int_equal(r.code, 0);
  /* "12:03:41.123456 step 7 ..." lines, and collectives by their seq */
  char *line = strchr(r.out, '\n');
  assert_non_null(line);
  unsigned hh, mm, ss, us;
  assert_int_equal(
      sscanf(line + 1, "%2u:%2u:%2u.%6u step ", &hh, &mm, &ss, &us), 4);
  assert_non_null(strstr(r.out, " world unit "));
  assert_non_null(strstr(r.out, " float32 x "));
  done(&r);
  r = run("trace", "--coordinator", addr, NULL);
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--rank"));
  done(&r);

  r = run("watch", "--coordinator", addr, "--kind", "transition", "--count",
          "5", "--json", NULL);
  assert_int_equal(r.code, 0);
  int lines = 0;
  for (char *l = r.out; l != NULL && *l; lines++) {
    json_t *e = json_loads(l, JSON_DISABLE_EOF_CHECK, NULL);
    assert_non_null(e);
    assert_true(json_is_true(json_object_get(e, "worker_time")));
    json_int_t t = jint(e, "time_us");
    if (llabs((long long)(t - now_us)) > 60000000LL)
      fail_msg("watch: time_us %lld, now %lld", (long long)t,
               (long long)now_us);
    json_decref(e);
    l = strchr(l, '\n');
    if (l) l++;
  }
  assert_int_equal(lines, 5);
  done(&r);

  r = run("analyze", "--coordinator", addr, "--last", "50", "--json", NULL);
  j = parse(&r);
  assert_int_equal(r.code,
                   json_is_true(json_object_get(j, "diverged")) ? 5 : 0);
  assert_int_equal(json_array_size(json_object_get(j, "ranks")), 2);
  for (size_t i = 0; i < 2; i++)
    assert_true(json_is_true(json_object_get(
        json_array_get(json_object_get(j, "ranks"), i), "answered")));
  assert_true(jint(j, "collective_events") > 0);
  json_decref(j);
  done(&r);

  stop_live_job();
}

/* Before any rank attached: why says the job waits (exit 0), and the
 * diagnosis commands check their flags. */
static void test_diagnosis_waiting(void **state) {
  (void)state;
  result r = run("why", "--json", NULL);
  assert_int_equal(r.code, 0);
  json_t *j = parse(&r);
  assert_string_equal(jstr(j, "state"), "WAITING");
  json_decref(j);
  done(&r);
  r = run("trace", "--rank", "x", NULL);
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--rank"));
  done(&r);
  /* a rank the world does not have is not found (3), as plan --rank 9 */
  r = run("trace", "--rank", "5", NULL);
  assert_int_equal(r.code, 3);
  assert_string_equal(r.err,
                      "shardplane trace: --rank 5: the world has ranks 0-3\n");
  done(&r);
  r = run("analyze", "--last", "-1", NULL);
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--last"));
  done(&r);
  /* --last 0 is not "all of them", the coordinator's meaning of 0 */
  r = run("analyze", "--last", "0", NULL);
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--last \"0\""));
  done(&r);
  r = run("trace", "--rank", "0", "--last", "0", NULL);
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--last \"0\""));
  done(&r);
  /* a dump file is what the coordinator wrote: --last cannot apply */
  r = run("analyze", "dump.json", "--last", "3", NULL);
  assert_int_equal(r.code, 2);
  assert_non_null(strstr(r.err, "--last is for a live dump"));
  assert_non_null(strstr(r.err, "try 'shardplane analyze --help'"));
  done(&r);
  /* a rank that never attached has no recorder to read: the coordinator
   * answered, so a failure (1), not 4, "no coordinator answered" */
  r = run("trace", "--rank", "0", NULL);
  assert_int_equal(r.code, 1);
  assert_non_null(strstr(r.err, "rank 0 has no open session stream"));
  done(&r);
  r = run("why", "--help", NULL);
  assert_int_equal(r.code, 0);
  assert_non_null(strstr(r.out, "--token-file"));
  assert_non_null(strstr(r.out, "exit code 5"));
  /* $SHARDPLANE_TOKEN holds the token, not a file's name */
  assert_non_null(strstr(r.out, "(default: the token itself in\n"));
  done(&r);
}

/* Last: the coordinator shuts down cleanly on SIGTERM. */
static void test_coordinator_stops(void **state) {
  (void)state;
  int st = stop_coordinator(g_coord);
  g_coord = -1;
  assert_true(st >= 0);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status),
      cmocka_unit_test(test_plan_matches_offline),
      cmocka_unit_test(test_where),
      cmocka_unit_test(test_buffers),
      cmocka_unit_test(test_ranks_in_pages),
      cmocka_unit_test(test_store),
      cmocka_unit_test(test_unreachable_and_usage),
      cmocka_unit_test(test_watch),
      cmocka_unit_test(test_watch_says_it_waits),
      cmocka_unit_test(test_status_alert_times),
      cmocka_unit_test(test_ranks_after_a_job),
      cmocka_unit_test(test_ranks_scores_of_equal_ranks),
      cmocka_unit_test(test_diagnosis_waiting),
      cmocka_unit_test(test_diagnosis_live),
      cmocka_unit_test(test_coordinator_stops),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
