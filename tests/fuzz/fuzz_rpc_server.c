/* libFuzzer target over the server's byte input: each input is the byte
 * stream one client sends on one connection (format in fuzz_targets.h). The
 * connection has no socket: sp_rpc_server_feed_bytes runs the session over
 * the bytes with the Echo service registered, drains what the server
 * writes, closes and frees. Findings are crashes and sanitizer reports,
 * leaks (LeakSanitizer, plus the server's own counters and the loop's
 * handles after every input), and output that is not valid HTTP/2. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "support/echo_service.h"
#include "fuzz_targets.h"
#include "support/h2_raw.h"
#include "rpc/rpc.h"
#include "rpc/rpc_internal.h"

#define CHECK(cond)                                                         \
  do {                                                                      \
    if (!(cond)) {                                                          \
      fprintf(stderr, "fuzz_rpc_server: check failed: %s (%s:%d)\n", #cond, \
              __FILE__, __LINE__);                                          \
      abort();                                                              \
    }                                                                       \
  } while (0)

/* A request may ask the Echo service for billions of replies and open the
 * flow-control windows wide: past this much output the harness hangs up,
 * like a client that has seen enough, so one input stays fast. */
#define OUTPUT_CAP (4u << 20)

static uv_loop_t g_loop;
static sp_rpc_server *g_srv;

static void setup(void) {
  CHECK(uv_loop_init(&g_loop) == 0);
  /* Small limits reach the same code paths as the defaults with far less
   * memory per input (a queue that fills, a message over the limit). */
  sp_rpc_server_opts o = {
      .max_message = 64u << 10,
      .max_metadata = 4u << 10,
      .max_streams = 16,
      .max_pending = 256u << 10,
  };
  CHECK(sp_rpc_server_new(&g_loop, &o, &g_srv) == 0);
  CHECK(sp_echo_register(g_srv) == 0);
}

void sp_fuzz_rpc_server_teardown(void) {
  if (g_srv == NULL) return;
  sp_rpc_server_free(g_srv);
  g_srv = NULL;
  /* the server's loop handles close with it: let libuv release them */
  int rc = uv_loop_close(&g_loop);
  for (int i = 0; i < 8 && rc != 0; i++) {
    uv_run(&g_loop, UV_RUN_NOWAIT);
    rc = uv_loop_close(&g_loop);
  }
  CHECK(rc == 0);
}

typedef struct out_state {
  size_t total;
  sp_h2_reader reader;
  int (*sink)(void *arg, const uint8_t *out, size_t n);
  void *arg;
} out_state;

static int on_output(void *arg, const uint8_t *out, size_t n) {
  out_state *o = arg;
  o->total += n;
  sp_h2_reader_feed(&o->reader, out, n);
  CHECK(!o->reader.error); /* the server's output is always valid HTTP/2 */
  if (o->sink != NULL && o->sink(o->arg, out, n) != 0) return -1;
  return o->total > OUTPUT_CAP ? -1 : 0;
}

int sp_fuzz_rpc_server_run(const uint8_t *data, size_t size,
                           int (*sink)(void *arg, const uint8_t *out, size_t n),
                           void *arg) {
  if (g_srv == NULL) setup();
  if (size == 0) return 0;
  uint8_t mode = data[0];
  data++;
  size--;
  uint8_t *buf = malloc(24 + 9 + size + 1);
  CHECK(buf != NULL);
  size_t n = 0;
  if (mode & SP_FUZZ_PREFACE) {
    memcpy(buf, NGHTTP2_CLIENT_MAGIC, NGHTTP2_CLIENT_MAGIC_LEN);
    n += NGHTTP2_CLIENT_MAGIC_LEN;
  }
  if (mode & SP_FUZZ_SETTINGS) {
    static const uint8_t settings[9] = {0, 0, 0, NGHTTP2_SETTINGS, 0, 0,
                                        0, 0, 0};
    memcpy(buf + n, settings, sizeof settings);
    n += sizeof settings;
  }
  if (size > 0) memcpy(buf + n, data, size);
  n += size;
  unsigned k = mode >> 4;
  size_t chunk = k == 0 ? 0 : (size_t)1 << (k + 1);

  out_state o = {0};
  sp_h2_reader_init(&o.reader);
  o.sink = sink;
  o.arg = arg;
  int rc = sp_rpc_server_feed_bytes(g_srv, buf, n, chunk, on_output, &o);
  CHECK(rc == 0);
  /* The cancelled handlers closed their timers: let libuv release them,
   * after which nothing may be left on the loop. */
  for (int i = 0; i < 8 && uv_loop_alive(&g_loop); i++)
    uv_run(&g_loop, UV_RUN_NOWAIT);
  CHECK(!uv_loop_alive(&g_loop));
  sp_rpc_server_stats st;
  sp_rpc_server_get_stats(g_srv, &st);
  CHECK(st.calls_open == 0);
  CHECK(st.connections_open == 0);
  sp_h2_reader_free(&o.reader);
  free(buf);
  return rc;
}

int sp_fuzz_rpc_server_one(const uint8_t *data, size_t size) {
  sp_fuzz_rpc_server_run(data, size, NULL, NULL);
  return 0;
}

#ifndef SP_FUZZ_NO_ENTRY
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  return sp_fuzz_rpc_server_one(data, size);
}
#endif
