#include "h2conn.h"

#include "rpc_tls.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>

/* One flush sends at most this much; the rest waits for the write to
 * complete, which bounds the memory a slow peer can pin. */
#define SP_H2_WRITE_CHUNK (256u << 10)
/* With a shared fill buffer, writes up to this size go out from an exact
 * copy (see flush_once); larger ones take the fill buffer along, where a
 * copy would cost more than the buffer it spares. */
#define SP_H2_COPY_MAX (16u << 10)

static void on_handle_closed(uv_handle_t *h) {
  sp_h2conn *c = h->data;
  free(c->wbuf);
  free(c->wfly);
  free(c->rbuf);
  c->wbuf = c->wfly = NULL;
  c->rbuf = NULL;
  if (c->h2 != NULL) {
    nghttp2_session_del(c->h2);
    c->h2 = NULL;
  }
  /* freed after on_closed, which frees c but may read why TLS failed */
  sp_tls_conn *t = c->tls;
  if (c->on_closed) c->on_closed(c);
  sp_tls_conn_free(t);
}

int sp_h2conn_init(sp_h2conn *c, uv_loop_t *loop, void *owner) {
  memset(c, 0, sizeof *c);
  c->owner = owner;
  int rc = uv_tcp_init(loop, &c->tcp);
  if (rc != 0) return rc;
  c->tcp.data = c;
  return 0;
}

int sp_h2conn_init_pipe(sp_h2conn *c, uv_loop_t *loop, void *owner) {
  memset(c, 0, sizeof *c);
  c->owner = owner;
  int rc = uv_pipe_init(loop, &c->pipe, 0);
  if (rc != 0) return rc;
  c->pipe.data = c;
  return 0;
}

/* A finished connection waits for the peer to close its side, or for it to
 * have been quiet this long (it has read what we sent by then), and never
 * longer than the cap. */
#define SP_H2_LINGER_QUIET_MS 200
#define SP_H2_LINGER_MAX_MS 2000

/* What lingering needs, allocated only then, so the thousands of open
 * connections a coordinator holds do not each carry it: the quiet timer
 * and the shutdown request. Freed when both are done with it (the timer
 * closed, the shutdown completed or cancelled), in either order. */
typedef struct sp_h2linger {
  uv_timer_t timer; /* first: a handle pointer is the struct's */
  uv_shutdown_t req;
  uint64_t until; /* uv_now() ms: never linger past it */
  int refs;
} sp_h2linger;

static void linger_unref(sp_h2linger *l) {
  if (--l->refs == 0) free(l);
}

static void linger_timer_closed(uv_handle_t *h) {
  linger_unref((sp_h2linger *)h);
}

void sp_h2conn_close(sp_h2conn *c) {
  if (c->closing) return;
  c->closing = true;
  if (c->linger != NULL) {
    uv_timer_stop(&c->linger->timer);
    uv_close((uv_handle_t *)&c->linger->timer, linger_timer_closed);
    c->linger = NULL;
  }
  if (c->reading) uv_read_stop((uv_stream_t *)&c->tcp);
  uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
}

static void on_linger_timeout(uv_timer_t *t) { sp_h2conn_close(t->data); }

/* Runs before the handle's close callback, even when the close cancels
 * the shutdown, so the connection is still there. */
static void on_shutdown_done(uv_shutdown_t *req, int status) {
  sp_h2linger *l = (sp_h2linger *)((char *)req - offsetof(sp_h2linger, req));
  if (status != 0) sp_h2conn_close(req->data);
  linger_unref(l);
}

