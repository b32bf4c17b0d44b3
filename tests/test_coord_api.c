/* The dashboard's JSON API (server/coord_api.h) on an in-process
 * coordinator with fake ranks (Attach and a Session stream each, driven
 * with SessionUp messages): every route's answer parses as JSON and holds
 * the job's figures; ranks paged; a rank lost names the culprit and its
 * victims; the history samples, thins when full and answers ?since; the
 * plan's units and the buffer table with original and compute dtypes;
 * bad arguments answer 400 naming the argument, unknown paths 404; a host
 * name that is not UTF-8 or holds markup comes back escaped. No timing
 * is asserted. */
#include <jansson.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cast/dtype.h"
#include "plan/state.h"
#include "server/coord_api.h"
#include "server/coord_history.h"
#include "server/coordinator.h"
#include "support/coord_fixture.h"
#include "support/fake_rank.h"
#include "support/testutil.h"

#define PATH(m) SP_COORD_PATH(m)
#define MODEL SP_TEST_DATA "/mlp_buffers.json"
#define WORLD 4
#define TOKENS 1024u
#define GIB (1024ull * 1024 * 1024)

typedef struct job {
  sp_coord_fixture fx;
  char version[SP_FAKE_VERSION_MAX];
  sp_fake_rank f[WORLD];
} job;

/* ---- the API, called on the loop thread ---- */

typedef struct api_call {
  const char *path;
  sp_coord_http_query q;
  sp_coord_http_resp r;
  int rc;
} api_call;

static void do_get(sp_coord *c, void *arg) {
  api_call *a = arg;
  a->rc = sp_coord_api_get(c, a->path, &a->q, &a->r);
}

/* GET path?k=v&... (kv: key, value pairs, NULL-terminated); the status
 * must be want; the body parsed (the caller's to json_decref). */
static json_t *get_kv(job *j, const char *path, const char *const *kv,
                      unsigned want) {
  api_call a = {.path = path};
  for (size_t i = 0; kv != NULL && kv[i] != NULL; i += 2) {
    a.q.key[a.q.n] = kv[i];
    a.q.value[a.q.n] = kv[i + 1];
    a.q.n++;
  }
  sp_coord_fixture_run(&j->fx, do_get, &a);
  assert_int_equal(a.rc, 0);
  assert_non_null(a.r.body);
  assert_false(a.r.body_static);
  assert_null(a.r.cache_control); /* live data: not stored */
  assert_string_equal(a.r.content_type, "application/json");
  assert_int_equal(strlen(a.r.body), a.r.len);
  if (a.r.status != want)
    fail_msg("%s: status %u, want %u: %s", path, a.r.status, want, a.r.body);
  json_error_t err;
  json_t *doc = json_loadb(a.r.body, a.r.len, 0, &err);
  if (doc == NULL)
    fail_msg("%s: not JSON (%s at %d): %.300s", path, err.text, err.position,
             a.r.body);
  /* nothing in an answer reads as markup */
  assert_null(strchr(a.r.body, '<'));
  free(a.r.body);
  return doc;
}

static json_t *get(job *j, const char *path) {
  return get_kv(j, path, NULL, 200);
}

/* A 400 naming arg, its message mentioning substr. */
static void expect_bad(job *j, const char *path, const char *const *kv,
                       const char *arg, const char *substr) {
  json_t *d = get_kv(j, path, kv, 400);
  const char *a = json_string_value(json_object_get(d, "argument"));
  const char *e = json_string_value(json_object_get(d, "error"));
  assert_non_null(a);
  assert_non_null(e);
  assert_string_equal(a, arg);
  if (substr != NULL && strstr(e, substr) == NULL)
    fail_msg("%s: error \"%s\" does not mention \"%s\"", path, e, substr);
  json_decref(d);
}

static json_int_t jint(const json_t *o, const char *key) {
  json_t *v = json_object_get(o, key);
  if (!json_is_integer(v)) fail_msg("%s is not an integer", key);
  return json_integer_value(v);
}

static const char *jstr(const json_t *o, const char *key) {
  json_t *v = json_object_get(o, key);
  if (!json_is_string(v)) fail_msg("%s is not a string", key);
  return json_string_value(v);
}

