/* The store service of the real coordinator (server/coord_store.c), run
 * in-process on a loop thread and driven over loopback with the engine's
 * clients: every method, waits released by another client's set, deadlines
 * and cancels that leave no waiter behind, limits, garbage, and shutdown
 * finishing the calls still waiting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "support/coord_fixture.h"
#include "server/coordinator.h"
#include "support/testutil.h"

#define MODEL(name) SP_EXAMPLES "/models/" name ".json"
#define PATH(m) SP_COORD_PATH(m)

typedef sp_coord_fixture fixture;

static void start(fixture *fx) {
  sp_coord_fixture_start(fx, MODEL("gpt2"), NULL, 0);
}

/* Shuts the coordinator down (finishing waiting calls) and joins. */
static void stop(fixture *fx) { sp_coord_fixture_stop(fx); }

static void read_store_stats(sp_coord *c, void *arg) {
  sp_kvstore_get_stats(c->store, arg);
}

static sp_kvstore_stats store_stats(fixture *fx) {
  sp_kvstore_stats st;
  sp_coord_fixture_run(fx, read_store_stats, &st);
  return st;
}

/* Waits (up to 5 s) until the store has exactly n waiters. */
static void await_waiters(fixture *fx, size_t n) {
  for (int i = 0; i < 500; i++) {
    if (store_stats(fx).waiters == n) return;
    uv_sleep(10);
  }
  fail_msg("store has %zu waiters, want %zu", store_stats(fx).waiters, n);
}

#define expect_code sp_test_expect_status

#define free_msg sp_test_free_msg
#define call_on sp_test_unary

/* ---- typed calls -------------------------------------------------------- */

static uint64_t store_set(fixture *fx, const char *k, const void *v, size_t n,
                          sp_rpc_status *st) {
  Shardplane__V1__StoreSetRequest q = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  q.key = (char *)k;
  q.value.data = (uint8_t *)(uintptr_t)v;
  q.value.len = n;
  Shardplane__V1__StoreSetResponse *r = (void *)call_on(
      fx->cli, PATH("StoreSet"), &q.base,
      &shardplane__v1__store_set_response__descriptor, 10000, st);
  uint64_t ver = r ? r->version : 0;
  free_msg(r);
  return ver;
}

static uint64_t set_ok(fixture *fx, const char *k, const char *v) {
  sp_rpc_status st;
  uint64_t ver = store_set(fx, k, v, strlen(v), &st);
  expect_code(&st, SP_RPC_OK, NULL);
  return ver;
}

static Shardplane__V1__StoreGetResponse *store_get(sp_rpc_sync *cli,
                                                   const char *k, bool wait,
                                                   uint64_t timeout_ms,
                                                   sp_rpc_status *st) {
  Shardplane__V1__StoreGetRequest q = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
  q.key = (char *)k;
  q.wait = wait;
  return (void *)call_on(cli, PATH("StoreGet"), &q.base,
                         &shardplane__v1__store_get_response__descriptor,
                         timeout_ms, st);
}

static void expect_get(fixture *fx, const char *k, const char *v,
                       uint64_t version) {
  sp_rpc_status st;
  Shardplane__V1__StoreGetResponse *r = store_get(fx->cli, k, false, 5000, &st);
  expect_code(&st, SP_RPC_OK, NULL);
  if (v == NULL) {
    assert_false(r->found);
  } else {
    assert_true(r->found);
    assert_int_equal(r->value.len, strlen(v));
    assert_memory_equal(r->value.data, v, r->value.len);
    assert_int_equal(r->version, version);
  }
  free_msg(r);
}

static Shardplane__V1__StoreAddResponse *store_add(fixture *fx, const char *k,
                                                   int64_t d,
                                                   sp_rpc_status *st) {
  Shardplane__V1__StoreAddRequest q = SHARDPLANE__V1__STORE_ADD_REQUEST__INIT;
  q.key = (char *)k;
  q.delta = d;
  return (void *)call_on(fx->cli, PATH("StoreAdd"), &q.base,
                         &shardplane__v1__store_add_response__descriptor, 5000,
                         st);
}

