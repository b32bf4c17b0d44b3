/* shardplane's gRPC engine: real gRPC over HTTP/2 (h2c), on libuv + nghttp2,
 * with protobuf-c messages. One engine serves the coordinator and the client
 * library; any stock gRPC client or server interoperates with it.
 *
 * Threading: a server or client lives on one uv_loop_t and every function
 * here must be called on that loop's thread, except the sp_rpc_sync_*
 * wrappers, which own a private loop and may be used from any one thread.
 *
 * Errors: functions return 0 or a negative SP_E* code (sp_error.h). RPC
 * outcomes are gRPC status codes (SP_RPC_OK ... SP_RPC_UNAUTHENTICATED).
 */
#ifndef SP_RPC_H
#define SP_RPC_H

#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "base/sp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* gRPC status codes (grpc/grpc doc/statuscodes.md). */
typedef enum sp_rpc_code {
  SP_RPC_OK = 0,
  SP_RPC_CANCELLED = 1,
  SP_RPC_UNKNOWN = 2,
  SP_RPC_INVALID_ARGUMENT = 3,
  SP_RPC_DEADLINE_EXCEEDED = 4,
  SP_RPC_NOT_FOUND = 5,
  SP_RPC_ALREADY_EXISTS = 6,
  SP_RPC_PERMISSION_DENIED = 7,
  SP_RPC_RESOURCE_EXHAUSTED = 8,
  SP_RPC_FAILED_PRECONDITION = 9,
  SP_RPC_ABORTED = 10,
  SP_RPC_OUT_OF_RANGE = 11,
  SP_RPC_UNIMPLEMENTED = 12,
  SP_RPC_INTERNAL = 13,
  SP_RPC_UNAVAILABLE = 14,
  SP_RPC_DATA_LOSS = 15,
  SP_RPC_UNAUTHENTICATED = 16,
} sp_rpc_code;

/* Splits "host:port" or "[v6]:port"; host gets a NUL-terminated copy.
 * SP_EINVAL if malformed or the port is not 0-65535. */
int sp_rpc_split_addr(const char *addr, char *host, size_t host_cap, int *port);

/* "unix:PATH" names a Unix-domain socket instead of host:port: clients
 * connect to it and servers listen on it. The connection is always
 * cleartext h2c (a client ignores its TLS options for it): such a socket
 * joins processes of one host, and it is the directory holding it and the
 * server's check of the peer's uid that keep others out. */
#define SP_RPC_UNIX_PREFIX "unix:"

/* "OK", "CANCELLED", ...; "UNKNOWN" for out-of-range values. */
const char *sp_rpc_code_name(int code);

#define SP_RPC_STATUS_MESSAGE_MAX 512

/* The outcome of a call: code plus the (decoded) grpc-message. */
typedef struct sp_rpc_status {
  int code;
  char message[SP_RPC_STATUS_MESSAGE_MAX];
} sp_rpc_status;

/* Default limits, mirroring gRPC C-core. */
#define SP_RPC_DEFAULT_MAX_MESSAGE (4u << 20)
#define SP_RPC_DEFAULT_MAX_METADATA (8u << 10)
#define SP_RPC_DEFAULT_MAX_STREAMS 100u
/* A call may queue this many outgoing bytes before sends report SP_EAGAIN:
 * a client that does not read cannot make the server buffer without bound. */
#define SP_RPC_DEFAULT_MAX_PENDING (8u << 20)
/* ... and all calls of one connection together this many. */
#define SP_RPC_DEFAULT_MAX_CONN_PENDING (32u << 20)
/* Limits against clients that hold resources without using them (see
 * sp_rpc_server_opts). */
#define SP_RPC_DEFAULT_PREFACE_TIMEOUT_MS 10000u
#define SP_RPC_DEFAULT_IDLE_TIMEOUT_MS 300000u
#define SP_RPC_DEFAULT_REQUEST_TIMEOUT_MS 30000u
#define SP_RPC_DEFAULT_MAX_BUFFERED (256u << 20)
/* Connections the default leaves to everything else of RLIMIT_NOFILE. */
#define SP_RPC_FD_HEADROOM 64u