static json_t *jarr(const json_t *o, const char *key, size_t want_len) {
  json_t *v = json_object_get(o, key);
  if (!json_is_array(v)) fail_msg("%s is not an array", key);
  if (json_array_size(v) != want_len)
    fail_msg("%s has %zu entries, want %zu", key, json_array_size(v), want_len);
  return v;
}

static json_int_t at_int(const json_t *a, size_t i) {
  return json_integer_value(json_array_get(a, i));
}

/* ---- fake ranks ---- */

static void attach_host(job *j, uint32_t r, const char *host) {
  sp_fake_rank_attach(&j->f[r], &j->fx, j->version, r, WORLD, host);
}

/* Rank f at step, in FORWARD_BACKWARD, reporting what a trainer does:
 * loss, total steps, tokens per step and memory (rank r: r + 1 GiB now,
 * r + 2 at peak, 3 predicted). */
static void report(sp_fake_rank *f, uint64_t step) {
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  up.has_loss = true;
  up.loss = 2.5;
  up.total_steps = 100;
  up.tokens_per_step = TOKENS;
  up.mem_bytes = (f->rank + 1) * GIB;
  up.mem_peak_bytes = (f->rank + 2) * GIB;
  up.mem_predicted_bytes = 3 * GIB;
  if (step > 0)
    sp_fake_rank_transition(f, SHARDPLANE__V1__MACHINE__MACHINE_ROOT, 0,
                            SP_ROOT_FORWARD_BACKWARD, step, 0, &up);
  else /* step 0, just attached: the figures alone */
    sp_fake_rank_send_up(f, &up);
}

static void job_start(job *j) {
  const char *flags[] = {"world-size",   "4",           "wrap-type",
                         "Linear",       "param-dtype", "bfloat16",
                         "buffer-dtype", "float16",     NULL};
  memset(j, 0, sizeof *j);
  sp_fake_job_start(&j->fx, MODEL, flags, j->version, sizeof j->version, NULL);
}

static void attach_all(job *j) {
  for (uint32_t r = 0; r < WORLD; r++)
    attach_host(j, r, r < 2 ? "host-a" : "host-b");
  for (uint32_t r = 0; r < WORLD; r++) report(&j->f[r], 0);
}

static void job_stop(job *j) {
  for (uint32_t r = 0; r < WORLD; r++) sp_fake_rank_close(&j->f[r]);
  sp_coord_fixture_stop(&j->fx);
}

/* ---------------- /api/v1/job ---------------- */

static void test_job(void **state) {
  (void)state;
  job j;
  job_start(&j);
  json_t *d = get(&j, "/api/v1/job");
  assert_string_equal(jstr(d, "state"), "WAITING");
  assert_string_equal(jstr(d, "model"), "mlp_buffers");
  assert_string_equal(jstr(d, "plan_version"), j.version);
  assert_int_equal(jint(d, "world_size"), WORLD);
  assert_string_equal(jstr(d, "strategy"), "FULL_SHARD");
  assert_int_equal(jint(d, "incarnation"), 0);
  json_t *why = json_object_get(d, "why");
  assert_non_null(strstr(jstr(why, "headline"), "waiting: 0 of 4 ranks"));
  assert_int_equal(jint(json_object_get(d, "ranks"), "never_attached"), WORLD);
  assert_true(json_is_null(
      json_object_get(json_object_get(d, "progress"), "total_steps")));
  json_decref(d);

  attach_all(&j);
  for (uint32_t r = 0; r < WORLD; r++) report(&j.f[r], 3);
  /* progress follows the detectors' tick (every 200 ms) */
  for (int i = 0; i < 50; i++) {
    d = get(&j, "/api/v1/job");
    if (jint(json_object_get(d, "progress"), "step") == 3) break;
    json_decref(d);
    sp_test_sleep_ms(50);
  }
  assert_string_equal(jstr(d, "state"), "RUNNING");
  assert_true(json_is_true(json_object_get(d, "healthy")));
  json_t *p = json_object_get(d, "progress");
  assert_int_equal(jint(p, "step"), 3);
  assert_int_equal(jint(p, "total_steps"), 100);
  assert_true(json_real_value(json_object_get(p, "loss")) == 2.5 ||
              json_number_value(json_object_get(p, "loss")) == 2.5);
  assert_int_equal(jint(d, "tokens_per_step"), WORLD * TOKENS);
  assert_true(json_is_number(json_object_get(d, "tokens_per_s")));
  json_t *rk = json_object_get(d, "ranks");
  assert_int_equal(jint(rk, "attached"), WORLD);
  assert_int_equal(jint(rk, "lost"), 0);
  assert_int_equal(
      jint(json_object_get(rk, "by_root_state"), "FORWARD_BACKWARD"), WORLD);
  assert_int_equal(jint(json_object_get(rk, "by_root_state"), "IDLE"), 0);
  assert_true(jint(d, "uptime_ms") >= 0);
  assert_true(jint(d, "loop_pause_max_ms") >= 0);
  jarr(d, "open_alerts", 0);
  why = json_object_get(d, "why");
  assert_true(json_is_true(json_object_get(why, "healthy")));
  assert_non_null(strstr(jstr(why, "headline"), "healthy: all 4 ranks"));
  jarr(why, "lines", 1);
  jarr(why, "culprits", 0);
  jarr(why, "victims", 0);
  json_decref(d);
  job_stop(&j);
}

