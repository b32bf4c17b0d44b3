/* `shardplane analyze` on dumps made here: the core (sp_analyze) on a
 * healthy job, a desync, a rank that did not issue a collective, a
 * collective every rank issued and none completed, a shard group's
 * divergence, recorders whose windows differ, a rank that did not answer,
 * and malformed dumps; then the command itself on files (exit codes, text,
 * JSON, errors naming the file). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "analyze.h"
#include "support/testutil.h"

#define CLI_BIN SP_BIN_DIR "/shardplane"
#define T0 1764590621000000ull /* a worker clock, in microseconds */

/* ---- dumps, built as the coordinator writes them ---- */

static json_t *dump_new(int world) {
  json_t *ranks = json_array();
  for (int r = 0; r < world; r++)
    json_array_append_new(
        ranks,
        json_pack("{s:i,s:s,s:s,s:i,s:i,s:s,s:i,s:{s:i,s:i,s:I,s:[]}}", "rank",
                  r, "status", "ATTACHED", "host", "h0", "pid", 1000 + r,
                  "step", 3, "root_state", "FORWARD_BACKWARD",
                  "last_heard_ms_ago", 10, "flight", "recorded", 0, "capacity",
                  1024, "time_us", (json_int_t)(T0 + 9000000), "events"));
  return json_pack("{s:s,s:I,s:s,s:{s:s,s:s,s:i,s:s,s:s,s:s},s:[],s:o}",
                   "format", "shardplane.dump/v1", "taken_unix_ms",
                   (json_int_t)(T0 / 1000 + 10000), "reason", "stall", "job",
                   "model", "gpt2", "plan_version", "0123456789abcdef",
                   "world_size", world, "strategy", "FULL_SHARD", "state",
                   "RUNNING", "verdict", "", "alerts", "ranks", ranks);
}

static json_t *events_of(json_t *d, int rank) {
  json_t *k = json_array_get(json_object_get(d, "ranks"), (size_t)rank);
  return json_object_get(json_object_get(k, "flight"), "events");
}

/* One collective event of `rank` on (comm, index); t in ms after T0. */
static void coll(json_t *d, int rank, const char *comm, int index, int seq,
                 const char *op, int unit, int count, bool completed,
                 int t_ms) {
  json_t *e = json_pack("{s:I,s:s,s:s,s:i,s:i,s:s,s:i,s:s,s:i,s:b,s:i}", "t_us",
                        (json_int_t)(T0 + (uint64_t)t_ms * 1000), "type",
                        "collective", "comm", comm, "comm_index", index, "seq",
                        seq, "op", op, "unit", unit, "dtype", "bfloat16",
                        "count", count, "completed", completed, "step", 3);
  json_object_set_new(e, "fqn",
                      json_string(unit == 0 ? "" : "transformer.h.6"));
  json_array_append_new(events_of(d, rank), e);
}

/* seq issued and completed by `rank` */
static void done_coll(json_t *d, int rank, int seq, const char *op, int unit,
                      int t_ms) {
  coll(d, rank, "world", 0, seq, op, unit, 1024, false, t_ms);
  coll(d, rank, "world", 0, seq, op, unit, 1024, true, t_ms + 2);
}

static void trans(json_t *d, int rank, int unit, const char *state, int t_ms) {
  json_array_append_new(
      events_of(d, rank),
      json_pack("{s:I,s:s,s:s,s:i,s:s,s:i}", "t_us",
                (json_int_t)(T0 + (uint64_t)t_ms * 1000), "type", "transition",
                "machine", "handle", "unit", unit, "state", state, "step", 3));
}

static int analyze(json_t *d, sp_analysis *a, sp_diag *diag) {
  char *s = json_dumps(d, JSON_COMPACT);
  assert_non_null(s);
  int rc = sp_analyze(s, strlen(s), "dump.json", NULL, 0, a, diag);
  free(s);
  return rc;
}

static char *printed(const sp_analysis *a) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  assert_non_null(f);
  sp_analysis_print(a, f);
  fclose(f);
  return text;
}

/* ---- the core ---- */

