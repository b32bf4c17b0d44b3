#include "coord_fixture.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

static void coord_stopped(sp_coord *c, void *arg) {
  (void)c;
  sp_coord_fixture *fx = arg;
  uv_close((uv_handle_t *)&fx->wake, NULL);
}

static void on_wake(uv_async_t *a) {
  sp_coord_fixture *fx = a->data;
  uv_mutex_lock(&fx->lock);
  if (fx->job != NULL) {
    fx->job(fx->c, fx->job_arg);
    fx->job = NULL;
    uv_cond_broadcast(&fx->cond);
  }
  bool stop = fx->stop;
  fx->stop = false;
  uv_mutex_unlock(&fx->lock);
  if (stop) sp_coord_shutdown(fx->c, coord_stopped, fx);
}

static void run_loop(void *arg) {
  sp_coord_fixture *fx = arg;
  uv_run(&fx->loop, UV_RUN_DEFAULT);
}

void sp_coord_fixture_start(sp_coord_fixture *fx, const char *model,
                            const char *const *flags,
                            uint32_t heartbeat_timeout_ms) {
  sp_coord_fixture_start_auth(fx, model, flags, heartbeat_timeout_ms, NULL,
                              NULL);
}

void sp_coord_fixture_start_auth(sp_coord_fixture *fx, const char *model,
                                 const char *const *flags,
                                 uint32_t heartbeat_timeout_ms,
                                 const char *token_file,
                                 const sp_coord_auth_quota *quota) {
  sp_coord_config cfg = {.model_path = model,
                         .quiet = true,
                         .heartbeat_timeout_ms = heartbeat_timeout_ms,
                         .token_file = token_file};
  if (quota != NULL) cfg.store_quota = *quota;
  sp_coord_fixture_start_cfg(fx, &cfg, flags);
}

void sp_coord_fixture_start_cfg(sp_coord_fixture *fx,
                                const sp_coord_config *base,
                                const char *const *flags) {
  memset(fx, 0, sizeof *fx);
  assert_int_equal(uv_loop_init(&fx->loop), 0);
  sp_coord_config cfg = *base;
  sp_job_init(&cfg.job);
  sp_diag d = {""};
  for (size_t i = 0; flags != NULL && flags[i] != NULL; i += 2)
    if (sp_job_apply_flag(&cfg.job, flags[i], flags[i + 1], &d) != 0)
      fail_msg("flag %s: %s", flags[i], d.msg);
  if (sp_coord_new(&fx->loop, &cfg, &fx->c, &d) != 0) fail_msg("%s", d.msg);
  sp_job_clear(&cfg.job);
  int port;
  if (sp_coord_listen(fx->c, "127.0.0.1:0", &port, &d) != 0)
    fail_msg("%s", d.msg);
  snprintf(fx->addr, sizeof fx->addr, "127.0.0.1:%d", port);
  fx->http_port = fx->c->http_port;
  uv_mutex_init(&fx->lock);
  uv_cond_init(&fx->cond);
  uv_async_init(&fx->loop, &fx->wake, on_wake);
  fx->wake.data = fx;
  assert_int_equal(uv_thread_create(&fx->thread, run_loop, fx), 0);
  /* its client speaks cleartext: none for a TLS coordinator */
  if (base->tls == NULL)
    assert_int_equal(sp_rpc_sync_open(fx->addr, 5000, &fx->cli), 0);
}

void sp_coord_fixture_run(sp_coord_fixture *fx, void (*fn)(sp_coord *, void *),
                          void *arg) {
  uv_mutex_lock(&fx->lock);
  fx->job = fn;
  fx->job_arg = arg;
  uv_async_send(&fx->wake);
  while (fx->job != NULL) uv_cond_wait(&fx->cond, &fx->lock);
  uv_mutex_unlock(&fx->lock);
}

void sp_coord_fixture_stop(sp_coord_fixture *fx) {
  sp_rpc_sync_close(fx->cli);
  uv_mutex_lock(&fx->lock);
  fx->stop = true;
  uv_mutex_unlock(&fx->lock);
  uv_async_send(&fx->wake);
  uv_thread_join(&fx->thread);
  sp_coord_free(fx->c);
  assert_int_equal(uv_loop_close(&fx->loop), 0);
  uv_mutex_destroy(&fx->lock);
  uv_cond_destroy(&fx->cond);
}

void sp_test_expect_status(const sp_rpc_status *st, int code,
                           const char *substr) {
  if (st->code != code || (substr && strstr(st->message, substr) == NULL))
    fail_msg("status %s \"%s\", want %s with \"%s\"",
             sp_rpc_code_name(st->code), st->message, sp_rpc_code_name(code),
             substr ? substr : "");
}

ProtobufCMessage *sp_test_unary(sp_rpc_sync *cli, const char *method,
                                const ProtobufCMessage *req,
                                const ProtobufCMessageDescriptor *resp_desc,
                                uint64_t timeout_ms, sp_rpc_status *st) {
  ProtobufCMessage *resp = NULL;
  assert_int_equal(
      sp_rpc_sync_unary(cli, method, req, resp_desc, timeout_ms, &resp, st), 0);
  return resp;
}

ProtobufCMessage *sp_coord_fixture_call(
    sp_coord_fixture *fx, const char *method, const ProtobufCMessage *req,
    const ProtobufCMessageDescriptor *resp_desc, sp_rpc_status *st) {
  return sp_test_unary(fx->cli, method, req, resp_desc, 5000, st);
}

Shardplane__V1__GetJobResponse *sp_coord_fixture_get_job(sp_coord_fixture *fx) {
  Shardplane__V1__GetJobRequest q = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  sp_rpc_status st;
  ProtobufCMessage *r =
      sp_coord_fixture_call(fx, SP_COORD_PATH("GetJob"), &q.base,
                            &shardplane__v1__get_job_response__descriptor, &st);
  sp_test_expect_status(&st, SP_RPC_OK, NULL);
  return (Shardplane__V1__GetJobResponse *)r;
}

void sp_test_free_msg(void *m) {
  if (m) protobuf_c_message_free_unpacked(m, NULL);
}