/* A rank lost: the culprit, its victims, the open alert, the verdict. */
static void test_lost_rank_named(void **state) {
  (void)state;
  job j;
  job_start(&j);
  attach_all(&j);
  for (uint32_t r = 0; r < WORLD; r++) report(&j.f[r], 2);
  /* rank 1's stream ends: lost, the job FAILED naming it */
  sp_rpc_sync_stream_close(j.f[1].s);
  j.f[1].s = NULL;
  json_t *d = NULL;
  for (int i = 0; i < 100; i++) {
    d = get(&j, "/api/v1/job");
    if (strcmp(jstr(d, "state"), "FAILED") == 0) break;
    json_decref(d);
    d = NULL;
    sp_test_sleep_ms(50);
  }
  assert_non_null(d);
  assert_false(json_is_true(json_object_get(d, "healthy")));
  assert_non_null(strstr(jstr(d, "verdict"), "rank 1 was lost"));
  json_t *open = jarr(d, "open_alerts", 1);
  json_t *a = json_array_get(open, 0);
  assert_string_equal(jstr(a, "kind"), "LOST");
  json_t *cul = jarr(a, "culprits", 1);
  assert_int_equal(at_int(cul, 0), 1);
  jarr(a, "victims", 3);
  assert_string_equal(jstr(a, "victims_text"), "ranks 0, 2, 3");
  assert_true(json_number_value(json_object_get(a, "age_s")) >= 0);
  json_t *why = json_object_get(d, "why");
  assert_non_null(strstr(jstr(why, "headline"), "failed at step"));
  cul = jarr(why, "culprits", 1);
  assert_int_equal(at_int(cul, 0), 1);
  assert_string_equal(jstr(why, "culprits_text"), "rank 1");
  json_t *vic = jarr(why, "victims", 3);
  assert_int_equal(at_int(vic, 0), 0);
  assert_int_equal(at_int(vic, 1), 2);
  assert_int_equal(jint(why, "n_victims"), 3);
  json_t *lines = json_object_get(why, "lines");
  assert_true(json_array_size(lines) >= 1);
  assert_non_null(
      strstr(json_string_value(json_array_get(lines, 0)), "LOST: rank 1"));
  assert_true(json_array_size(json_object_get(d, "recent_alerts")) >= 1);
  assert_int_equal(jint(json_object_get(d, "ranks"), "lost"), 1);
  json_decref(d);

  /* the heat map's flags */
  d = get(&j, "/api/v1/ranks");
  json_t *c = jarr(d, "culprit", WORLD), *v = jarr(d, "victim", WORLD);
  json_t *st = jarr(d, "status", WORLD);
  for (size_t r = 0; r < WORLD; r++) {
    assert_int_equal(at_int(c, r), r == 1);
    assert_int_equal(at_int(v, r), r != 1);
    assert_int_equal(at_int(st, r),
                     r == 1 ? SHARDPLANE__V1__RANK_STATUS__LOST
                            : SHARDPLANE__V1__RANK_STATUS__ATTACHED);
  }
  json_decref(d);
  job_stop(&j);
}