static Shardplane__V1__StoreCompareSetResponse *store_cas(
    fixture *fx, const char *k, const char *expected, bool absent,
    const char *desired, sp_rpc_status *st) {
  Shardplane__V1__StoreCompareSetRequest q =
      SHARDPLANE__V1__STORE_COMPARE_SET_REQUEST__INIT;
  q.key = (char *)k;
  if (expected != NULL) {
    q.expected.data = (uint8_t *)(uintptr_t)expected;
    q.expected.len = strlen(expected);
  }
  q.expect_absent = absent;
  q.desired.data = (uint8_t *)(uintptr_t)desired;
  q.desired.len = strlen(desired);
  return (void *)call_on(
      fx->cli, PATH("StoreCompareSet"), &q.base,
      &shardplane__v1__store_compare_set_response__descriptor, 5000, st);
}

static bool store_delete(fixture *fx, const char *k, sp_rpc_status *st) {
  Shardplane__V1__StoreDeleteRequest q =
      SHARDPLANE__V1__STORE_DELETE_REQUEST__INIT;
  q.key = (char *)k;
  Shardplane__V1__StoreDeleteResponse *r = (void *)call_on(
      fx->cli, PATH("StoreDelete"), &q.base,
      &shardplane__v1__store_delete_response__descriptor, 5000, st);
  bool del = r ? r->deleted : false;
  free_msg(r);
  return del;
}

static void store_wait(sp_rpc_sync *cli, const char *const *keys, size_t n,
                       uint64_t timeout_ms, sp_rpc_status *st) {
  Shardplane__V1__StoreWaitRequest q = SHARDPLANE__V1__STORE_WAIT_REQUEST__INIT;
  q.keys = (char **)(uintptr_t)keys;
  q.n_keys = n;
  free_msg(call_on(cli, PATH("StoreWait"), &q.base,
                   &shardplane__v1__store_wait_response__descriptor, timeout_ms,
                   st));
}

/* ---- a blocking call on another thread, with its own client ------------ */

typedef struct waiter_thread {
  uv_thread_t t;
  const char *addr;
  const char *key;     /* StoreGet with wait */
  const char *keys[4]; /* StoreWait, when key is NULL */
  size_t n_keys;
  uint64_t timeout_ms;
  sp_rpc_status st;
  bool found;
  char value[64];
  uint64_t version;
} waiter_thread;

static void waiter_main(void *arg) {
  waiter_thread *w = arg;
  sp_rpc_sync *cli;
  if (sp_rpc_sync_open(w->addr, 5000, &cli) != 0) {
    w->st.code = -1;
    return;
  }
  if (w->key != NULL) {
    ProtobufCMessage *resp = NULL;
    Shardplane__V1__StoreGetRequest q = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
    q.key = (char *)w->key;
    q.wait = true;
    sp_rpc_sync_unary(cli, PATH("StoreGet"), &q.base,
                      &shardplane__v1__store_get_response__descriptor,
                      w->timeout_ms, &resp, &w->st);
    Shardplane__V1__StoreGetResponse *r = (void *)resp;
    if (r != NULL) {
      w->found = r->found;
      w->version = r->version;
      size_t n = r->value.len < sizeof w->value - 1 ? r->value.len
                                                    : sizeof w->value - 1;
      memcpy(w->value, r->value.data, n);
      w->value[n] = 0;
    }
    free_msg(resp);
  } else {
    Shardplane__V1__StoreWaitRequest q =
        SHARDPLANE__V1__STORE_WAIT_REQUEST__INIT;
    q.keys = (char **)w->keys;
    q.n_keys = w->n_keys;
    ProtobufCMessage *resp = NULL;
    sp_rpc_sync_unary(cli, PATH("StoreWait"), &q.base,
                      &shardplane__v1__store_wait_response__descriptor,
                      w->timeout_ms, &resp, &w->st);
    free_msg(resp);
  }
  sp_rpc_sync_close(cli);
}