/* The orderly end: see `lingering` in h2conn.h. */
static void linger(sp_h2conn *c) {
  if (c->lingering || c->closing) return;
  if (c->sink != NULL || !c->reading) {
    sp_h2conn_close(c);
    return;
  }
  c->lingering = true;
  sp_h2linger *l = malloc(sizeof *l);
  if (l == NULL) {
    sp_h2conn_close(c);
    return;
  }
  l->req.data = c;
  if (uv_shutdown(&l->req, (uv_stream_t *)&c->tcp, on_shutdown_done) != 0) {
    free(l);
    sp_h2conn_close(c);
    return;
  }
  l->refs = 2; /* the shutdown request and the timer */
  uv_timer_init(c->tcp.loop, &l->timer);
  l->timer.data = c;
  /* a flush may run outside the loop (a blocking client's close) */
  uv_update_time(c->tcp.loop);
  l->until = uv_now(c->tcp.loop) + SP_H2_LINGER_MAX_MS;
  c->linger = l;
  uv_timer_start(&l->timer, on_linger_timeout, SP_H2_LINGER_QUIET_MS, 0);
}

/* Every read buffer has this size (libuv suggests 64 KiB). */
#define SP_H2_READ_BUF (64u << 10)

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)suggested;
  sp_h2conn *c = h->data;
  /* reuse the spare buffer; a second one only if it is in use */
  uint8_t **spare = c->shared != NULL ? &c->shared->rbuf : &c->rbuf;
  buf->base = (char *)*spare;
  *spare = NULL;
  if (buf->base == NULL) buf->base = malloc(SP_H2_READ_BUF);
  buf->len = buf->base ? SP_H2_READ_BUF : 0;
}

/* Keeps a read buffer as the spare, or frees it if there is one already. */
static void read_buf_done(sp_h2conn *c, char *base) {
  if (c->shared != NULL && c->shared->rbuf == NULL)
    c->shared->rbuf = (uint8_t *)base;
  else if (c->shared == NULL && c->rbuf == NULL && !c->closing)
    c->rbuf = (uint8_t *)base;
  else
    free(base);
}

/* Input goes to nghttp2 in pieces of at most this much, each followed by a
 * flush: the answers to the first requests of a large read leave while the
 * rest is parsed, so the peer works on them meanwhile instead of waiting
 * for the whole batch (measured by bench/rpc: with 64 calls in flight on a
 * 2-CPU machine, 1.7x the throughput at the same CPU cost per call). */
#define SP_H2_RECV_PIECE (4u << 10)
/* After an early answer that cost us the CPU (see sp_h2conn_recv), this
 * many reads answer in one batch before the next early answer is tried. */
#define SP_H2_EARLY_BACKOFF 64

/* Moves the frame walker over data[0..len) and stops right after the first
 * frame (or the client preface) that ends there; returns the bytes passed.
 * It only decides where input is cut before nghttp2 parses it, never what
 * nghttp2 gets, so input that is not HTTP/2 at all cuts oddly but is
 * parsed (and refused) as before. */
static size_t walk_frame(sp_h2conn *c, const uint8_t *data, size_t len) {
  size_t off = 0;
  while (off < len) {
    if (c->rx_hdr_have == 0 && c->rx_left > 0) { /* inside a payload */
      size_t n = len - off < c->rx_left ? len - off : c->rx_left;
      c->rx_left -= (uint32_t)n;
      off += n;
      if (c->rx_left == 0) return off;
      continue;
    }
    if (c->rx_hdr_have == 0 && len - off >= 9) {
      /* a whole frame header here: read at once (a byte at a time, the
       * walk cost 330 of a client's 12,300 instructions per unary call and
       * 210 of a server's 17,300: callgrind, 8 callers) */
      c->rx_left = (uint32_t)data[off] << 16 | (uint32_t)data[off + 1] << 8 |
                   data[off + 2];
      off += 9;
      if (c->rx_left == 0) return off;
      continue;
    }
    /* a frame header: a 24-bit payload length, then 6 bytes we skip */
    if (c->rx_hdr_have < 3) c->rx_left = c->rx_left << 8 | data[off];
    off++;
    if (++c->rx_hdr_have == 9) {
      c->rx_hdr_have = 0;
      if (c->rx_left == 0) return off;
    }
  }
  return off;
}

/* Whether this thread was switched out against its will since *mark, which
 * it then updates. Where the count is unknown it says no. */
static bool preempted_since(long *mark) {
#ifdef RUSAGE_THREAD
  struct rusage ru;
  if (getrusage(RUSAGE_THREAD, &ru) != 0) return false;
  bool yes = *mark >= 0 && ru.ru_nivcsw != *mark;
  *mark = ru.ru_nivcsw;
  return yes;
#else
  (void)mark;
  return false;
#endif
}

