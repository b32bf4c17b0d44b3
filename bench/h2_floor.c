#include "h2_floor.h"

#include <nghttp2/nghttp2.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/sp_error.h"
#include "rpc/rpc.h"

/* Streams in flight at most; their send offsets live in rings of this
 * size, indexed by stream id, so no call allocates anything of ours. */
#define RING 256
#define MAX_IN_FLIGHT (RING / 2)

struct sp_h2_floor {
  nghttp2_session *cli, *srv;
  uint8_t *frame; /* the 5-byte gRPC prefix and the message */
  size_t frame_len;
  char *authority;
  size_t c_off[RING], s_off[RING]; /* bytes of frame sent, per stream */
  int outstanding;
  bool stop; /* the slice's time is up: completions start nothing */
  uint64_t done;
  bool failed;
};

/* Names and values that outlive the frames, as nghttp2 is told: it
 * copies none of them (as ours, rpc_internal.h, SP_NV_STATIC). */
#define NV(n, v, vl)                                                 \
  {                                                                  \
    (uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, (vl),             \
        NGHTTP2_NV_FLAG_NO_COPY_NAME | NGHTTP2_NV_FLAG_NO_COPY_VALUE \
  }

static size_t ring(int32_t id) { return (size_t)(id >> 1) % RING; }

/* Both directions carry the same frame, in DATA frames of what nghttp2
 * allows; the request ends the stream, the reply is followed by trailers. */
static ssize_t send_frame(sp_h2_floor *f, size_t *off, uint8_t *buf,
                          size_t len) {
  size_t n = f->frame_len - *off;
  if (n > len) n = len;
  memcpy(buf, f->frame + *off, n);
  *off += n;
  return (ssize_t)n;
}

static ssize_t read_request(nghttp2_session *s, int32_t id, uint8_t *buf,
                            size_t len, uint32_t *flags,
                            nghttp2_data_source *src, void *ud) {
  (void)s;
  (void)src;
  sp_h2_floor *f = ud;
  size_t *off = &f->c_off[ring(id)];
  ssize_t n = send_frame(f, off, buf, len);
  if (*off == f->frame_len) *flags |= NGHTTP2_DATA_FLAG_EOF;
  return n;
}

static ssize_t read_reply(nghttp2_session *s, int32_t id, uint8_t *buf,
                          size_t len, uint32_t *flags, nghttp2_data_source *src,
                          void *ud) {
  (void)src;
  sp_h2_floor *f = ud;
  size_t *off = &f->s_off[ring(id)];
  ssize_t n = send_frame(f, off, buf, len);
  if (*off < f->frame_len) return n;
  static const nghttp2_nv tr[] = {NV("grpc-status", "0", 1)};
  *flags |= NGHTTP2_DATA_FLAG_EOF;
  if (nghttp2_submit_trailer(s, id, tr, 1) == 0)
    *flags |= NGHTTP2_DATA_FLAG_NO_END_STREAM;
  return n;
}

/* The request headers of our client (rpc_client.c, submit_call) for a
 * cleartext call without deadline, metadata or token. */
static int start_call(sp_h2_floor *f) {
  const nghttp2_nv nv[] = {
      NV(":method", "POST", 4),
      NV(":scheme", "http", 4),
      NV(":path", "/shardplane.testing.Echo/Unary", 30),
      NV(":authority", f->authority, strlen(f->authority)),
      NV("te", "trailers", 8),
      NV("content-type", "application/grpc", 16),
      NV("user-agent", "shardplane/0.1", 14),
  };
  nghttp2_data_provider p = {.read_callback = read_request};
  int32_t id = nghttp2_submit_request(f->cli, NULL, nv, 7, &p, NULL);
  if (id < 0) return SP_EIO;
  f->c_off[ring(id)] = 0;
  f->outstanding++;
  return 0;
}

/* The server answers once the request has ended, as ours does for a unary
 * call: the response headers of ours (rpc_server.c, submit_headers). */
static int srv_frame_recv(nghttp2_session *s, const nghttp2_frame *fr,
                          void *ud) {
  sp_h2_floor *f = ud;
  if ((fr->hd.type != NGHTTP2_DATA && fr->hd.type != NGHTTP2_HEADERS) ||
      !(fr->hd.flags & NGHTTP2_FLAG_END_STREAM))
    return 0;
  static const nghttp2_nv nv[] = {
      NV(":status", "200", 3),
      NV("content-type", "application/grpc", 16),
  };
  f->s_off[ring(fr->hd.stream_id)] = 0;
  nghttp2_data_provider p = {.read_callback = read_reply};
  if (nghttp2_submit_response(s, fr->hd.stream_id, nv, 2, &p) != 0)
    f->failed = true;
  return 0;
}

static int cli_stream_close(nghttp2_session *s, int32_t id, uint32_t err,
                            void *ud) {
  (void)s;
  (void)id;
  sp_h2_floor *f = ud;
  f->outstanding--;
  if (err != NGHTTP2_NO_ERROR) {
    f->failed = true;
    return 0;
  }
  f->done++;
  if (!f->stop && start_call(f) != 0) f->failed = true;
  return 0;
}

/* Hands everything `from` has to send to `to`; adds the bytes to *moved. */
static int pump(nghttp2_session *from, nghttp2_session *to, size_t *moved) {
  for (;;) {
    const uint8_t *p;
    ssize_t n = nghttp2_session_mem_send(from, &p);
    if (n < 0) return SP_EIO;
    if (n == 0) return 0;
    if (nghttp2_session_mem_recv(to, p, (size_t)n) != n) return SP_EIO;
    *moved += (size_t)n;
  }
}

/* One turn each way; SP_EIO on failure, or when calls are in flight and
 * neither side had anything to send (nothing would ever move again). */
static int exchange(sp_h2_floor *f) {
  size_t moved = 0;
  if (pump(f->cli, f->srv, &moved) != 0 || pump(f->srv, f->cli, &moved) != 0 ||
      f->failed || (moved == 0 && f->outstanding > 0)) {
    f->failed = true;
    return SP_EIO;
  }
  return 0;
}

static int sessions_new(sp_h2_floor *f) {
  nghttp2_session_callbacks *cb;
  if (nghttp2_session_callbacks_new(&cb) != 0) return SP_ENOMEM;
  nghttp2_session_callbacks_set_on_frame_recv_callback(cb, srv_frame_recv);
  nghttp2_option *opt;
  if (nghttp2_option_new(&opt) != 0) {
    nghttp2_session_callbacks_del(cb);
    return SP_ENOMEM;
  }
  nghttp2_option_set_no_closed_streams(opt, 1); /* as our server's */
  int rv = nghttp2_session_server_new2(&f->srv, cb, f, opt);
  nghttp2_option_del(opt);
  nghttp2_session_callbacks_del(cb);
  if (rv != 0) return SP_ENOMEM;
  if (nghttp2_session_callbacks_new(&cb) != 0) return SP_ENOMEM;
  nghttp2_session_callbacks_set_on_stream_close_callback(cb, cli_stream_close);
  rv = nghttp2_session_client_new(&f->cli, cb, f);
  nghttp2_session_callbacks_del(cb);
  if (rv != 0) return SP_ENOMEM;
  /* the SETTINGS and windows of ours (session_new in rpc_server.c and
   * rpc_client.c) */
  nghttp2_settings_entry si[] = {
      {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, SP_RPC_DEFAULT_MAX_STREAMS},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1u << 20},
      {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE,
       (uint32_t)SP_RPC_DEFAULT_MAX_METADATA + 1024},
      {NGHTTP2_SETTINGS_NO_RFC7540_PRIORITIES, 1},
  };
  nghttp2_settings_entry ci[] = {
      {NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1u << 20},
      {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, 2 * SP_RPC_DEFAULT_MAX_METADATA},
      {NGHTTP2_SETTINGS_NO_RFC7540_PRIORITIES, 1},
  };
  if (nghttp2_submit_settings(f->srv, NGHTTP2_FLAG_NONE, si, 4) != 0 ||
      nghttp2_submit_settings(f->cli, NGHTTP2_FLAG_NONE, ci, 4) != 0 ||
      nghttp2_session_set_local_window_size(f->srv, NGHTTP2_FLAG_NONE, 0,
                                            16u << 20) != 0 ||
      nghttp2_session_set_local_window_size(f->cli, NGHTTP2_FLAG_NONE, 0,
                                            16u << 20) != 0)
    return SP_EIO;
  /* the preface and both SETTINGS with their ACKs */
  for (int i = 0; i < 3; i++)
    if (exchange(f) != 0) return SP_EIO;
  return 0;
}