static void waiter_start(waiter_thread *w, const fixture *fx) {
  w->addr = fx->addr;
  w->st.code = -2;
  assert_int_equal(uv_thread_create(&w->t, waiter_main, w), 0);
}

/* ---- a GET with a receive limit above the sync client's 4 MiB ---------- */

typedef struct big_get {
  uint8_t *data;
  size_t len;
  sp_rpc_status st;
} big_get;

static void big_on_message(sp_rpc_ccall *call, const uint8_t *data, size_t len,
                           void *user) {
  (void)call;
  big_get *b = user;
  Shardplane__V1__StoreGetResponse *r =
      shardplane__v1__store_get_response__unpack(NULL, len, data);
  if (r == NULL) return;
  b->data = malloc(r->value.len + 1);
  if (b->data != NULL) {
    memcpy(b->data, r->value.data, r->value.len);
    b->len = r->value.len;
  }
  shardplane__v1__store_get_response__free_unpacked(r, NULL);
}

static void big_on_close(sp_rpc_ccall *call, const sp_rpc_status *st,
                         void *user) {
  (void)call;
  ((big_get *)user)->st = *st;
}

static void get_large(const fixture *fx, const char *key, big_get *b) {
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  sp_rpc_client_opts o = {.max_message = SP_COORD_MAX_MESSAGE};
  sp_rpc_client *cl;
  assert_int_equal(sp_rpc_client_open(&loop, fx->addr, &o, &cl), 0);
  sp_rpc_ccall_cbs cbs = {big_on_message, big_on_close};
  sp_rpc_ccall *call;
  b->st.code = -1;
  assert_int_equal(
      sp_rpc_client_start(cl, PATH("StoreGet"), NULL, 0, 10000, &cbs, b, &call),
      0);
  Shardplane__V1__StoreGetRequest q = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
  q.key = (char *)key;
  assert_int_equal(sp_rpc_ccall_send_msg(call, &q.base), 0);
  assert_int_equal(sp_rpc_ccall_close_send(call), 0);
  while (b->st.code == -1) uv_run(&loop, UV_RUN_ONCE);
  sp_rpc_client_close(cl, NULL, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* ---- tests ------------------------------------------------------------- */

static void test_set_get_delete(void **state) {
  (void)state;
  fixture fx;
  start(&fx);
  expect_get(&fx, "a", NULL, 0); /* absent, no wait: OK, not found */
  assert_int_equal(set_ok(&fx, "a", "1"), 1);
  assert_int_equal(set_ok(&fx, "a", "two"), 2);
  expect_get(&fx, "a", "two", 2);
  /* Binary values survive whole. */
  const uint8_t bin[] = {0, 1, 0, 255};
  sp_rpc_status st;
  assert_int_equal(store_set(&fx, "bin", bin, sizeof bin, &st), 1);
  expect_code(&st, SP_RPC_OK, NULL);
  Shardplane__V1__StoreGetResponse *g =
      store_get(fx.cli, "bin", false, 5000, &st);
  assert_non_null(g);
  assert_int_equal(g->value.len, sizeof bin);
  assert_memory_equal(g->value.data, bin, sizeof bin);
  free_msg(g);
  /* An empty value is a value. */
  assert_int_equal(set_ok(&fx, "empty", ""), 1);
  expect_get(&fx, "empty", "", 1);
  /* Delete, then re-set: versions start over. */
  assert_true(store_delete(&fx, "a", &st));
  expect_code(&st, SP_RPC_OK, NULL);
  assert_false(store_delete(&fx, "a", &st));
  expect_code(&st, SP_RPC_OK, NULL);
  expect_get(&fx, "a", NULL, 0);
  assert_int_equal(set_ok(&fx, "a", "again"), 1);
  sp_kvstore_stats ss = store_stats(&fx);
  assert_int_equal(ss.keys, 3);
  assert_int_equal(ss.waiters, 0);
  stop(&fx);
}

static void test_add_and_compare_set(void **state) {
  (void)state;
  fixture fx;
  start(&fx);
  sp_rpc_status st;
  Shardplane__V1__StoreAddResponse *a = store_add(&fx, "n", 5, &st);
  expect_code(&st, SP_RPC_OK, NULL);
  assert_int_equal(a->value, 5);
  assert_int_equal(a->version, 1);
  free_msg(a);
  a = store_add(&fx, "n", -7, &st);
  assert_int_equal(a->value, -2);
  assert_int_equal(a->version, 2);
  free_msg(a);
  expect_get(&fx, "n", "-2", 2);
  set_ok(&fx, "word", "abc");
  assert_null(store_add(&fx, "word", 1, &st));
  expect_code(&st, SP_RPC_FAILED_PRECONDITION, "not a decimal integer");
  set_ok(&fx, "max", "9223372036854775807");
  assert_null(store_add(&fx, "max", 1, &st));
  expect_code(&st, SP_RPC_OUT_OF_RANGE, "overflow");
  expect_get(&fx, "max", "9223372036854775807", 1);

  /* Compare-and-set says whether it won. */
  Shardplane__V1__StoreCompareSetResponse *c =
      store_cas(&fx, "id", NULL, true, "first", &st);
  expect_code(&st, SP_RPC_OK, NULL);
  assert_true(c->swapped);
  assert_true(c->found);
  assert_int_equal(c->version, 1);
  assert_int_equal(c->value.len, 5);
  free_msg(c);
  c = store_cas(&fx, "id", NULL, true, "second", &st);
  assert_false(c->swapped);
  assert_true(c->found);
  assert_memory_equal(c->value.data, "first", 5);
  assert_int_equal(c->version, 1);
  free_msg(c);
  c = store_cas(&fx, "id", "wrong", false, "second", &st);
  assert_false(c->swapped);
  assert_memory_equal(c->value.data, "first", 5);
  free_msg(c);
  c = store_cas(&fx, "id", "first", false, "second", &st);
  assert_true(c->swapped);
  assert_int_equal(c->version, 2);
  assert_int_equal(c->value.len, 6);
  assert_memory_equal(c->value.data, "second", 6);
  free_msg(c);
  c = store_cas(&fx, "nope", "", false, "x", &st);
  expect_code(&st, SP_RPC_OK, NULL);
  assert_false(c->swapped);
  assert_false(c->found);
  assert_int_equal(c->value.len, 0);
  free_msg(c);
  assert_null(store_cas(&fx, "id", "second", true, "x", &st));
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "expect_absent");
  expect_get(&fx, "id", "second", 2);
  stop(&fx);
}

static void test_get_waits_for_set(void **state) {
  (void)state;
  fixture fx;
  start(&fx);
  /* Rank 1 asks for the id before rank 0 published it. */
  waiter_thread w = {.key = "nccl/0", .timeout_ms = 0};
  waiter_start(&w, &fx);
  await_waiters(&fx, 1);
  set_ok(&fx, "other", "x"); /* another key releases nothing */
  assert_int_equal(store_stats(&fx).waiters, 1);
  set_ok(&fx, "nccl/0", "unique-id-bytes");
  uv_thread_join(&w.t);
  expect_code(&w.st, SP_RPC_OK, NULL);
  assert_true(w.found);
  assert_string_equal(w.value, "unique-id-bytes");
  assert_int_equal(w.version, 1);
  assert_int_equal(store_stats(&fx).waiters, 0);
  /* With wait and the key present it answers at once. */
  sp_rpc_status st;
  Shardplane__V1__StoreGetResponse *g =
      store_get(fx.cli, "nccl/0", true, 1000, &st);
  expect_code(&st, SP_RPC_OK, NULL);
  assert_true(g->found);
  free_msg(g);
  /* Many ranks wait; one set releases them all. */
  enum { N = 8 };
  waiter_thread ws[N];
  memset(ws, 0, sizeof ws);
  for (int i = 0; i < N; i++) {
    ws[i].key = "nccl/1";
    ws[i].timeout_ms = 20000; /* a deadline that does not expire */
    waiter_start(&ws[i], &fx);
  }
  await_waiters(&fx, N);
  set_ok(&fx, "nccl/1", "id-1");
  for (int i = 0; i < N; i++) {
    uv_thread_join(&ws[i].t);
    expect_code(&ws[i].st, SP_RPC_OK, NULL);
    assert_string_equal(ws[i].value, "id-1");
  }
  /* A creating ADD and a creating CAS release waiters too. */
  waiter_thread wa = {.key = "counter"}, wc = {.key = "cas"};
  waiter_start(&wa, &fx);
  waiter_start(&wc, &fx);
  await_waiters(&fx, 2);
  free_msg(store_add(&fx, "counter", 3, &st));
  free_msg(store_cas(&fx, "cas", NULL, true, "won", &st));
  uv_thread_join(&wa.t);
  uv_thread_join(&wc.t);
  expect_code(&wa.st, SP_RPC_OK, NULL);
  assert_string_equal(wa.value, "3");
  expect_code(&wc.st, SP_RPC_OK, NULL);
  assert_string_equal(wc.value, "won");
  stop(&fx);
}

static void test_wait_several_keys(void **state) {
  (void)state;
  fixture fx;
  start(&fx);
  set_ok(&fx, "k1", "already");
  waiter_thread w = {.keys = {"k1", "k2", "k3"}, .n_keys = 3};
  waiter_thread g = {.key = "k3"};
  waiter_start(&w, &fx);
  waiter_start(&g, &fx);
  await_waiters(&fx, 2);
  set_ok(&fx, "k2", "x");
  uv_sleep(50);
  assert_int_equal(store_stats(&fx).waiters, 2); /* both still blocked */
  set_ok(&fx, "k3", "y");                        /* releases both, together */
  uv_thread_join(&w.t);
  uv_thread_join(&g.t);
  expect_code(&w.st, SP_RPC_OK, NULL);
  expect_code(&g.st, SP_RPC_OK, NULL);
  assert_string_equal(g.value, "y");
  /* All present, or no keys at all: answered at once. */
  sp_rpc_status st;
  const char *keys[] = {"k1", "k2", "k3"};
  store_wait(fx.cli, keys, 3, 1000, &st);
  expect_code(&st, SP_RPC_OK, NULL);
  store_wait(fx.cli, keys, 0, 1000, &st);
  expect_code(&st, SP_RPC_OK, NULL);
  /* A key counted then deleted stays counted (TCPStore's WAIT). */
  waiter_thread w2 = {.keys = {"d1", "d2"}, .n_keys = 2};
  waiter_start(&w2, &fx);
  await_waiters(&fx, 1);
  set_ok(&fx, "d1", "");
  store_delete(&fx, "d1", &st);
  set_ok(&fx, "d2", "");
  uv_thread_join(&w2.t);
  expect_code(&w2.st, SP_RPC_OK, NULL);
  assert_int_equal(store_stats(&fx).waiters, 0);
  stop(&fx);
}

static void test_deadline_and_cancel_leave_no_waiter(void **state) {
  (void)state;
  fixture fx;
  start(&fx);
  sp_rpc_status st;
  assert_null(store_get(fx.cli, "never", true, 200, &st));
  expect_code(&st, SP_RPC_DEADLINE_EXCEEDED, NULL);
  await_waiters(&fx, 0);
  const char *keys[] = {"never", "nor-this"};
  store_wait(fx.cli, keys, 2, 200, &st);
  expect_code(&st, SP_RPC_DEADLINE_EXCEEDED, NULL);
  await_waiters(&fx, 0);
  /* A client that cancels (no deadline) takes its waiter with it. */
  sp_rpc_sync_stream *s;
  assert_int_equal(
      sp_rpc_sync_stream_open(fx.cli, PATH("StoreGet"), 0, NULL, 0, &s), 0);
  Shardplane__V1__StoreGetRequest q = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
  q.key = "never";
  q.wait = true;
  assert_int_equal(sp_rpc_sync_stream_send(s, &q.base), 0);
  assert_int_equal(sp_rpc_sync_stream_close_send(s), 0);
  ProtobufCMessage *m = NULL;
  assert_int_equal(sp_rpc_sync_stream_recv(s, NULL, 100, &m, &st),
                   SP_ETIMEDOUT);
  await_waiters(&fx, 1);
  sp_rpc_sync_stream_close(s);
  await_waiters(&fx, 0);
  /* A deadline from another client, while this one stays connected. */
  waiter_thread w = {.key = "never", .timeout_ms = 300};
  waiter_start(&w, &fx);
  uv_thread_join(&w.t);
  expect_code(&w.st, SP_RPC_DEADLINE_EXCEEDED, NULL);
  await_waiters(&fx, 0);
  /* The key set later wakes nobody and nothing breaks. */
  set_ok(&fx, "never", "now");
  expect_get(&fx, "never", "now", 1);
  stop(&fx);
}

static void test_limits_and_bad_requests(void **state) {
  (void)state;
  fixture fx;
  start(&fx);
  sp_rpc_status st;
  /* Empty keys: INVALID_ARGUMENT, for every method. */
  store_set(&fx, "", "v", 1, &st);
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "key is empty");
  assert_null(store_get(fx.cli, "", true, 1000, &st));
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "key is empty");
  assert_null(store_add(&fx, "", 1, &st));
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "key is empty");
  assert_null(store_cas(&fx, "", NULL, true, "x", &st));
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "key is empty");
  store_delete(&fx, "", &st);
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "key is empty");
  const char *keys[] = {"a", ""};
  store_wait(fx.cli, keys, 2, 1000, &st);
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "keys[1] is empty");

  /* Keys up to 8 KiB. */
  char *key = malloc(SP_COORD_MAX_KEY + 2);
  assert_non_null(key);
  memset(key, 'k', SP_COORD_MAX_KEY + 1);
  key[SP_COORD_MAX_KEY] = 0;
  assert_int_equal(store_set(&fx, key, "v", 1, &st), 1);
  expect_code(&st, SP_RPC_OK, NULL);
  key[SP_COORD_MAX_KEY] = 'k';
  key[SP_COORD_MAX_KEY + 1] = 0;
  store_set(&fx, key, "v", 1, &st);
  expect_code(&st, SP_RPC_RESOURCE_EXHAUSTED, "8192-byte limit");
  assert_null(store_get(fx.cli, key, true, 1000, &st));
  expect_code(&st, SP_RPC_RESOURCE_EXHAUSTED, "8192-byte limit");
  assert_null(store_add(&fx, key, 1, &st));
  expect_code(&st, SP_RPC_RESOURCE_EXHAUSTED, NULL);
  store_delete(&fx, key, &st);
  expect_code(&st, SP_RPC_RESOURCE_EXHAUSTED, NULL);
  const char *big[] = {"a", key};
  store_wait(fx.cli, big, 2, 1000, &st);
  expect_code(&st, SP_RPC_RESOURCE_EXHAUSTED, "keys[1]");
  free(key);

  /* Values up to 8 MiB. */
  size_t vmax = SP_COORD_MAX_VALUE;
  uint8_t *val = malloc(vmax + 2);
  assert_non_null(val);
  memset(val, 'v', vmax + 2);
  assert_int_equal(store_set(&fx, "big", val, vmax, &st), 1);
  expect_code(&st, SP_RPC_OK, NULL);
  big_get b = {0};
  get_large(&fx, "big", &b);
  expect_code(&b.st, SP_RPC_OK, NULL);
  assert_int_equal(b.len, vmax);
  assert_memory_equal(b.data, val, vmax);
  free(b.data);
  store_set(&fx, "big", val, vmax + 1, &st);
  expect_code(&st, SP_RPC_RESOURCE_EXHAUSTED, "8388608-byte limit");
  Shardplane__V1__StoreCompareSetRequest cq =
      SHARDPLANE__V1__STORE_COMPARE_SET_REQUEST__INIT;
  cq.key = "big";
  cq.desired.data = val;
  cq.desired.len = vmax + 1;
  assert_null(call_on(fx.cli, PATH("StoreCompareSet"), &cq.base,
                      &shardplane__v1__store_compare_set_response__descriptor,
                      10000, &st));
  expect_code(&st, SP_RPC_RESOURCE_EXHAUSTED, "desired");
  /* Far over: the engine refuses the message before decoding it. */
  uint8_t *huge = malloc(SP_COORD_MAX_MESSAGE + 1);
  assert_non_null(huge);
  memset(huge, 'h', SP_COORD_MAX_MESSAGE + 1);
  store_set(&fx, "huge", huge, SP_COORD_MAX_MESSAGE + 1, &st);
  expect_code(&st, SP_RPC_RESOURCE_EXHAUSTED, NULL);
  free(huge);
  /* A value just under the client's default receive limit comes back. */
  size_t half = (4u << 20) - 1024;
  assert_int_equal(store_set(&fx, "half", val, half, &st), 1);
  Shardplane__V1__StoreGetResponse *g =
      store_get(fx.cli, "half", false, 10000, &st);
  expect_code(&st, SP_RPC_OK, NULL);
  assert_int_equal(g->value.len, half);
  assert_memory_equal(g->value.data, val, half);
  free_msg(g);
  free(val);

  /* Too many keys in one wait. */
  size_t n = (128u << 10) + 1;
  char **many = malloc(n * sizeof *many);
  assert_non_null(many);
  for (size_t i = 0; i < n; i++) many[i] = "m";
  store_wait(fx.cli, (const char *const *)many, n, 10000, &st);
  expect_code(&st, SP_RPC_RESOURCE_EXHAUSTED, "keys in one wait");
  free(many);

  /* Bytes that are not a request: INVALID_ARGUMENT (the pre-scan finds
   * the malformed wire data), and nothing else happens. */
  sp_rpc_sync_stream *s;
  assert_int_equal(
      sp_rpc_sync_stream_open(fx.cli, PATH("StoreSet"), 2000, NULL, 0, &s), 0);
  const uint8_t junk[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f};
  assert_int_equal(sp_rpc_sync_stream_send_raw(s, junk, sizeof junk), 0);
  sp_rpc_sync_stream_close_send(s);
  ProtobufCMessage *m;
  assert_int_equal(sp_rpc_sync_stream_recv(s, NULL, 2000, &m, &st), SP_ENOENT);
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "StoreSetRequest");
  sp_rpc_sync_stream_close(s);

  /* The coordinator still answers, and its store is as it was: the 8 KiB
   * key, "big" and "half". */
  sp_kvstore_stats ss = store_stats(&fx);
  assert_int_equal(ss.keys, 3);
  assert_int_equal(ss.waiters, 0);
  assert_int_equal(set_ok(&fx, "after", "ok"), 1);
  expect_get(&fx, "after", "ok", 1);
  stop(&fx);
}

