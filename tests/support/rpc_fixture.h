/* An engine server with the Echo service running on its own loop thread,
 * for tests that drive it with clients from the test thread. */
#ifndef SP_RPC_FIXTURE_H
#define SP_RPC_FIXTURE_H

#include <uv.h>

#include "rpc/rpc.h"

typedef struct sp_test_server {
  uv_loop_t loop;
  uv_thread_t thread;
  uv_async_t wake;
  uv_mutex_t lock;
  sp_rpc_server *srv;
  int port;
  char addr[64];
  uint64_t grace_ms;
  bool stop;
  /* filled under lock on request (sp_test_server_stats) */
  bool want_stats;
  sp_rpc_server_stats stats;
  /* likewise one method's (sp_test_server_method_stats) */
  const char *want_path;
  bool method_found;
  sp_rpc_method_stats method;
  uv_cond_t cond;
} sp_test_server;

/* Starts listening on 127.0.0.1:0 with the Echo service; opts may be NULL.
 * Aborts the test on failure. */
void sp_test_server_start(sp_test_server *ts, const sp_rpc_server_opts *opts);
/* Graceful shutdown with grace_ms, then joins and frees. */
void sp_test_server_stop(sp_test_server *ts, uint64_t grace_ms);
/* A consistent snapshot of the server counters, taken on its loop. */
sp_rpc_server_stats sp_test_server_stats(sp_test_server *ts);
/* The statistics of the method at path, taken on its loop: false when no
 * method has that path. */
bool sp_test_server_method_stats(sp_test_server *ts, const char *path,
                                 sp_rpc_method_stats *out);

#endif