/* ---------------- /api/v1/ranks ---------------- */

static void test_ranks_columns_and_pages(void **state) {
  (void)state;
  job j;
  job_start(&j);
  json_t *d = get(&j, "/api/v1/ranks");
  json_t *st = jarr(d, "status", WORLD);
  for (size_t r = 0; r < WORLD; r++)
    assert_int_equal(at_int(st, r),
                     SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED);
  json_t *heard = jarr(d, "heard_ms_ago", WORLD);
  assert_int_equal(at_int(heard, 0), -1);
  json_t *host = jarr(d, "host", WORLD);
  assert_int_equal(at_int(host, 0), -1);
  jarr(d, "hosts", 0);
  json_decref(d);

  attach_all(&j);
  for (uint32_t r = 0; r < WORLD; r++) report(&j.f[r], 5 + r);
  d = get(&j, "/api/v1/ranks");
  assert_int_equal(jint(d, "world_size"), WORLD);
  assert_int_equal(jint(d, "first"), 0);
  assert_int_equal(jint(d, "count"), WORLD);
  assert_true(json_is_null(json_object_get(d, "next")));
  json_t *names = jarr(d, "status_names", 4);
  assert_string_equal(json_string_value(json_array_get(names, 1)), "ATTACHED");
  names = json_object_get(d, "state_names");
  assert_string_equal(
      json_string_value(json_array_get(names, SP_ROOT_FORWARD_BACKWARD)),
      "FORWARD_BACKWARD");
  json_t *hosts = jarr(d, "hosts", 2);
  assert_string_equal(json_string_value(json_array_get(hosts, 0)), "host-a");
  assert_string_equal(json_string_value(json_array_get(hosts, 1)), "host-b");
  host = jarr(d, "host", WORLD);
  st = jarr(d, "status", WORLD);
  json_t *rstate = jarr(d, "state", WORLD), *step = jarr(d, "step", WORLD);
  json_t *mem = jarr(d, "mem_bytes", WORLD);
  json_t *peak = jarr(d, "mem_peak_bytes", WORLD);
  json_t *pred = jarr(d, "mem_predicted_bytes", WORLD);
  json_t *strag = jarr(d, "straggler", WORLD);
  heard = jarr(d, "heard_ms_ago", WORLD);
  jarr(d, "culprit", WORLD);
  jarr(d, "victim", WORLD);
  for (size_t r = 0; r < WORLD; r++) {
    assert_int_equal(at_int(host, r), r < 2 ? 0 : 1);
    assert_int_equal(at_int(st, r), SHARDPLANE__V1__RANK_STATUS__ATTACHED);
    assert_int_equal(at_int(rstate, r), SP_ROOT_FORWARD_BACKWARD);
    assert_int_equal(at_int(step, r), 5 + r);
    assert_int_equal(at_int(mem, r), (json_int_t)((r + 1) * GIB));
    assert_int_equal(at_int(peak, r), (json_int_t)((r + 2) * GIB));
    assert_int_equal(at_int(pred, r), (json_int_t)(3 * GIB));
    assert_true(json_is_number(json_array_get(strag, r)));
    assert_true(at_int(heard, r) >= 0 && at_int(heard, r) < 60000);
  }
  json_decref(d);

  /* a page: ranks 1 and 2, the next page at 3; hosts of the page only */
  d = get_kv(&j, "/api/v1/ranks",
             (const char *const[]){"first", "1", "count", "2", NULL}, 200);
  assert_int_equal(jint(d, "first"), 1);
  assert_int_equal(jint(d, "count"), 2);
  assert_int_equal(jint(d, "next"), 3);
  step = jarr(d, "step", 2);
  assert_int_equal(at_int(step, 0), 6);
  assert_int_equal(at_int(step, 1), 7);
  hosts = jarr(d, "hosts", 2);
  host = jarr(d, "host", 2);
  assert_string_equal(json_string_value(json_array_get(hosts, 0)), "host-a");
  assert_int_equal(at_int(host, 1), 1);
  json_decref(d);
  /* a count past the end is what is left; first at the end: empty */
  d = get_kv(&j, "/api/v1/ranks",
             (const char *const[]){"first", "3", "count", "1000", NULL}, 200);
  assert_int_equal(jint(d, "count"), 1);
  assert_true(json_is_null(json_object_get(d, "next")));
  jarr(d, "mem_bytes", 1);
  json_decref(d);
  d = get_kv(&j, "/api/v1/ranks", (const char *const[]){"first", "4", NULL},
             200);
  assert_int_equal(jint(d, "count"), 0);
  jarr(d, "status", 0);
  json_decref(d);
  job_stop(&j);
}

