/* One HTTP/2 connection over a libuv TCP handle (or a Unix-socket pipe, for
 * a worker and its host's agent): feeds received bytes to
 * nghttp2 and writes what it produces, one uv_write at a time. Shared by
 * the server and the client so the I/O rules live in one place:
 * - mem_send output is copied into a connection-owned buffer (its pointer is
 *   only valid until the next call) and sent with one write per flush,
 *   tried at once (uv_try_write) and queued with uv_write only for what the
 *   socket did not take;
 * - while a write is in flight nothing more is pulled from nghttp2, so a
 *   peer that does not read stops the data providers (backpressure);
 * - the first answer a small read makes is written as soon as it is ready,
 *   the rest together after it (see sp_h2conn_recv in h2conn.c);
 * - the connection closes once nghttp2 wants neither to read nor to write
 *   and the last write completed;
 * - with TLS (c->tls), ciphertext read goes to OpenSSL and its plaintext to
 *   nghttp2; what nghttp2 produces is encrypted at each flush and the
 *   ciphertext written, with the same one-write-in-flight rule. Nothing of
 *   HTTP/2 is sent or parsed before the handshake completed with ALPN h2. */
#ifndef SP_H2CONN_H
#define SP_H2CONN_H

#include <nghttp2/nghttp2.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

typedef struct sp_h2conn sp_h2conn;
struct sp_tls_conn;

/* A write buffer. Its write request travels with it, so a connection holds
 * a uv_write_t (192 bytes) only while a write is in flight. */
typedef struct sp_h2wbuf {
  uv_write_t req;
  size_t cap; /* bytes in data */
  uint8_t data[];
} sp_h2wbuf;

/* Buffers an owner shares among its connections: reads and flushes run one
 * at a time on a loop, so one spare of each serves them all and an idle
 * connection holds neither (a server with a thousand connections would
 * otherwise keep a thousand of each). A connection that finds a slot empty
 * (its buffer is in use further up the stack) allocates its own. */
typedef struct sp_h2shared {
  uint8_t *rbuf;
  sp_h2wbuf *wbuf;
} sp_h2shared;

struct sp_h2conn {
  /* tcp.data points back to this struct. A pipe shares the stream fields
   * at the same offsets, so every stream call on &tcp serves both; only
   * TCP options (nodelay, peer name) look at which it is. */
  union {
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  };
  nghttp2_session *h2;
  /* Being filled, and in flight (or, once written, kept for the next
   * swap); wlen bytes of wbuf are filled. */
  sp_h2wbuf *wbuf, *wfly;
  size_t wlen;
  bool wfly_copy; /* wfly holds a copy of the bytes, freed once written */
  /* A read buffer kept between reads: a 64 KiB malloc and free per read
   * made glibc consolidate its small-chunk bins every time. */
  uint8_t *rbuf;
  sp_h2shared *shared; /* NULL: this connection keeps its own buffers */
  bool writing, closing, reading;
  /* A cleartext client read what looks like a TLS record from the server
   * (so its calls can say why the connection broke). */
  bool peer_tls;
  /* Done with HTTP/2: our FIN is sent and the peer's last bytes are read
   * and dropped until it closes too or goes quiet, because closing with
   * unread input makes the kernel reset the connection, and the peer then
   * loses the trailers it has not read yet. */
  bool lingering;
  struct sp_h2linger *linger; /* only while lingering */
  bool in_h2; /* inside mem_recv/mem_send: nghttp2 forbids re-entry */
  /* Something to send was queued inside a nghttp2 callback (see
   * sp_h2conn_recv, which parses input up to the first answer). */
  bool want_flush;
  /* direct: inside a read or a write's completion, where a flush writes
   * at once (uv_try_write). hold: such a write went out whole, so what
   * the rest of that read or completion produces waits and leaves in one
   * write when it returns (as it waited for the callback of the one
   * uv_write in flight before). */
  bool direct, hold;
  uint8_t early_off; /* reads left that answer in one batch only */
  /* Where input frames end: header bytes seen of the frame being read
   * (0: none, or its payload is being read), then what is left of the
   * frame (or of the client preface); in between, rx_left gathers the
   * length. Fits the padding before bytes_in, as a coordinator keeps
   * thousands of these. */
  uint8_t rx_hdr_have;
  uint32_t rx_left;
  uint64_t bytes_in, bytes_out;
  /* NULL: cleartext. One pointer, so a cleartext connection pays 8 bytes
   * for TLS; set with sp_h2conn_tls before sp_h2conn_start. */
  struct sp_tls_conn *tls;
  /* Called once after the handle closed; the owner frees everything. */
  void (*on_closed)(sp_h2conn *c);
  /* Called at the end of every flush, outside nghttp2 callbacks: owners run
   * work there that must not happen inside them (user callbacks). */
  void (*on_after_send)(sp_h2conn *c);
  /* Test and fuzzing seam: when set, output is handed here instead of to
   * uv_write (the handle is never connected) and counts as written at once.
   * Non-zero closes the connection, as a failed write would. */
  int (*sink)(sp_h2conn *c, const uint8_t *data, size_t len);
  void *owner;
};

/* Initialises the handle on loop (the caller then connects or accepts). */
int sp_h2conn_init(sp_h2conn *c, uv_loop_t *loop, void *owner);
/* The same with a Unix-socket pipe handle. */
int sp_h2conn_init_pipe(sp_h2conn *c, uv_loop_t *loop, void *owner);
/* Starts reading; input goes to c->h2, which must exist by then. */
int sp_h2conn_start(sp_h2conn *c);
/* Feeds received bytes to nghttp2 and flushes its answers (the first one
 * early); closes the connection when nghttp2 rejects them. The read
 * callback uses it, and so does the in-memory feed used by the fuzz
 * harness. */
void sp_h2conn_recv(sp_h2conn *c, const uint8_t *data, size_t len);
/* Pushes everything nghttp2 has to send. Safe to call at any time: inside
 * nghttp2 callbacks it only notes that there is output, and the flush that
 * follows mem_recv picks it up. */
void sp_h2conn_flush(sp_h2conn *c);
/* Puts TLS under the connection (before sp_h2conn_start; never with a
 * sink). t then belongs to the connection, which frees it when it closes.
 * A client's ClientHello leaves with the first flush. */
void sp_h2conn_tls(sp_h2conn *c, struct sp_tls_conn *t);
/* With TLS: before a close that ends the connection on our side (a client
 * closing, a server's grace running out), tries to send close_notify
 * without blocking; nothing when a write is queued. */
void sp_h2conn_close_notify(sp_h2conn *c);
/* Closes now (no more I/O); on_closed runs later. Idempotent. */
void sp_h2conn_close(sp_h2conn *c);

#endif