/* One metadata entry; -bin values are raw bytes (base64 on the wire). */
typedef struct sp_rpc_md {
  const char *key;
  const uint8_t *value;
  size_t len;
} sp_rpc_md;

/* Resolves "host:port" (numeric, or a name through getaddrinfo; blocking,
 * so only at start-up). SP_EINVAL with the reason in diag. */
int sp_rpc_resolve(const char *addr, struct sockaddr_storage *out,
                   sp_diag *diag);

/* ------------------------------------------------------------------ */
/* Server                                                              */
/* ------------------------------------------------------------------ */

typedef enum sp_rpc_kind {
  SP_RPC_UNARY = 0,
  SP_RPC_SERVER_STREAMING = 1,
  SP_RPC_CLIENT_STREAMING = 2,
  SP_RPC_BIDI_STREAMING = 3,
} sp_rpc_kind;

typedef struct sp_rpc_server sp_rpc_server;
typedef struct sp_rpc_call sp_rpc_call;

/* Handler contract. All callbacks run on the loop thread.
 *
 * - on_message: one decoded request. For UNARY and SERVER_STREAMING it is
 *   called exactly once, after the client half-closed; for the streaming
 *   kinds, once per message as it arrives. The message belongs to the
 *   engine and is freed when the callback returns. Before decoding, the
 *   engine drops unknown fields and refuses (INVALID_ARGUMENT, naming the
 *   field) strings with a NUL byte or invalid UTF-8 and malformed wire
 *   data; raw holds the bytes decoded (without the unknown fields). Handlers run under a budget
 *   per loop iteration (bytes and time): requests beyond it wait for the
 *   next iteration, so timers run between them; a call's messages and its
 *   half-close keep their order.
 * - on_half_close (CLIENT_STREAMING, BIDI): the client sent its last
 *   message. Optional.
 * - on_cancel: the call ended without the handler finishing it (client
 *   cancel, deadline, connection loss, server shutdown). After it returns
 *   the call pointer is invalid. Optional.
 *
 * A handler owns the call from the first callback until it calls
 * sp_rpc_call_finish() or until on_cancel returns, whichever is first; it may
 * finish later, from another loop callback (e.g. a store wait). */
typedef struct sp_rpc_method {
  const char *path; /* "/package.Service/Method", exact match */
  sp_rpc_kind kind;
  const ProtobufCMessageDescriptor *input; /* NULL: raw bytes */
  void (*on_message)(sp_rpc_call *call, const ProtobufCMessage *msg,
                     const uint8_t *raw, size_t raw_len);
  void (*on_half_close)(sp_rpc_call *call);
  void (*on_cancel)(sp_rpc_call *call, int code);
  void *user; /* returned by sp_rpc_call_method_user() */
} sp_rpc_method;

/* TLS for a server (OpenSSL): PEM files, read when the server starts to
 * listen; errors name the file. TLS 1.2 or later, ALPN "h2" only. */
typedef struct sp_rpc_tls_server_opts {
  const char *cert_file; /* certificate chain (PEM); required */
  const char *key_file;  /* its private key (PEM); required */
  /* Non-NULL: mutual TLS; every client must present a certificate that
   * chains to this CA bundle (PEM), or the handshake fails. */
  const char *client_ca_file;
} sp_rpc_tls_server_opts;

/* Who made a call, as the server's authorize hook decided: an application
 * role number (its meaning is the server's) and a name for messages and
 * logs. The hook attaches it; handlers read it. */
typedef struct sp_rpc_principal {
  int role;
  const char *name;
} sp_rpc_principal;

/* Decides whether a call may proceed. Called once per call on the loop
 * thread, as soon as its request headers are complete and before any of
 * its body is read: sp_rpc_call_path, sp_rpc_call_metadata and
 * sp_rpc_call_method_user work; nothing else about the call does yet.
 * Returns SP_RPC_OK (optionally after sp_rpc_call_set_principal), or a
 * status code with a NUL-terminated message written to msg (msg_cap
 * bytes). A refused call is answered Trailers-Only with that status and its
 * stream reset; its body is discarded unread and its handler never hears
 * of it. Never called for grpc.health.v1.Health, which stays open to
 * anyone (it tells only whether the server serves). */
