/* Hand-built HTTP/2 frames and a parser for what a server answers, for
 * tests that must send what a well-behaved client library never would
 * (truncated frames, huge length prefixes, rapid resets) and for checking
 * the output of the in-memory fuzz harness.
 *
 * Header blocks use only HPACK literals without indexing, so a block never
 * depends on the dynamic table and frames can be sent in any order. Every
 * block sp_h2_headers sends starts with a dynamic table size update to 0
 * (RFC 7541 §6.3): an encoder MUST signal one in the first block after it
 * acknowledges a smaller SETTINGS_HEADER_TABLE_SIZE (§4.2), and 0 is within
 * any limit the server sets, so no block depends on when the ACK went. */
#ifndef SP_H2_RAW_H
#define SP_H2_RAW_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <nghttp2/nghttp2.h>

/* A growable byte buffer; allocation failure aborts (tests only). */
typedef struct sp_h2buf {
  uint8_t *p;
  size_t len, cap;
} sp_h2buf;

void sp_h2buf_put(sp_h2buf *b, const void *d, size_t n);
void sp_h2buf_free(sp_h2buf *b);

/* A blocking TCP connection to 127.0.0.1:port with TCP_NODELAY, or -1
 * (errno says why). */
int sp_h2_connect(int port);
/* Sends all n bytes (retrying on EINTR); false once the peer is gone. */
bool sp_h2_send_all(int fd, const void *data, size_t n);

/* The 24-byte client connection preface. */
void sp_h2_preface(sp_h2buf *b);
/* One frame: 9-byte header plus payload. */
void sp_h2_frame(sp_h2buf *b, uint8_t type, uint8_t flags, uint32_t sid,
                 const void *payload, size_t len);
/* SETTINGS with n (id, value) pairs; n may be 0. */
void sp_h2_settings(sp_h2buf *b, const uint16_t *ids, const uint32_t *vals,
                    size_t n);
void sp_h2_settings_ack(sp_h2buf *b);
void sp_h2_window_update(sp_h2buf *b, uint32_t sid, uint32_t inc);
void sp_h2_rst_stream(sp_h2buf *b, uint32_t sid, uint32_t code);
void sp_h2_ping(sp_h2buf *b, const uint8_t opaque[8]);

/* Appends one header field to a header block. */
void sp_h2_hpack_lit(sp_h2buf *blk, const char *name, const void *value,
                     size_t vlen);
/* The header block of a gRPC request: POST, http, path, authority, te,
 * content-type application/grpc. */
void sp_h2_grpc_request_block(sp_h2buf *blk, const char *path);
/* HEADERS (END_HEADERS, optionally END_STREAM) carrying a dynamic table
 * size update to 0 and then blk, split into CONTINUATION frames of at most
 * max_frame bytes (0: 16384). */
void sp_h2_headers(sp_h2buf *b, uint32_t sid, const sp_h2buf *blk,
                   bool end_stream, size_t max_frame);
/* One DATA frame (len <= the peer's max frame size). */
void sp_h2_data(sp_h2buf *b, uint32_t sid, const void *d, size_t len,
                bool end_stream);
/* A DATA frame carrying one gRPC message (5-byte prefix + msg). */
void sp_h2_grpc_message(sp_h2buf *b, uint32_t sid, const void *msg, size_t len,
                        bool end_stream);

/* What the server said on one stream. */
typedef struct sp_h2_stream {
  uint32_t sid;
  int http_status; /* :status, 0 if none yet */
  int grpc_status; /* -1 if none yet */
  char grpc_message[256];
  size_t data_bytes;
  bool ended; /* END_STREAM received */
  bool reset; /* RST_STREAM received */
  uint32_t rst_code;
} sp_h2_stream;

/* Parses a server's byte stream frame by frame. */
typedef struct sp_h2_reader {
  nghttp2_hd_inflater *inf;
  sp_h2buf in;    /* bytes not yet parsed */
  sp_h2buf block; /* header block being assembled */
  uint32_t block_sid;
  bool block_es;
  bool in_block;
  sp_h2_stream *st;
  size_t n_st, cap_st;
  size_t settings;            /* non-ACK SETTINGS frames seen */
  uint32_t header_table_size; /* the server's SETTINGS_HEADER_TABLE_SIZE */
  size_t settings_acked;      /* how many of them the caller has ACKed */
  size_t pings_acked;         /* PING frames with ACK seen */
  size_t frames;
  bool goaway;
  uint32_t goaway_code, goaway_last;
  bool error; /* the server sent something unparsable */
} sp_h2_reader;

void sp_h2_reader_init(sp_h2_reader *r);
void sp_h2_reader_free(sp_h2_reader *r);
/* Feeds bytes and parses every complete frame; sets r->error (and stops
 * parsing) on a malformed frame or header block. */
void sp_h2_reader_feed(sp_h2_reader *r, const uint8_t *d, size_t n);
/* The stream's record, or NULL if the server said nothing on it. */
const sp_h2_stream *sp_h2_reader_stream(const sp_h2_reader *r, uint32_t sid);
/* Whether the stream is over: END_STREAM or RST_STREAM. */
bool sp_h2_stream_done(const sp_h2_stream *s);

#endif