/* A host name with markup, quotes and a control character (the engine
 * refuses one that is not UTF-8): the answer is valid JSON and the markup
 * escaped, the name unchanged once parsed. */
static void test_hostile_host_escaped(void **state) {
  (void)state;
  job j;
  job_start(&j);
  const char *host = "<b onclick=\"x\">&\x01\xe2\x82\xac\\";
  attach_host(&j, 0, host);
  json_t *d = get(&j, "/api/v1/ranks");
  json_t *hosts = jarr(d, "hosts", 1);
  assert_string_equal(json_string_value(json_array_get(hosts, 0)), host);
  json_decref(d);
  job_stop(&j);
}

/* ---------------- bad requests ---------------- */

static void test_bad_queries_and_paths(void **state) {
  (void)state;
  job j;
  job_start(&j);
  const char *ranks = "/api/v1/ranks";
  expect_bad(&j, ranks, (const char *const[]){"first", "abc", NULL}, "first",
             "not a number");
  expect_bad(&j, ranks, (const char *const[]){"first", "-1", NULL}, "first",
             "not a number");
  expect_bad(&j, ranks, (const char *const[]){"first", "", NULL}, "first",
             "not a number");
  expect_bad(&j, ranks, (const char *const[]){"first", " 1", NULL}, "first",
             NULL);
  expect_bad(&j, ranks, (const char *const[]){"first", "0x1", NULL}, "first",
             NULL);
  expect_bad(&j, ranks, (const char *const[]){"first", "5", NULL}, "first",
             "out of range");
  expect_bad(&j, ranks,
             (const char *const[]){"first", "99999999999999999999999", NULL},
             "first", "out of range");
  expect_bad(&j, ranks, (const char *const[]){"count", "0", NULL}, "count",
             "out of range");
  expect_bad(&j, ranks, (const char *const[]){"count", "1.5", NULL}, "count",
             "not a number");
  expect_bad(&j, ranks, (const char *const[]){"frist", "1", NULL}, "frist",
             "did you mean \"first\"");
  expect_bad(&j, ranks, (const char *const[]){"first", "1", "first", "2", NULL},
             "first", "twice");
  /* a value given without "=" */
  expect_bad(&j, ranks, (const char *const[]){"count", NULL, NULL}, "count",
             "not a number");
  expect_bad(&j, "/api/v1/job", (const char *const[]){"x", "1", NULL}, "x",
             "takes none");
  expect_bad(&j, "/api/v1/buffers",
             (const char *const[]){"zzzzzzzz", "1", NULL}, "zzzzzzzz",
             "it takes first, count, prefix");
  expect_bad(&j, "/api/v1/history",
             (const char *const[]){"since", "yesterday", NULL}, "since",
             "not a number");
  expect_bad(&j, "/api/v1/buffers", (const char *const[]){"first", "11", NULL},
             "first", "out of range");
  expect_bad(&j, "/api/v1/buffers", (const char *const[]){"count", "-3", NULL},
             "count", NULL);
  char *long_prefix = malloc(SP_COORD_MAX_NAME + 2);
  assert_non_null(long_prefix);
  memset(long_prefix, 'a', SP_COORD_MAX_NAME + 1);
  long_prefix[SP_COORD_MAX_NAME + 1] = '\0';
  expect_bad(&j, "/api/v1/buffers",
             (const char *const[]){"prefix", long_prefix, NULL}, "prefix",
             "at most");
  free(long_prefix);
  /* an argument echoed back: escaped, whatever its bytes */
  expect_bad(&j, ranks, (const char *const[]){"<script>\xff", "1", NULL},
             "<script>\xef\xbf\xbd", "unknown argument");

  const char *missing[] = {
      "/api/v1/nope", "/api/v1/job/", "/api/v1", "/api/v2/job", "",
      "/API/V1/JOB"};
  for (size_t i = 0; i < sizeof missing / sizeof missing[0]; i++) {
    json_t *d = get_kv(&j, missing[i], NULL, 404);
    assert_non_null(strstr(jstr(d, "error"), "no such API path"));
    json_t *paths = jarr(d, "paths", 5);
    assert_string_equal(json_string_value(json_array_get(paths, 0)),
                        "/api/v1/job");
    json_decref(d);
  }
  job_stop(&j);
}