/* A read that fits in one piece is parsed one frame at a time until the
 * first answer it makes is ready, and that answer is written at once; the
 * rest follows, and its answers leave together once that write completes.
 * The peer, which may well be idle waiting for us, starts on the first
 * answer while we parse the rest instead of waking only for the whole
 * batch. With 8 calls in flight on one connection and the two ends on
 * different CPUs, each end otherwise sleeps through every round trip, and
 * on the 2-CPU VM bench/rpc runs on, a wake-up across CPUs takes 30 us or
 * more: there, 8 callers make 1.4x the calls per second. A larger read
 * already answers after its first piece, which leaves a batch big enough
 * to keep the peer busy; cut at its first answer, the peer would get that
 * answer alone and then all the rest (64 callers: 35% fewer calls/s).
 *
 * When the peer runs on our CPU the early answer cannot overlap anything:
 * it wakes the peer, which takes the CPU from us, answers the few calls it
 * has, and the batches split, each paying its own system calls (both ends
 * on one CPU, 8 callers: 20% fewer calls/s). That shows as an involuntary
 * context switch during the early write; after one, SP_H2_EARLY_BACKOFF
 * reads answer in one batch before an early answer is tried again (which
 * leaves that case within 4% of batching alone). */
static void recv_pieces(sp_h2conn *c, const uint8_t *data, size_t len) {
  if (c->bytes_in == 0) {
    if (nghttp2_session_check_server_session(c->h2))
      c->rx_left = NGHTTP2_CLIENT_MAGIC_LEN; /* the preface is no frame */
    else if (c->tls == NULL && len >= 3 && (data[0] == 22 || data[0] == 21) &&
             data[1] == 3) /* a handshake or alert record, TLS 1.x */
      c->peer_tls = true;
  }
  bool early = !c->writing && c->early_off == 0 && len <= SP_H2_RECV_PIECE;
  if (c->early_off > 0) c->early_off--;
  while (len > 0) {
    if (c->closing || c->h2 == NULL) return;
    size_t n = len < SP_H2_RECV_PIECE ? len : SP_H2_RECV_PIECE;
    if (early) {
      n = walk_frame(c, data, len);
    } else {
      for (size_t off = 0; off < n;) off += walk_frame(c, data + off, n - off);
    }
    c->bytes_in += (uint64_t)n;
    c->want_flush = false;
    c->in_h2 = true;
    ssize_t rv = nghttp2_session_mem_recv(c->h2, data, n);
    c->in_h2 = false;
    if (rv < 0) {
      /* bad magic, flooding, or a callback failure: the peer is broken */
      sp_h2conn_close(c);
      return;
    }
    data += n;
    len -= n;
    if (early && len > 0) {
      if (!c->want_flush) continue;
      early = false;
      if (c->sink == NULL) { /* a real write: did it cost us the CPU? */
        long mark = -1;
        preempted_since(&mark);
        uint64_t out = c->bytes_out;
        sp_h2conn_flush(c);
        if (c->bytes_out != out && preempted_since(&mark))
          c->early_off = SP_H2_EARLY_BACKOFF;
        continue;
      }
    }
    sp_h2conn_flush(c);
  }
}

/* Flushes until nothing is held back (see `hold`). */
static void release_hold(sp_h2conn *c) {
  while (c->hold && !c->closing) {
    c->hold = false;
    sp_h2conn_flush(c);
  }
}

void sp_h2conn_recv(sp_h2conn *c, const uint8_t *data, size_t len) {
  if (c->h2 == NULL) return;
  if (c->direct) {
    recv_pieces(c, data, len);
    return;
  }
  c->direct = true;
  recv_pieces(c, data, len);
  release_hold(c);
  c->direct = false;
}

/* Ciphertext a peer that does not read may make us queue (answers to its
 * key updates, say) while our write is stuck. */
#define SP_H2_TLS_BACKLOG_MAX (1u << 20)