static void test_healthy(void **state) {
  (void)state;
  json_t *d = dump_new(4);
  for (int r = 0; r < 4; r++) {
    for (int s = 1; s <= 3; s++) done_coll(d, r, s, "ALL_GATHER", s, s * 10);
    trans(d, r, 3, "FORWARD", 40 + r);
  }
  sp_analysis a;
  sp_diag diag = {{0}};
  assert_int_equal(analyze(d, &a, &diag), 0);
  assert_int_equal(a.n_findings, 0);
  assert_int_equal(a.n_comms, 1);
  assert_int_equal(a.n_collectives, 24);
  assert_int_equal(a.n_ranks, 4);
  /* each rank's last event is its transition, at its own time */
  assert_non_null(strstr(a.ranks[2].text, "step 3 FORWARD unit 3"));
  char *t = printed(&a);
  assert_non_null(strstr(t, "no divergence"));
  assert_non_null(strstr(t, "model gpt2"));
  free(t);
  sp_analysis_free(&a);
  json_decref(d);
}

static void test_desync(void **state) {
  (void)state;
  json_t *d = dump_new(4);
  for (int r = 0; r < 4; r++) {
    done_coll(d, r, 1, "ALL_GATHER", 1, 10);
    /* rank 2 runs a reduce-scatter where the others all-gather */
    coll(d, r, "world", 0, 2, r == 2 ? "REDUCE_SCATTER" : "ALL_GATHER", 7, 1024,
         false, 20);
  }
  sp_analysis a;
  sp_diag diag = {{0}};
  assert_int_equal(analyze(d, &a, &diag), 0);
  assert_int_equal(a.n_findings, 1);
  const sp_finding *f = &a.findings[0];
  assert_int_equal(f->kind, SP_FINDING_DESYNC);
  assert_string_equal(f->comm, "world");
  assert_int_equal(f->seq, 2);
  assert_int_equal(f->n_culprits, 1);
  assert_int_equal(f->culprits[0], 2);
  assert_non_null(strstr(f->text,
                         "ranks 0-1,3: all-gather #2 world unit 7 "
                         "(transformer.h.6) bfloat16 x 1024"));
  assert_non_null(strstr(f->text, "rank 2: reduce-scatter #2"));
  char *t = printed(&a);
  assert_non_null(strstr(t, "world #2 (DESYNC)"));
  free(t);
  json_t *j = sp_analysis_json(&a);
  assert_true(json_is_true(json_object_get(j, "diverged")));
  json_t *jf = json_array_get(json_object_get(j, "findings"), 0);
  assert_string_equal(json_string_value(json_object_get(jf, "kind")), "DESYNC");
  assert_int_equal(
      json_integer_value(json_array_get(json_object_get(jf, "culprits"), 0)),
      2);
  json_decref(j);
  sp_analysis_free(&a);
  json_decref(d);
}

static void test_rank_missing_a_collective(void **state) {
  (void)state;
  json_t *d = dump_new(4);
  for (int r = 0; r < 4; r++) {
    done_coll(d, r, 1, "ALL_GATHER", 1, 10);
    done_coll(d, r, 2, "ALL_GATHER", 2, 20);
    /* rank 2 stops in its forward of unit 6; the others wait in #3 */
    if (r == 2)
      trans(d, r, 6, "FORWARD", 25);
    else
      coll(d, r, "world", 0, 3, "ALL_GATHER", 7, 1024, false, 30);
  }
  sp_analysis a;
  sp_diag diag = {{0}};
  assert_int_equal(analyze(d, &a, &diag), 0);
  assert_int_equal(a.n_findings, 1);
  const sp_finding *f = &a.findings[0];
  assert_int_equal(f->kind, SP_FINDING_MISSING);
  assert_int_equal(f->seq, 3);
  assert_int_equal(f->n_culprits, 1);
  assert_int_equal(f->culprits[0], 2);
  assert_non_null(strstr(f->text,
                         "ranks 0-1,3 issued all-gather #3 world "
                         "unit 7 (transformer.h.6)"));
  assert_non_null(strstr(f->text, "rank 2 did not"));
  /* where the culprit's communicator stopped for it */
  assert_non_null(strstr(f->text, "rank 2's last on world: all-gather #2"));
  assert_non_null(strstr(a.ranks[2].text, "FORWARD unit 6"));
  assert_non_null(strstr(a.ranks[0].text, "all-gather #3 world unit 7"));
  assert_non_null(strstr(a.ranks[0].text, "issued"));
  sp_analysis_free(&a);
  json_decref(d);
}