/* ---------------- /api/v1/history ---------------- */

static void test_history_samples(void **state) {
  (void)state;
  job j;
  job_start(&j);
  attach_all(&j);
  /* the tick samples once a second: wait for two */
  json_t *d = NULL;
  for (int i = 0; i < 60; i++) {
    for (uint32_t r = 0; r < WORLD; r++) report(&j.f[r], 1 + (uint64_t)i);
    d = get(&j, "/api/v1/history");
    if (jint(d, "count") >= 2) break;
    json_decref(d);
    d = NULL;
    sp_test_sleep_ms(100);
  }
  assert_non_null(d);
  size_t n = (size_t)jint(d, "count");
  assert_int_equal(jint(d, "period_ms"), SP_COORD_HISTORY_PERIOD_MS);
  assert_int_equal(jint(d, "capacity"), SP_COORD_HISTORY_CAP);
  const char *cols[] = {"t_ms",         "state",       "incarnation",
                        "step",         "loss",        "steps_per_s",
                        "tokens_per_s", "step_p50_ms", "step_p99_ms",
                        "attached",     "open_alerts"};
  for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++) jarr(d, cols[i], n);
  json_t *t = json_object_get(d, "t_ms");
  for (size_t i = 1; i < n; i++)
    assert_true(at_int(t, i) >= at_int(t, i - 1) + 1000);
  json_t *att = json_object_get(d, "attached");
  assert_int_equal(at_int(att, n - 1), WORLD);
  json_t *loss = json_object_get(d, "loss");
  assert_true(json_number_value(json_array_get(loss, n - 1)) == 2.5);
  json_int_t last = at_int(t, n - 1);
  json_decref(d);
  /* ?since: only newer samples */
  char since[32];
  snprintf(since, sizeof since, "%lld", (long long)last);
  d = get_kv(&j, "/api/v1/history", (const char *const[]){"since", since, NULL},
             200);
  json_t *t2 = json_object_get(d, "t_ms");
  for (size_t i = 0; i < json_array_size(t2); i++)
    assert_true(at_int(t2, i) > last);
  json_decref(d);
  d = get_kv(&j, "/api/v1/history", (const char *const[]){"since", "0", NULL},
             200);
  assert_true(jint(d, "count") >= (json_int_t)n);
  json_decref(d);
  job_stop(&j);
}

/* Ticks far ahead of the real ones, a second apart, fill the samples:
 * when full, every other goes and the period doubles. */
typedef struct fill_arg {
  uint64_t t0;
  size_t ticks;
} fill_arg;

static void fill(sp_coord *c, void *arg) {
  fill_arg *a = arg;
  for (size_t i = 0; i < a->ticks; i++) {
    sp_coord_event e = {.kind = SP_COORD_EV_TICK, .now_ms = a->t0 + i * 1000};
    sp_coord_history_tick(c, NULL, &e);
  }
}

