#include "rpc_fixture.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "echo_service.h"

static void on_shutdown(sp_rpc_server *srv, void *arg) {
  (void)srv;
  sp_test_server *ts = arg;
  uv_close((uv_handle_t *)&ts->wake, NULL);
}

/* Requests from the test thread arrive here, on the loop thread. */
static void on_wake(uv_async_t *a) {
  sp_test_server *ts = a->data;
  uv_mutex_lock(&ts->lock);
  if (ts->want_stats) {
    sp_rpc_server_get_stats(ts->srv, &ts->stats);
    ts->want_stats = false;
    uv_cond_signal(&ts->cond);
  }
  if (ts->want_path != NULL) {
    ts->method_found = false;
    sp_rpc_method_stats m;
    for (size_t i = 0; sp_rpc_server_method_stats(ts->srv, i, &m) == 0; i++)
      if (strcmp(m.path, ts->want_path) == 0) {
        ts->method = m;
        ts->method_found = true;
      }
    ts->want_path = NULL;
    uv_cond_signal(&ts->cond);
  }
  bool stop = ts->stop;
  uv_mutex_unlock(&ts->lock);
  if (stop) sp_rpc_server_shutdown(ts->srv, ts->grace_ms, on_shutdown, ts);
}

static void run(void *arg) {
  sp_test_server *ts = arg;
  uv_run(&ts->loop, UV_RUN_DEFAULT);
}

void sp_test_server_start(sp_test_server *ts, const sp_rpc_server_opts *opts) {
  memset(ts, 0, sizeof *ts);
  assert_int_equal(uv_loop_init(&ts->loop), 0);
  assert_int_equal(sp_rpc_server_new(&ts->loop, opts, &ts->srv), 0);
  assert_int_equal(sp_echo_register(ts->srv), 0);
  sp_diag d = {""};
  if (sp_rpc_server_listen(ts->srv, "127.0.0.1:0", &ts->port, &d) != 0)
    fail_msg("listen: %s", d.msg);
  snprintf(ts->addr, sizeof ts->addr, "127.0.0.1:%d", ts->port);
  uv_mutex_init(&ts->lock);
  uv_cond_init(&ts->cond);
  uv_async_init(&ts->loop, &ts->wake, on_wake);
  ts->wake.data = ts;
  assert_int_equal(uv_thread_create(&ts->thread, run, ts), 0);
}

sp_rpc_server_stats sp_test_server_stats(sp_test_server *ts) {
  uv_mutex_lock(&ts->lock);
  ts->want_stats = true;
  uv_async_send(&ts->wake);
  while (ts->want_stats) uv_cond_wait(&ts->cond, &ts->lock);
  sp_rpc_server_stats s = ts->stats;
  uv_mutex_unlock(&ts->lock);
  return s;
}

bool sp_test_server_method_stats(sp_test_server *ts, const char *path,
                                 sp_rpc_method_stats *out) {
  uv_mutex_lock(&ts->lock);
  ts->want_path = path;
  uv_async_send(&ts->wake);
  while (ts->want_path != NULL) uv_cond_wait(&ts->cond, &ts->lock);
  bool found = ts->method_found;
  if (found) *out = ts->method;
  uv_mutex_unlock(&ts->lock);
  return found;
}

void sp_test_server_stop(sp_test_server *ts, uint64_t grace_ms) {
  uv_mutex_lock(&ts->lock);
  ts->stop = true;
  ts->grace_ms = grace_ms;
  uv_mutex_unlock(&ts->lock);
  uv_async_send(&ts->wake);
  uv_thread_join(&ts->thread);
  sp_rpc_server_free(ts->srv);
  assert_int_equal(uv_loop_close(&ts->loop), 0);
  uv_mutex_destroy(&ts->lock);
  uv_cond_destroy(&ts->cond);
}