static void test_all_issued_none_completed(void **state) {
  (void)state;
  json_t *d = dump_new(3);
  for (int r = 0; r < 3; r++) {
    done_coll(d, r, 1, "ALL_GATHER", 1, 10);
    coll(d, r, "world", 0, 2, "REDUCE_SCATTER", 4, 512, false, 1000);
  }
  sp_analysis a;
  sp_diag diag = {{0}};
  assert_int_equal(analyze(d, &a, &diag), 0);
  assert_int_equal(a.n_findings, 1);
  const sp_finding *f = &a.findings[0];
  assert_int_equal(f->kind, SP_FINDING_STUCK);
  assert_int_equal(f->seq, 2);
  assert_int_equal(f->n_culprits, 3);
  assert_non_null(
      strstr(f->text, "all 3 members that answered issued reduce-scatter #2"));
  assert_non_null(strstr(f->text, "none completed"));
  /* taken 10 s after T0, issued 1 s after it */
  assert_non_null(strstr(f->text, "issued 9.0 s before the dump"));
  /* with rank 2 silent, the ranks that answered all wait: rank 2 is
   * the suspect */
  json_t *k2 = json_array_get(json_object_get(d, "ranks"), 2);
  json_object_set_new(k2, "flight", json_null());
  json_object_set_new(k2, "flight_error", json_string("no session stream"));
  sp_analysis s2;
  assert_int_equal(analyze(d, &s2, &diag), 0);
  assert_int_equal(s2.n_findings, 1);
  assert_int_equal(s2.findings[0].n_culprits, 1);
  assert_int_equal(s2.findings[0].culprits[0], 2);
  assert_non_null(
      strstr(s2.findings[0].text, "no record from rank 2: no session stream"));
  sp_analysis_free(&s2);
  /* a completed collective says how long it took */
  json_t *d2 = dump_new(1);
  done_coll(d2, 0, 1, "ALL_REDUCE", 0, 10);
  sp_analysis b;
  assert_int_equal(analyze(d2, &b, &diag), 0);
  assert_non_null(strstr(b.ranks[0].text, "completed after 2.0 ms"));
  sp_analysis_free(&b);
  json_decref(d2);
  sp_analysis_free(&a);
  json_decref(d);
}

static void test_shard_group(void **state) {
  (void)state;
  json_t *d = dump_new(4);
  json_object_set_new(json_object_get(d, "job"), "strategy",
                      json_string("HYBRID_SHARD"));
  for (int r = 0; r < 4; r++) {
    int g = r / 2;
    coll(d, r, "shard", g, 1, "ALL_GATHER", 1, 256, false, 10);
    coll(d, r, "shard", g, 1, "ALL_GATHER", 1, 256, true, 11);
    /* group 1's rank 3 never issues #2 */
    if (r != 3) coll(d, r, "shard", g, 2, "ALL_GATHER", 2, 256, r < 2, 20);
  }
  sp_analysis a;
  sp_diag diag = {{0}};
  assert_int_equal(analyze(d, &a, &diag), 0);
  assert_int_equal(a.n_comms, 2);
  assert_int_equal(a.n_findings, 1);
  const sp_finding *f = &a.findings[0];
  assert_string_equal(f->comm, "shard");
  assert_int_equal(f->comm_index, 1);
  assert_int_equal(f->kind, SP_FINDING_MISSING);
  assert_int_equal(f->culprits[0], 3);
  char *t = printed(&a);
  assert_non_null(strstr(t, "shard group 1 #2 (MISSING): rank 2 issued"));
  free(t);
  sp_analysis_free(&a);
  json_decref(d);
}