static void test_history_thins_when_full(void **state) {
  (void)state;
  job j;
  job_start(&j);
  fill_arg a = {.t0 = 1000000000ull, .ticks = SP_COORD_HISTORY_CAP};
  sp_coord_fixture_run(&j.fx, fill, &a);
  json_t *d = get_kv(&j, "/api/v1/history",
                     (const char *const[]){"since", "999999999", NULL}, 200);
  assert_int_equal(jint(d, "count"), SP_COORD_HISTORY_CAP);
  assert_int_equal(jint(d, "period_ms"), 1000);
  json_decref(d);
  /* one more a second later: every other sample goes (the newest
   * stays), the period doubles, and this tick is not due at it */
  a.t0 += SP_COORD_HISTORY_CAP * 1000ull;
  a.ticks = 1;
  sp_coord_fixture_run(&j.fx, fill, &a);
  d = get_kv(&j, "/api/v1/history",
             (const char *const[]){"since", "999999999", NULL}, 200);
  size_t n = (size_t)jint(d, "count");
  assert_int_equal(n, SP_COORD_HISTORY_CAP / 2);
  assert_int_equal(jint(d, "period_ms"), 2000);
  json_t *t = jarr(d, "t_ms", n);
  for (size_t i = 1; i < n; i++)
    assert_int_equal(at_int(t, i) - at_int(t, i - 1), 2000);
  assert_int_equal(at_int(t, n - 1),
                   1000000000ll + (SP_COORD_HISTORY_CAP - 1) * 1000ll);
  json_decref(d);
  /* two seconds after the newest: the next sample */
  a.t0 += 1000;
  sp_coord_fixture_run(&j.fx, fill, &a);
  d = get_kv(&j, "/api/v1/history",
             (const char *const[]){"since", "999999999", NULL}, 200);
  assert_int_equal(jint(d, "count"), SP_COORD_HISTORY_CAP / 2 + 1);
  json_decref(d);
  job_stop(&j);
}

/* ---------------- /api/v1/plan and /api/v1/buffers ---------------- */

typedef struct plan_facts {
  size_t n_units, n_buffers;
  char module[8][64];
  int64_t numel[8], shard_numel[8];
  char fqn[16][64];
  sp_dtype orig[16], compute[16];
} plan_facts;

static void read_plan(sp_coord *c, void *arg) {
  plan_facts *f = arg;
  const sp_plan *pl = c->plan;
  f->n_units = pl->n_units;
  for (size_t u = 0; u < pl->n_units && u < 8; u++) {
    snprintf(f->module[u], 64, "%s",
             pl->model->modules[pl->units[u].module].fqn);
    f->numel[u] = pl->units[u].numel;
    f->shard_numel[u] = pl->units[u].shard_numel;
  }
  f->n_buffers = pl->n_buffers;
  for (size_t i = 0; i < pl->n_buffers && i < 16; i++) {
    snprintf(f->fqn[i], 64, "%s",
             pl->model->buffers[pl->buffers[i].buffer].fqn);
    f->orig[i] = pl->buffers[i].orig_dtype;
    f->compute[i] = pl->buffers[i].compute_dtype;
  }
}

static void test_plan(void **state) {
  (void)state;
  job j;
  job_start(&j);
  plan_facts f;
  sp_coord_fixture_run(&j.fx, read_plan, &f);
  assert_int_equal(f.n_units, 4); /* the root and 3 Linear */
  json_t *d = get(&j, "/api/v1/plan");
  assert_string_equal(jstr(d, "strategy"), "FULL_SHARD");
  assert_int_equal(jint(d, "world_size"), WORLD);
  assert_int_equal(jint(d, "shard_group_size"), WORLD);
  json_t *mp = json_object_get(d, "mixed_precision");
  assert_true(json_is_true(json_object_get(mp, "enabled")));
  assert_string_equal(jstr(mp, "param_dtype"), "bfloat16");
  assert_string_equal(jstr(mp, "buffer_dtype"), "float16");
  /* not set: null, not a name */
  assert_true(json_is_null(json_object_get(mp, "reduce_dtype")));
  json_t *units = jarr(d, "units", f.n_units);
  int64_t total = 0;
  for (size_t u = 0; u < f.n_units; u++) {
    json_t *x = json_array_get(units, u);
    assert_int_equal(jint(x, "index"), u);
    assert_string_equal(jstr(x, "module"), f.module[u]);
    assert_int_equal(jint(x, "numel"), f.numel[u]);
    assert_int_equal(jint(x, "shard_numel"), f.shard_numel[u]);
    assert_string_equal(jstr(x, "param_dtype"), "bfloat16");
    assert_false(json_is_true(json_object_get(x, "full_precision")));
    total += f.numel[u];
  }
  assert_string_equal(jstr(json_array_get(units, 0), "type"), "MLP");
  assert_string_equal(jstr(json_array_get(units, 1), "type"), "Linear");
  assert_int_equal(jint(json_array_get(units, 0), "parent"), -1);
  assert_int_equal(jint(d, "numel"), total);
  json_decref(d);
  job_stop(&j);
}