int sp_h2_floor_new(const uint8_t *msg, size_t len, const char *authority,
                    sp_h2_floor **out) {
  if ((msg == NULL && len > 0) || len > (16u << 10) || authority == NULL ||
      out == NULL)
    return SP_EINVAL;
  sp_h2_floor *f = calloc(1, sizeof *f);
  if (f == NULL) return SP_ENOMEM;
  f->frame_len = len + 5;
  f->frame = malloc(f->frame_len);
  f->authority = malloc(strlen(authority) + 1);
  if (f->frame == NULL || f->authority == NULL) {
    sp_h2_floor_free(f);
    return SP_ENOMEM;
  }
  strcpy(f->authority, authority);
  f->frame[0] = 0;
  for (int i = 0; i < 4; i++) f->frame[1 + i] = (uint8_t)(len >> (24 - 8 * i));
  if (len > 0) memcpy(f->frame + 5, msg, len);
  int rc = sessions_new(f);
  if (rc != 0) {
    sp_h2_floor_free(f);
    return rc;
  }
  *out = f;
  return 0;
}

static uint64_t clock_ns(clockid_t id) {
  struct timespec ts;
  clock_gettime(id, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int sp_h2_floor_slice(sp_h2_floor *f, int in_flight, double seconds,
                      uint64_t *cpu_ns, uint64_t *calls) {
  if (f->failed) return SP_EIO;
  if (in_flight < 1 || in_flight > MAX_IN_FLIGHT) return SP_EINVAL;
  uint64_t c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
  uint64_t end = clock_ns(CLOCK_MONOTONIC) + (uint64_t)(seconds * 1e9);
  f->stop = false;
  f->done = 0;
  for (int i = 0; i < in_flight; i++)
    if (start_call(f) != 0) return SP_EIO;
  /* a clock read per 16 exchanges: under 1% of the cheapest one's cost */
  for (unsigned k = 0; f->outstanding > 0; k++) {
    if (exchange(f) != 0) return SP_EIO;
    if (!f->stop && k % 16 == 0 && clock_ns(CLOCK_MONOTONIC) >= end)
      f->stop = true;
  }
  *cpu_ns += clock_ns(CLOCK_THREAD_CPUTIME_ID) - c0;
  *calls += f->done;
  return 0;
}

void sp_h2_floor_free(sp_h2_floor *f) {
  if (f == NULL) return;
  nghttp2_session_del(f->cli);
  nghttp2_session_del(f->srv);
  free(f->frame);
  free(f->authority);
  free(f);
}