static void test_windows_and_silent_ranks(void **state) {
  (void)state;
  json_t *d = dump_new(3);
  /* rank 0's recorder kept less: its window starts at #4; rank 2 did not
   * answer. Neither is a divergence. */
  for (int s = 1; s <= 5; s++) done_coll(d, 1, s, "ALL_GATHER", s, s * 10);
  for (int s = 4; s <= 5; s++) done_coll(d, 0, s, "ALL_GATHER", s, s * 10);
  json_t *k2 = json_array_get(json_object_get(d, "ranks"), 2);
  json_object_set_new(k2, "flight", json_null());
  json_object_set_new(k2, "flight_error",
                      json_string("no answer within 2000 ms"));
  sp_analysis a;
  sp_diag diag = {{0}};
  assert_int_equal(analyze(d, &a, &diag), 0);
  assert_int_equal(a.n_findings, 0);
  assert_false(a.ranks[2].answered);
  assert_non_null(strstr(a.ranks[2].text, "no answer within 2000 ms"));
  /* a rank without a record may be the one that parted: no "none is
   * stuck" then */
  char *t = printed(&a);
  printf("%s", t);
  assert_non_null(strstr(t,
                         "no divergence in the records that came, but 1 of 3 "
                         "ranks sent none (below): what that rank issued is "
                         "not in the dump"));
  assert_null(strstr(t, "none is stuck"));
  free(t);
  json_t *js = sp_analysis_json(&a);
  assert_int_equal(
      json_integer_value(json_object_get(js, "ranks_without_record")), 1);
  json_decref(js);
  sp_analysis_free(&a);
  json_decref(d);
}

static void test_live_dump_in_flight(void **state) {
  (void)state;
  /* a dump of a moving job: #2 issued by all 10 ms before the dump, #3 by
   * rank 0 only, 5 ms before it. In flight, not a divergence. */
  json_t *d = dump_new(2);
  for (int r = 0; r < 2; r++) {
    done_coll(d, r, 1, "ALL_GATHER", 1, 10);
    coll(d, r, "world", 0, 2, "ALL_GATHER", 2, 1024, false, 9990);
  }
  coll(d, 0, "world", 0, 3, "ALL_GATHER", 3, 1024, false, 9995);
  sp_analysis a;
  sp_diag diag = {{0}};
  assert_int_equal(analyze(d, &a, &diag), 0);
  assert_int_equal(a.n_findings, 0);
  sp_analysis_free(&a);
  /* the same desynchronised is a finding however young */
  json_object_set_new(json_array_get(events_of(d, 1), 2), "count",
                      json_integer(7));
  assert_int_equal(analyze(d, &a, &diag), 0);
  assert_int_equal(a.n_findings, 1);
  assert_int_equal(a.findings[0].kind, SP_FINDING_DESYNC);
  sp_analysis_free(&a);
  json_decref(d);
}

static void test_unit_names_from_the_plan(void **state) {
  (void)state;
  json_t *d = dump_new(2);
  for (int r = 0; r < 2; r++)
    coll(d, r, "world", 0, 1, "ALL_GATHER", 1, r ? 8 : 16, false, 10);
  /* events without a module name of their own take the plan's */
  for (int r = 0; r < 2; r++)
    json_object_del(json_array_get(events_of(d, r), 0), "fqn");
  const char *const fqns[] = {"", "layers.0"};
  char *s = json_dumps(d, JSON_COMPACT);
  sp_analysis a;
  sp_diag diag = {{0}};
  assert_int_equal(sp_analyze(s, strlen(s), "live", fqns, 2, &a, &diag), 0);
  assert_int_equal(a.n_findings, 1);
  assert_non_null(strstr(a.findings[0].text, "unit 1 (layers.0)"));
  sp_analysis_free(&a);
  free(s);
  json_decref(d);
}

static void expect_error(json_t *d, const char *want) {
  sp_analysis a;
  sp_diag diag = {{0}};
  int rc = analyze(d, &a, &diag);
  assert_true(rc < 0);
  if (strstr(diag.msg, want) == NULL || strstr(diag.msg, "dump.json") == NULL)
    fail_msg("expected \"%s\" naming dump.json, got \"%s\"", want, diag.msg);
  json_decref(d);
}