/* Ciphertext in buf[0..n) of a buffer of cap bytes: into OpenSSL, then
 * the handshake or the plaintext for nghttp2, decrypted into the same
 * buffer (OpenSSL has copied the ciphertext), so a read costs no second
 * buffer. */
static void tls_recv(sp_h2conn *c, uint8_t *buf, size_t n, size_t cap) {
  sp_tls_conn *t = c->tls;
  if (sp_tls_conn_feed(t, buf, n) != 0) {
    sp_h2conn_close(c);
    return;
  }
  if (!t->ready) {
    /* in progress: send our next flight; failed: send the alert, then
     * linger (see flush_tls) */
    if (sp_tls_conn_handshake(t) != 1) {
      sp_h2conn_flush(c);
      return;
    }
    if (t->on_ready != NULL) t->on_ready(c);
    if (c->closing) return;
  }
  long r = 0;
  do {
    size_t got = 0;
    while (got < cap && (r = sp_tls_conn_read(t, buf + got, cap - got)) > 0)
      got += (size_t)r;
    if (got > 0) sp_h2conn_recv(c, buf, got);
    if (c->closing || c->lingering) return;
    if (r == SP_ENOENT) { /* the peer's close_notify: its end of stream */
      sp_h2conn_close(c);
      return;
    }
  } while (r > 0);
  if (c->writing && sp_tls_conn_pending(t) > SP_H2_TLS_BACKLOG_MAX) {
    sp_h2conn_close(c);
    return;
  }
  /* handshake messages, key updates, or the alert of a failure */
  sp_h2conn_flush(c);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  sp_h2conn *c = s->data;
  if (nread < 0) {
    free(buf->base);
    sp_tls_conn *t = c->tls;
    if (t != NULL && !t->ready && !t->failed) /* retrying may help */
      snprintf(t->err, sizeof t->err,
               "the connection was closed during the handshake (%s)",
               nread == UV_EOF ? "end of stream" : uv_strerror((int)nread));
    sp_h2conn_close(c); /* EOF or error: streams end in on_stream_close */
    return;
  }
  if (c->lingering) { /* HTTP/2 is over; only waiting for the peer's FIN */
    read_buf_done(c, buf->base);
    uv_update_time(c->tcp.loop);
    uint64_t now = uv_now(c->tcp.loop);
    if (c->linger == NULL || now >= c->linger->until)
      sp_h2conn_close(c);
    else /* the peer is still talking: wait again */
      uv_timer_start(&c->linger->timer, on_linger_timeout,
                     SP_H2_LINGER_QUIET_MS, 0);
    return;
  }
  if (c->tls != NULL)
    tls_recv(c, (uint8_t *)buf->base, (size_t)nread, buf->len);
  else
    sp_h2conn_recv(c, (const uint8_t *)buf->base, (size_t)nread);
  read_buf_done(c, buf->base);
}

void sp_h2conn_tls(sp_h2conn *c, sp_tls_conn *t) { c->tls = t; }

void sp_h2conn_close_notify(sp_h2conn *c) {
  sp_tls_conn *t = c->tls;
  if (t == NULL || c->closing || c->writing || c->lingering || !t->ready ||
      t->failed || t->shutdown_sent)
    return;
  sp_tls_conn_shutdown(t);
  /* one alert record, a few dozen bytes; a TLS 1.2 one has no more */
  uint8_t buf[128];
  size_t n = sp_tls_conn_pending(t);
  if (n == 0 || n > sizeof buf) return;
  n = sp_tls_conn_take(t, buf, n);
  uv_os_fd_t fd;
  if (uv_fileno((uv_handle_t *)&c->tcp, &fd) != 0) return;
  /* best effort, as the socket closes right after either way; no SIGPIPE
   * if the peer is gone, whatever the program does with the signal */
  (void)send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
}

int sp_h2conn_start(sp_h2conn *c) {
  int rc = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
  if (rc == 0) c->reading = true;
  return rc;
}