typedef int (*sp_rpc_authorize_fn)(sp_rpc_call *call, void *arg, char *msg,
                                   size_t msg_cap);

typedef struct sp_rpc_server_opts {
  size_t max_message;      /* receive and send limit; 0: default */
  size_t max_metadata;     /* request header bytes; 0: default */
  uint32_t max_streams;    /* SETTINGS_MAX_CONCURRENT_STREAMS; 0: default */
  size_t max_pending;      /* queued outgoing bytes per call; 0: default */
  size_t max_conn_pending; /* ... per connection, all calls; 0: default */
  /* Open connections. When all are taken, a new one is admitted by closing
   * (GOAWAY) the connection with no open call that has been idle longest;
   * with none idle it is refused. 0: the soft RLIMIT_NOFILE at start less
   * a headroom (SP_RPC_FD_HEADROOM, or a quarter of a smaller limit), at
   * most 65536, so accept never meets the fd limit. */
  uint32_t max_connections;
  /* No HPACK dynamic tables in either direction. nghttp2 keeps each table
   * for the life of a connection (about 2 KiB per connection between them,
   * measured by bench/coordinator); without them every call's headers
   * travel in full, about 100 more bytes each way, and small unary calls
   * cost about 20% more CPU (bench/rpc). For servers holding many
   * long-lived connections that make few calls each, like the coordinator.
   * Clients must follow RFC 7541 §4.2 (nghttp2 and gRPC do). */
  bool no_header_tables;
  /* Heap free bytes that, once a burst of calls has freed that many more
   * since the last time, make the connection sweep (at most a second
   * apart) return the heap's free pages to the system: glibc keeps what
   * is freed below memory still in use (rpc_mem.h, sp_rpc_mem_trim). The
   * sweep looks at the heap only after threshold / 1 KiB calls ended
   * since it last did. Process-wide, so for a server that owns its
   * process, like the coordinator. 0: never; nothing without glibc or
   * under a sanitizer. */
  size_t trim_heap_bytes;
  /* NULL: cleartext HTTP/2 (h2c). The struct and its strings need only
   * live until sp_rpc_server_listen returns. */
  const sp_rpc_tls_server_opts *tls;
  /* From accept until a connection's first complete request headers (the
   * HTTP/2 preface, SETTINGS and a HEADERS frame); over it the connection
   * is closed with GOAWAY. 0: SP_RPC_DEFAULT_PREFACE_TIMEOUT_MS. */
  uint64_t preface_timeout_ms;
  /* A connection with no open call for this long is closed with GOAWAY.
   * 0: SP_RPC_DEFAULT_IDLE_TIMEOUT_MS; UINT64_MAX: never. */
  uint64_t idle_timeout_ms;
  /* A unary or server-streaming call's request must be complete (the
   * client half-closed) this long after its headers, whatever deadline the
   * client gave; otherwise the call ends with DEADLINE_EXCEEDED and its
   * buffers are freed. 0: SP_RPC_DEFAULT_REQUEST_TIMEOUT_MS. */
  uint64_t request_timeout_ms;
  /* Request and response bytes buffered by all calls of all connections
   * (partial and undelivered requests, queued responses). A request that
   * would go over it ends with RESOURCE_EXHAUSTED; a send that would,
   * returns SP_ENOMEM. 0: SP_RPC_DEFAULT_MAX_BUFFERED. */
  size_t max_buffered;
  /* NULL: every call proceeds. */
  sp_rpc_authorize_fn authorize;
  void *authorize_arg;
  /* Request metadata are for the authorize hook alone: freed as soon as
   * the request headers are dealt with, so that handlers see none
   * (sp_rpc_call_metadata returns NULL). A call otherwise keeps them as
   * long as it lives: for a server of long-lived streams whose handlers
   * never read them, like the coordinator's Session streams (96 B a
   * stream for a user-agent alone, more with a token). */
  bool metadata_to_authorize;
} sp_rpc_server_opts;

