/* A real coordinator in-process on its own loop thread, for tests that
 * drive it over loopback with the engine's clients. */
#ifndef SP_COORD_FIXTURE_H
#define SP_COORD_FIXTURE_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "server/coordinator.h"

typedef struct sp_coord_fixture {
  uv_loop_t loop;
  uv_thread_t thread;
  uv_async_t wake;
  uv_mutex_t lock;
  uv_cond_t cond;
  bool stop;
  void (*job)(sp_coord *, void *); /* to run on the loop thread */
  void *job_arg;
  sp_coord *c;
  char addr[64];
  int http_port;    /* 0: no HTTP listener */
  sp_rpc_sync *cli; /* a blocking client, connected */
} sp_coord_fixture;

/* Starts a coordinator for `model` with job flags given as "name", "value"
 * pairs (NULL-terminated; a NULL name ends the list early), listening on
 * 127.0.0.1:0. heartbeat_timeout_ms 0 keeps the default. Aborts the test on
 * failure. */
void sp_coord_fixture_start(sp_coord_fixture *fx, const char *model,
                            const char *const *flags,
                            uint32_t heartbeat_timeout_ms);
/* The same with the coordinator's token file (NULL: none) and per-token
 * store quota (NULL: the defaults). fx->cli then carries no token. */
void sp_coord_fixture_start_auth(sp_coord_fixture *fx, const char *model,
                                 const char *const *flags,
                                 uint32_t heartbeat_timeout_ms,
                                 const char *token_file,
                                 const sp_coord_auth_quota *quota);
/* The same from a whole configuration (its job is ignored: flags make
 * it; model_path and the rest as given), e.g. with an HTTP listener:
 * fx->http_port is then its port. With TLS, fx->cli is NULL. */
void sp_coord_fixture_start_cfg(sp_coord_fixture *fx,
                                const sp_coord_config *base,
                                const char *const *flags);
/* Graceful shutdown (finishing calls still open), join, free. */
void sp_coord_fixture_stop(sp_coord_fixture *fx);
/* Runs fn(c, arg) on the loop thread and waits for it: the coordinator's
 * state belongs to its loop. */
void sp_coord_fixture_run(sp_coord_fixture *fx, void (*fn)(sp_coord *, void *),
                          void *arg);

/* One unary call on cli, waiting up to timeout_ms: the decoded response,
 * or NULL with *st set. Fails the test when the call cannot be made. */
ProtobufCMessage *sp_test_unary(sp_rpc_sync *cli, const char *method,
                                const ProtobufCMessage *req,
                                const ProtobufCMessageDescriptor *resp_desc,
                                uint64_t timeout_ms, sp_rpc_status *st);
/* sp_test_unary on the fixture's client, waiting up to 5 s. */
ProtobufCMessage *sp_coord_fixture_call(
    sp_coord_fixture *fx, const char *method, const ProtobufCMessage *req,
    const ProtobufCMessageDescriptor *resp_desc, sp_rpc_status *st);
/* GetJob, which must succeed; free with sp_test_free_msg. */
Shardplane__V1__GetJobResponse *sp_coord_fixture_get_job(sp_coord_fixture *fx);
/* Frees a decoded message; NULL is fine. */
void sp_test_free_msg(void *m);

/* Fails the test unless st has that code and (if given) mentions substr. */
void sp_test_expect_status(const sp_rpc_status *st, int code,
                           const char *substr);

#endif