static void on_written(uv_write_t *req, int status) {
  sp_h2conn *c = req->data;
  c->writing = false;
  if (c->wfly_copy) {
    free(c->wfly);
    c->wfly = NULL;
    c->wfly_copy = false;
  }
  if (status != 0) {
    sp_h2conn_close(c);
    return;
  }
  /* what queued up behind the write goes out at once, as one write */
  bool outer = !c->direct;
  c->direct = true;
  sp_h2conn_flush(c);
  if (!outer) return;
  release_hold(c);
  c->direct = false;
}

static void flush_once(sp_h2conn *c);

void sp_h2conn_flush(sp_h2conn *c) {
  if (c->in_h2) {
    c->want_flush = true; /* sp_h2conn_recv flushes once nghttp2 returns */
    return;
  }
  flush_once(c);
  if (c->on_after_send && !c->closing) c->on_after_send(c);
}

/* Takes the shared write buffer when this connection holds none. */
static void wbuf_take(sp_h2conn *c) {
  if (c->wbuf != NULL || c->shared == NULL || c->shared->wbuf == NULL) return;
  c->wbuf = c->shared->wbuf;
  c->shared->wbuf = NULL;
}

/* With a shared slot: gives a write buffer back, or frees it. */
static void wbuf_put(sp_h2conn *c, sp_h2wbuf **buf) {
  if (c->shared == NULL || *buf == NULL) return;
  if (c->shared->wbuf == NULL)
    c->shared->wbuf = *buf;
  else
    free(*buf);
  *buf = NULL;
}

/* Moves what nghttp2 has to send into c->wbuf, up to a write chunk;
 * false when that failed and the connection is closing. */
static bool pull_h2(sp_h2conn *c) {
  while (c->wlen < SP_H2_WRITE_CHUNK) {
    const uint8_t *p;
    c->in_h2 = true;
    ssize_t n = nghttp2_session_mem_send(c->h2, &p);
    c->in_h2 = false;
    if (n < 0) {
      sp_h2conn_close(c);
      return false;
    }
    if (n == 0) break;
    size_t cap = c->wbuf != NULL ? c->wbuf->cap : 0;
    if (c->wlen + (size_t)n > cap) {
      cap = cap ? cap : 2048;
      while (cap < c->wlen + (size_t)n) cap *= 2;
      sp_h2wbuf *b = realloc(c->wbuf, sizeof *b + cap);
      if (b == NULL) {
        sp_h2conn_close(c);
        return false;
      }
      b->cap = cap;
      c->wbuf = b;
    }
    memcpy(c->wbuf->data + c->wlen, p, (size_t)n);
    c->wlen += (size_t)n;
  }
  return true;
}

/* The TLS flush: nghttp2's output goes through SSL_write once the
 * handshake is done (never before), and whatever ciphertext OpenSSL has
 * (handshake flights, session tickets, key updates, alerts, close_notify)
 * leaves in one uv_write. The ciphertext is copied out of OpenSSL's
 * memory BIO into a buffer of its exact size, freed once written, as
 * reads may add to the BIO while the write is in flight. */
static void flush_tls(sp_h2conn *c) {
  sp_tls_conn *t = c->tls;
  if (t->ready && !t->failed) {
    wbuf_take(c);
    if (!pull_h2(c)) return;
    if (c->wlen > 0) {
      sp_tls_conn_write(t, c->wbuf->data, c->wlen); /* failed: an alert */
      c->wlen = 0;
    }
    wbuf_put(c, &c->wbuf);
  }
  size_t n = sp_tls_conn_pending(t);
  if (n == 0 && t->ready && !t->failed && !nghttp2_session_want_read(c->h2) &&
      !nghttp2_session_want_write(c->h2)) {
    sp_tls_conn_shutdown(t); /* the orderly end: close_notify, then FIN */
    n = sp_tls_conn_pending(t);
  }
  if (n == 0) {
    if (t->failed || t->shutdown_sent) linger(c);
    return;
  }
  sp_h2wbuf *fly = malloc(sizeof *fly + n);
  if (fly == NULL) {
    sp_h2conn_close(c);
    return;
  }
  fly->cap = n;
  n = sp_tls_conn_take(t, fly->data, n);
  free(c->wfly);
  c->wfly = fly;
  c->wfly_copy = true;
  uv_buf_t b = uv_buf_init((char *)fly->data, (unsigned)n);
  c->bytes_out += n;
  fly->req.data = c;
  if (uv_write(&fly->req, (uv_stream_t *)&c->tcp, &b, 1, on_written) != 0) {
    sp_h2conn_close(c);
    return;
  }
  c->writing = true;
}