static void test_buffers(void **state) {
  (void)state;
  job j;
  job_start(&j);
  plan_facts f;
  sp_coord_fixture_run(&j.fx, read_plan, &f);
  assert_int_equal(f.n_buffers, 10);
  json_t *d = get(&j, "/api/v1/buffers");
  assert_int_equal(jint(d, "total"), 10);
  assert_true(json_is_null(json_object_get(d, "next")));
  json_t *b = jarr(d, "buffers", 10);
  bool any_cast = false;
  for (size_t i = 0; i < 10; i++) {
    json_t *x = json_array_get(b, i);
    assert_string_equal(jstr(x, "fqn"), f.fqn[i]);
    assert_string_equal(jstr(x, "original_dtype"), sp_dtype_name(f.orig[i]));
    assert_string_equal(jstr(x, "compute_dtype"), sp_dtype_name(f.compute[i]));
    any_cast |= f.orig[i] != f.compute[i];
  }
  assert_true(any_cast);
  /* the spec's and the plan's: a float64 buffer computes in float16, an
   * integer one keeps its dtype; shape and persistence */
  json_t *rm = json_array_get(b, 1);
  assert_string_equal(jstr(rm, "fqn"), "layers.1.running_mean");
  assert_string_equal(jstr(rm, "original_dtype"), "float64");
  assert_string_equal(jstr(rm, "compute_dtype"), "float16");
  assert_true(json_is_true(json_object_get(rm, "cast")));
  assert_int_equal(json_array_size(json_object_get(rm, "shape")), 1);
  json_t *nb = json_array_get(b, 2);
  assert_string_equal(jstr(nb, "original_dtype"), "int64");
  assert_string_equal(jstr(nb, "compute_dtype"), "int64");
  assert_true(
      json_is_false(json_object_get(json_array_get(b, 6), "persistent")));
  json_decref(d);

  /* pages, and a prefix */
  d = get_kv(&j, "/api/v1/buffers",
             (const char *const[]){"first", "2", "count", "3", NULL}, 200);
  assert_int_equal(jint(d, "first"), 2);
  assert_int_equal(jint(d, "count"), 3);
  assert_int_equal(jint(d, "next"), 5);
  b = jarr(d, "buffers", 3);
  assert_string_equal(jstr(json_array_get(b, 0), "fqn"), f.fqn[2]);
  json_decref(d);
  d = get_kv(&j, "/api/v1/buffers",
             (const char *const[]){"prefix", "layers.4.", NULL}, 200);
  assert_int_equal(jint(d, "total"), 3);
  b = jarr(d, "buffers", 3);
  assert_string_equal(jstr(json_array_get(b, 0), "fqn"),
                      "layers.4.running_mean");
  assert_string_equal(jstr(json_array_get(b, 0), "original_dtype"), "float16");
  json_decref(d);
  d = get_kv(&j, "/api/v1/buffers",
             (const char *const[]){"prefix", "nothing.", NULL}, 200);
  assert_int_equal(jint(d, "total"), 0);
  jarr(d, "buffers", 0);
  json_decref(d);
  job_stop(&j);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_job),
      cmocka_unit_test(test_lost_rank_named),
      cmocka_unit_test(test_ranks_columns_and_pages),
      cmocka_unit_test(test_hostile_host_escaped),
      cmocka_unit_test(test_bad_queries_and_paths),
      cmocka_unit_test(test_history_samples),
      cmocka_unit_test(test_history_thins_when_full),
      cmocka_unit_test(test_plan),
      cmocka_unit_test(test_buffers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