/* Creates a server on `loop` with grpc.health.v1.Health registered ("" is
 * SERVING). opts may be NULL. The caller frees it with sp_rpc_server_free()
 * after the shutdown callback ran (or before listening). A server freed
 * without a shutdown after it had connections (the in-memory feed of the
 * fuzz harness) closes its loop handles then: run the loop once more
 * before uv_loop_close. */
int sp_rpc_server_new(uv_loop_t *loop, const sp_rpc_server_opts *opts,
                      sp_rpc_server **out);

/* Registers methods. The array and strings must outlive the server.
 * SP_EEXIST for a path registered twice, SP_ENOMEM. */
int sp_rpc_server_add_methods(sp_rpc_server *srv, const sp_rpc_method *m,
                              size_t n);

/* Listens on "host:port" ("127.0.0.1:7700", "[::1]:0", "localhost:7700";
 * port 0 picks a free one), or on "unix:PATH" (a new socket file, mode
 * 0600; *port_out gets 0), where a connection whose peer runs under
 * another uid than the server is closed at once (SO_PEERCRED). *port_out, if given, gets the bound port.
 * SP_EINVAL for a malformed address, SP_EIO (with the reason in diag)
 * when it cannot bind, e.g. the port is in use. */
int sp_rpc_server_listen(sp_rpc_server *srv, const char *addr, int *port_out,
                         sp_diag *diag);

/* Graceful shutdown: stop accepting, GOAWAY every connection, let calls in
 * flight finish (handlers still running after grace_ms are cancelled with
 * UNAVAILABLE), close, then run done(srv, arg) on the loop. */
void sp_rpc_server_shutdown(sp_rpc_server *srv, uint64_t grace_ms,
                            void (*done)(sp_rpc_server *, void *), void *arg);
void sp_rpc_server_free(sp_rpc_server *srv);

/* Health status of a service name ("" is the whole server). */
typedef enum sp_rpc_health {
  SP_HEALTH_UNKNOWN = 0,
  SP_HEALTH_SERVING = 1,
  SP_HEALTH_NOT_SERVING = 2,
} sp_rpc_health;
int sp_rpc_server_set_health(sp_rpc_server *srv, const char *service,
                             sp_rpc_health status);

/* Counters for tests and the status command. */
typedef struct sp_rpc_server_stats {
  uint64_t connections_open, connections_total, calls_open, calls_total;
  uint64_t bytes_in, bytes_out;
  /* connections closed for a limit: idle (also to admit a new one), no
   * request within the preface timeout, refused with every slot busy */
  uint64_t connections_idle_closed, connections_preface_closed;
  uint64_t connections_refused;
  /* calls ended because the buffer budget or request timeout was hit */
  uint64_t calls_over_budget, calls_request_timeout;
  /* buffered request and response bytes now, and the most seen */
  uint64_t buffered_bytes, buffered_peak;
  /* requests handed to handlers later, under the per-iteration budget */
  uint64_t deliveries_deferred;
  /* Request body bytes taken in by calls (buffered or decoded); the DATA
   * of a call that was refused or had already ended is dropped unread and
   * not counted. */
  uint64_t body_bytes;
  uint64_t calls_refused; /* by the authorize hook */
  uint64_t heap_trims;    /* free pages returned (trim_heap_bytes) */
} sp_rpc_server_stats;
void sp_rpc_server_get_stats(const sp_rpc_server *srv, sp_rpc_server_stats *s);

/* Per-method call statistics (the coordinator's /metrics): every call of
 * a registered method is counted once, when it ends, by its status (the
 * handler's or the engine's; a call cancelled or cut off without one
 * counts as CANCELLED, or UNAVAILABLE when the server shuts down), with
 * its duration from its request headers to its end (the status queued,
 * or the cancel): a stream's whole life. Calls of unknown paths are
 * counted nowhere. The record is a fixed array per method, so a call
 * costs two clock reads and no allocation. */