/* Calls still waiting when the coordinator stops are answered UNAVAILABLE
 * at once, not left to the server's grace period. */
static void test_shutdown_finishes_waiters(void **state) {
  (void)state;
  fixture fx;
  start(&fx);
  waiter_thread g = {.key = "never"};
  waiter_thread w = {.keys = {"never", "either"}, .n_keys = 2};
  waiter_start(&g, &fx);
  waiter_start(&w, &fx);
  await_waiters(&fx, 2);
  uint64_t t0 = uv_hrtime();
  stop(&fx);
  uv_thread_join(&g.t);
  uv_thread_join(&w.t);
  expect_code(&g.st, SP_RPC_UNAVAILABLE, "coordinator shutting down");
  expect_code(&w.st, SP_RPC_UNAVAILABLE, "coordinator shutting down");
  /* Well inside the coordinator's 2 s grace. */
  assert_true(uv_hrtime() - t0 < UINT64_C(1500000000));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_set_get_delete),
      cmocka_unit_test(test_add_and_compare_set),
      cmocka_unit_test(test_get_waits_for_set),
      cmocka_unit_test(test_wait_several_keys),
      cmocka_unit_test(test_deadline_and_cancel_leave_no_waiter),
      cmocka_unit_test(test_limits_and_bad_requests),
      cmocka_unit_test(test_shutdown_finishes_waiters),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