static void flush_once(sp_h2conn *c) {
  if (c->closing || c->lingering || c->writing || c->h2 == NULL) return;
  if (c->tls != NULL) {
    flush_tls(c);
    return;
  }
  wbuf_take(c);
again:
  if (!pull_h2(c)) return;
  if (c->wlen > 0 && c->sink != NULL) {
    /* memory sink: the "write" completes at once, so keep pulling as
     * on_written would, without recursing */
    size_t n = c->wlen;
    c->bytes_out += n;
    c->wlen = 0;
    if (c->sink(c, c->wbuf->data, n) != 0) {
      sp_h2conn_close(c);
      return;
    }
    goto again;
  }
  if (c->wlen > 0 && c->hold) return; /* release_hold writes it */
  if (c->wlen > 0) {
    /* The answers to a read, and what queued up behind a write, are
     * written at once: on loopback the write nearly always completes, and
     * then no write request, no copy of the bytes and no callback on a
     * later loop iteration are needed (bench/rpc, 1 caller: a uv_write was
     * a malloc, a memcpy and a free per flush on a server). Only what the
     * socket did not take waits in a uv_write. Elsewhere (calls started or
     * finished outside a read) the uv_write stays: the flushes that follow
     * it in the same loop turn then leave together once it completes,
     * where each would otherwise be a write of its own. */
    uv_buf_t b = uv_buf_init((char *)c->wbuf->data, (unsigned)c->wlen);
    int w = c->direct ? uv_try_write((uv_stream_t *)&c->tcp, &b, 1) : UV_EAGAIN;
    if (w < 0 && w != UV_EAGAIN) {
      sp_h2conn_close(c);
      return;
    }
    size_t off = w > 0 ? (size_t)w : 0;
    c->bytes_out += off;
    if (off == c->wlen) {
      c->wlen = 0;
      c->hold = true;
      goto again;
    }
    size_t left = c->wlen - off;
    if (c->shared != NULL && left <= SP_H2_COPY_MAX && c->wfly == NULL) {
      /* The bytes stay pinned until libuv calls back, on a later loop
       * iteration. A server answering a thousand connections in one
       * iteration would pin a thousand fill buffers of 2 KiB or more,
       * freed only after the heap had grown for them; a copy of just the
       * bytes leaves the shared fill buffer to the next connection
       * (bench/coordinator: 2 KiB less RSS per connection). */
      sp_h2wbuf *fly = malloc(sizeof *fly + left);
      if (fly == NULL) {
        sp_h2conn_close(c);
        return;
      }
      fly->cap = left;
      memcpy(fly->data, c->wbuf->data + off, left);
      c->wfly = fly;
      c->wfly_copy = true;
      wbuf_put(c, &c->wbuf);
      off = 0;
    } else {
      /* swap so the next flush can fill while this one is in flight */
      sp_h2wbuf *fly = c->wbuf;
      c->wbuf = c->wfly;
      c->wfly = fly;
    }
    b = uv_buf_init((char *)c->wfly->data + off, (unsigned)left);
    c->bytes_out += left;
    c->wlen = 0;
    c->wfly->req.data = c;
    if (uv_write(&c->wfly->req, (uv_stream_t *)&c->tcp, &b, 1, on_written) !=
        0) {
      sp_h2conn_close(c);
      return;
    }
    c->writing = true;
    return;
  }
  /* everything went out: an idle connection keeps no write buffer */
  wbuf_put(c, &c->wbuf);
  wbuf_put(c, &c->wfly);
  if (!nghttp2_session_want_read(c->h2) && !nghttp2_session_want_write(c->h2))
    linger(c);
}