#define SP_RPC_CODES 17 /* OK .. UNAUTHENTICATED */
#define SP_RPC_DURATION_BUCKETS 20
/* The buckets' upper bounds in seconds (0.0001 .. 3600), increasing; a
 * last bucket, over the last bound, is implied. */
extern const double sp_rpc_duration_bounds[SP_RPC_DURATION_BUCKETS];
typedef struct sp_rpc_method_stats {
  const char *path; /* the method's, borrowed: "/pkg.Service/Method" */
  uint64_t calls[SP_RPC_CODES]; /* ended calls by status code */
  /* bucket[i]: calls that took more than bound i - 1 and at most bound i
   * (not cumulative); bucket[SP_RPC_DURATION_BUCKETS]: over the last */
  uint64_t bucket[SP_RPC_DURATION_BUCKETS + 1];
  uint64_t count; /* ended calls: the sum of calls[] */
  double sum_s;   /* their durations added up, seconds */
} sp_rpc_method_stats;
/* The statistics of the i-th registered method (in the order of
 * registration; the health service's first): 0, or SP_ENOENT past the
 * last (SP_EINVAL for NULL arguments). */
int sp_rpc_server_method_stats(const sp_rpc_server *srv, size_t i,
                               sp_rpc_method_stats *out);

/* ---- calls (server side) ---- */

/* Queues one response message. SP_ETOOBIG: the packed message is over the
 * send limit (nothing queued); SP_EAGAIN: the call's queue is full, wait for
 * on_writable; SP_ENOMEM: out of memory or over the server's buffer budget
 * (max_buffered); SP_ESTATE: already finished, or a second message on a
 * unary/client-streaming method. */
int sp_rpc_call_send(sp_rpc_call *call, const ProtobufCMessage *msg);
int sp_rpc_call_send_raw(sp_rpc_call *call, const uint8_t *data, size_t len);

/* Sends the response headers now (with any metadata added so far), so a
 * streaming client knows the call is established before the first
 * message. Optional: the first send does it anyway. */
int sp_rpc_call_start(sp_rpc_call *call);

/* Sends the one response of a unary-response call and finishes it OK; if
 * the message cannot be sent, finishes with RESOURCE_EXHAUSTED (over the
 * send limit: the handler should page) or INTERNAL instead. Returns what
 * sp_rpc_call_send returned. The call is invalid afterwards either way. */
int sp_rpc_call_reply(sp_rpc_call *call, const ProtobufCMessage *msg);

/* Ends the call with a status; message may be NULL. Queued messages are
 * sent first, then the trailers. The call is invalid afterwards. */