static void test_malformed(void **state) {
  (void)state;
  sp_analysis a;
  sp_diag diag = {{0}};
  /* truncated */
  const char *cut = "{\"format\":\"shardplane.dump/v1\",\"ranks\":[{\"ra";
  assert_int_equal(
      sp_analyze(cut, strlen(cut), "dump.json", NULL, 0, &a, &diag),
      SP_EFORMAT);
  assert_non_null(strstr(diag.msg, "dump.json:1:"));
  json_t *d = dump_new(2);
  json_object_set_new(d, "format", json_string("shardplane.dump/v9"));
  expect_error(d, "format");
  d = dump_new(2);
  done_coll(d, 1, 1, "ALL_GATHER", 1, 10);
  json_object_set_new(json_array_get(events_of(d, 1), 0), "seq",
                      json_string("1"));
  expect_error(d, "ranks[1].flight.events[0].seq");
  d = dump_new(2);
  done_coll(d, 0, 1, "ALL_GATHER", 1, 10);
  json_object_set_new(json_array_get(events_of(d, 0), 1), "comm",
                      json_string("moon"));
  expect_error(d, "ranks[0].flight.events[1].comm");
  d = dump_new(2);
  json_object_set_new(json_array_get(json_object_get(d, "ranks"), 1), "rank",
                      json_integer(0));
  expect_error(d, "rank 0 appears twice");
  d = dump_new(1);
  json_object_del(d, "ranks");
  expect_error(d, "ranks: missing field");
}

/* ---- the command ---- */

static int run_cli(const char *dir, const char *file, bool json, char **out,
                   char **err) {
  char *o = sp_test_path(dir, "out"), *e = sp_test_path(dir, "err");
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int fo = open(o, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int fe = open(e, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fo < 0 || fe < 0 || dup2(fo, 1) < 0 || dup2(fe, 2) < 0) _exit(127);
    if (json)
      execl(CLI_BIN, CLI_BIN, "analyze", "--json", file, (char *)NULL);
    else
      execl(CLI_BIN, CLI_BIN, "analyze", file, (char *)NULL);
    _exit(127);
  }
  int st;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  *out = sp_test_read_file(o);
  *err = sp_test_read_file(e);
  free(o);
  free(e);
  assert_true(WIFEXITED(st));
  return WEXITSTATUS(st);
}

static void write_dump(const char *path, json_t *d) {
  char *s = json_dumps(d, JSON_INDENT(1));
  sp_test_write_file(path, s, strlen(s));
  free(s);
  json_decref(d);
}

static void test_command(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *bad = sp_test_path(dir, "desync.json");
  char *good = sp_test_path(dir, "healthy.json");
  char *cut = sp_test_path(dir, "cut.json");
  json_t *d = dump_new(2);
  coll(d, 0, "world", 0, 1, "ALL_GATHER", 3, 64, false, 10);
  coll(d, 1, "world", 0, 1, "ALL_GATHER", 3, 32, false, 10);
  write_dump(bad, d);
  d = dump_new(2);
  done_coll(d, 0, 1, "ALL_GATHER", 1, 10);
  done_coll(d, 1, 1, "ALL_GATHER", 1, 10);
  write_dump(good, d);
  sp_test_write_file(cut, "{\"format\":", 10);
  char *out, *err;
  assert_int_equal(run_cli(dir, bad, false, &out, &err), 5);
  assert_non_null(strstr(out, "world #1 (DESYNC)"));
  assert_non_null(strstr(out, "bfloat16 x 32"));
  free(out);
  free(err);
  assert_int_equal(run_cli(dir, bad, true, &out, &err), 5);
  json_t *j = json_loads(out, 0, NULL);
  assert_non_null(j);
  assert_true(json_is_true(json_object_get(j, "diverged")));
  json_decref(j);
  free(out);
  free(err);
  assert_int_equal(run_cli(dir, good, false, &out, &err), 0);
  assert_non_null(strstr(out, "no divergence"));
  free(out);
  free(err);
  assert_int_equal(run_cli(dir, cut, false, &out, &err), 1);
  assert_non_null(strstr(err, cut));
  assert_non_null(strstr(err, "invalid JSON"));
  free(out);
  free(err);
  free(bad);
  free(good);
  free(cut);
  sp_test_rmtree(dir);
  free(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_healthy),
      cmocka_unit_test(test_desync),
      cmocka_unit_test(test_rank_missing_a_collective),
      cmocka_unit_test(test_all_issued_none_completed),
      cmocka_unit_test(test_shard_group),
      cmocka_unit_test(test_windows_and_silent_ranks),
      cmocka_unit_test(test_live_dump_in_flight),
      cmocka_unit_test(test_unit_names_from_the_plan),
      cmocka_unit_test(test_malformed),
      cmocka_unit_test(test_command),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