int sp_rpc_call_finish(sp_rpc_call *call, int code, const char *message);
/* Like finish, with printf formatting of the message. */
int sp_rpc_call_finishf(sp_rpc_call *call, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Adds a response metadata entry (sent with the response headers). Only
 * before the first message. Keys must be valid (lower case, [0-9a-z_.-]);
 * "-bin" keys carry binary values. */
int sp_rpc_call_add_metadata(sp_rpc_call *call, const char *key,
                             const uint8_t *value, size_t len);

/* A request metadata value (decoded for -bin keys), or NULL. The pointer is
 * valid while the call is; with metadata_to_authorize, only inside the
 * authorize hook (NULL in handlers). */
const uint8_t *sp_rpc_call_metadata(const sp_rpc_call *call, const char *key,
                                    size_t *len);

/* The identity the authorize hook attached, or NULL (no hook, or it
 * attached none). set keeps the pointer: *p must outlive the call. */
void sp_rpc_call_set_principal(sp_rpc_call *call, const sp_rpc_principal *p);
const sp_rpc_principal *sp_rpc_call_principal(const sp_rpc_call *call);

/* Bytes queued and not yet handed to the transport. */
size_t sp_rpc_call_pending(const sp_rpc_call *call);
/* Called once when the pending bytes drop below half the limit after a send
 * returned SP_EAGAIN. */
void sp_rpc_call_on_writable(sp_rpc_call *call, void (*cb)(sp_rpc_call *));

/* Milliseconds until the client's deadline, or -1 when it set none. */
int64_t sp_rpc_call_remaining_ms(const sp_rpc_call *call);
const char *sp_rpc_call_path(const sp_rpc_call *call);
void *sp_rpc_call_method_user(const sp_rpc_call *call);
void sp_rpc_call_set_user(sp_rpc_call *call, void *user);
void *sp_rpc_call_user(const sp_rpc_call *call);
/* A per-connection id, stable while the connection lives. */
uint64_t sp_rpc_call_connection_id(const sp_rpc_call *call);
/* The peer as "ip:port" ("unix:pid=N" on a Unix socket). */
const char *sp_rpc_call_peer(const sp_rpc_call *call);
/* The loop the call runs on (for the handler's own timers). */
uv_loop_t *sp_rpc_call_loop(const sp_rpc_call *call);

/* ------------------------------------------------------------------ */
/* Client                                                              */
/* ------------------------------------------------------------------ */

typedef struct sp_rpc_client sp_rpc_client;
typedef struct sp_rpc_ccall sp_rpc_ccall;

/* TLS for a client (OpenSSL): the server's certificate is verified
 * against ca_file and its name against server_name. */
typedef struct sp_rpc_tls_client_opts {
  const char *ca_file; /* CA bundle (PEM); NULL: the system's trust store */
  const char
      *cert_file; /* client certificate (PEM) for mutual TLS; NULL: none */
  const char *key_file; /* its private key; required with cert_file */
  /* The name the certificate must carry (DNS name or IP address), also
   * sent as SNI; NULL: the host part of the address. */
  const char *server_name;
} sp_rpc_tls_client_opts;

typedef struct sp_rpc_client_opts {
  /* Connection attempts retry with jittered exponential backoff (100 ms
   * initial, x1.6, +-20 %, 5 s cap) until this many ms have passed since the
   * first attempt; 0: 20000. Calls made while connecting wait for it. */
  uint64_t connect_timeout_ms;
  size_t max_message; /* receive limit; 0: SP_RPC_DEFAULT_MAX_MESSAGE */
  /* Send limit; 0: none beyond the 4 GiB framing bound, as gRPC C-core
   * (servers enforce their own receive limit). */
  size_t max_send_message;
  /* NULL: cleartext HTTP/2 (h2c). Copied by sp_rpc_client_open, which
   * reads the files then: one it cannot use makes every call fail with
   * UNAVAILABLE and a message naming it. connect_timeout_ms bounds the
   * handshake too; a failed verification is not retried. */
  const sp_rpc_tls_client_opts *tls;
  /* Non-NULL: sent as "authorization: Bearer <token>" on every call.
   * Copied by sp_rpc_client_open, which returns SP_EINVAL for a token that
   * is empty, over 1 KiB or not printable ASCII (it could not be a header
   * value). */
  const char *token;
} sp_rpc_client_opts;

/* Creates a client for "host:port" (or "unix:PATH") on loop; connects on the first call.
 * The client is freed with sp_rpc_client_close(). SP_EINVAL for a bad
 * address. */
int sp_rpc_client_open(uv_loop_t *loop, const char *addr,
                       const sp_rpc_client_opts *opts, sp_rpc_client **out);

/* Fails every open call with CANCELLED, closes the connection and frees the
 * client once libuv has released its handles (done may be NULL). */
void sp_rpc_client_close(sp_rpc_client *c, void (*done)(void *), void *arg);

typedef struct sp_rpc_ccall_cbs {
  /* One response message; bytes valid during the callback. Optional. */
  void (*on_message)(sp_rpc_ccall *call, const uint8_t *data, size_t len,
                     void *user);
  /* Exactly once per call; the call is freed after it returns. */
  void (*on_close)(sp_rpc_ccall *call, const sp_rpc_status *status, void *user);
} sp_rpc_ccall_cbs;

/* Starts a call. timeout_ms 0 means no deadline. md may be NULL. The call
 * is alive until on_close returns. */
int sp_rpc_client_start(sp_rpc_client *c, const char *path, const sp_rpc_md *md,
                        size_t n_md, uint64_t timeout_ms,
                        const sp_rpc_ccall_cbs *cbs, void *user,
                        sp_rpc_ccall **out);
/* Queues one request message (already packed). SP_ETOOBIG over the limit,
 * SP_ESTATE after close_send or once closed. */
int sp_rpc_ccall_send(sp_rpc_ccall *call, const uint8_t *data, size_t len);
int sp_rpc_ccall_send_msg(sp_rpc_ccall *call, const ProtobufCMessage *msg);
/* Half-closes: no more messages from this side. */
int sp_rpc_ccall_close_send(sp_rpc_ccall *call);
/* Cancels (RST_STREAM CANCEL); on_close follows with CANCELLED. */
void sp_rpc_ccall_cancel(sp_rpc_ccall *call);
/* Response header or trailer metadata received so far, or NULL. */
const uint8_t *sp_rpc_ccall_metadata(const sp_rpc_ccall *call, const char *key,
                                     size_t *len);

/* ------------------------------------------------------------------ */
/* Blocking wrapper                                                    */
/* ------------------------------------------------------------------ */

/* A client with its own loop, for simple programs and tests. Not
 * thread-safe: use one sp_rpc_sync per thread. */
typedef struct sp_rpc_sync sp_rpc_sync;

int sp_rpc_sync_open(const char *addr, uint64_t connect_timeout_ms,
                     sp_rpc_sync **out);
/* The same with every client option (TLS, token, limits); opts may be NULL. */
int sp_rpc_sync_open_opts(const char *addr, const sp_rpc_client_opts *opts,
                          sp_rpc_sync **out);
void sp_rpc_sync_close(sp_rpc_sync *s);

/* One unary call. On return *status holds the outcome; when it is OK and
 * resp_desc is given, *resp is the decoded response (free it with
 * protobuf_c_message_free_unpacked(*resp, NULL)). Returns 0 whenever the
 * call completed (whatever the status), SP_EINVAL for bad arguments. */
int sp_rpc_sync_unary(sp_rpc_sync *s, const char *path,
                      const ProtobufCMessage *req,
                      const ProtobufCMessageDescriptor *resp_desc,
                      uint64_t timeout_ms, ProtobufCMessage **resp,
                      sp_rpc_status *status);

/* Streaming from the blocking side. */
typedef struct sp_rpc_sync_stream sp_rpc_sync_stream;
int sp_rpc_sync_stream_open(sp_rpc_sync *s, const char *path,
                            uint64_t timeout_ms, const sp_rpc_md *md,
                            size_t n_md, sp_rpc_sync_stream **out);
int sp_rpc_sync_stream_send(sp_rpc_sync_stream *st, const ProtobufCMessage *m);
/* Sends bytes as one message, whatever they are (tests of bad input). */
int sp_rpc_sync_stream_send_raw(sp_rpc_sync_stream *st, const uint8_t *data,
                                size_t len);
int sp_rpc_sync_stream_close_send(sp_rpc_sync_stream *st);
/* Waits up to wait_ms (0: forever) for the next message. Returns 0 with
 * *msg set (caller frees with protobuf_c_message_free_unpacked), SP_ENOENT
 * when the call ended (see *status), SP_ETIMEDOUT when nothing came in
 * time (the call goes on), SP_EFORMAT if the message does not decode. */
int sp_rpc_sync_stream_recv(sp_rpc_sync_stream *st,
                            const ProtobufCMessageDescriptor *desc,
                            uint64_t wait_ms, ProtobufCMessage **msg,
                            sp_rpc_status *status);
/* Cancels if still open, then frees. */
void sp_rpc_sync_stream_close(sp_rpc_sync_stream *st);

#ifdef __cplusplus
}
#endif
#endif
