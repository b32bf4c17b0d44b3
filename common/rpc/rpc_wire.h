/* gRPC wire helpers with no I/O: status names, grpc-message percent
 * encoding, grpc-timeout, base64 for -bin metadata, metadata lists, and the
 * incremental message deframer. Private to common/rpc; unit-tested and
 * fuzzed directly. */
#ifndef SP_RPC_WIRE_H
#define SP_RPC_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rpc.h"
#include "rpc_mem.h"

/* Percent-encodes a grpc-message (bytes 0x20-0x7E except '%' stay). Writes
 * at most cap-1 bytes plus NUL, truncating only between escapes. Returns the
 * length written. */
size_t sp_rpc_pct_encode(const char *in, char *out, size_t cap);
/* Decodes in[0..len) into out (NUL-terminated, truncated to cap-1). Bad
 * escapes are kept literally, as the spec asks decoders to tolerate them. */
void sp_rpc_pct_decode(const char *in, size_t len, char *out, size_t cap);

/* Parses a grpc-timeout value ("2500m", at most 8 digits and one unit of
 * HMSmun) into milliseconds, rounding up. -1 when malformed. */
int64_t sp_rpc_timeout_parse(const char *v, size_t len);
/* Formats ms as a grpc-timeout value; out needs 16 bytes. */
void sp_rpc_timeout_format(uint64_t ms, char *out);

/* Unpadded base64 (standard alphabet). Returns the length written; out
 * needs 4*ceil(len/3)+1 bytes. */
size_t sp_rpc_b64_encode(const uint8_t *in, size_t len, char *out);
/* Decodes padded or unpadded base64; comma-joined values are decoded in
 * turn and concatenated. Returns the decoded length or -1 if malformed; out
 * needs len bytes. */
long sp_rpc_b64_decode(const char *in, size_t len, uint8_t *out);

/* Metadata keys: non-empty, [0-9a-z_.-]. */
bool sp_rpc_md_key_valid(const char *key, size_t len);
bool sp_rpc_md_key_is_bin(const char *key, size_t len);
/* ASCII values: 0x20-0x7E. */
bool sp_rpc_md_value_valid(const uint8_t *v, size_t len);

/* An owned list of metadata entries with a byte budget (name + value + 32
 * per entry, as HTTP/2 counts header list size). */
typedef struct sp_rpc_mdlist {
  struct sp_rpc_mdent {
    char *key;      /* one allocation holds the key and the value */
    uint8_t *value; /* NUL-terminated, inside key's allocation */
    size_t len;
  } * e;
  size_t n, cap, bytes;
  sp_rpc_mem *mem; /* where entries come from; NULL: malloc */
} sp_rpc_mdlist;
/* SP_ETOOBIG when the budget would be exceeded, SP_ENOMEM. Clearing keeps
 * l->mem. */
int sp_rpc_mdlist_add(sp_rpc_mdlist *l, const char *key, size_t klen,
                      const uint8_t *v, size_t vlen, size_t budget);
const uint8_t *sp_rpc_mdlist_get(const sp_rpc_mdlist *l, const char *key,
                                 size_t *len);
void sp_rpc_mdlist_clear(sp_rpc_mdlist *l);

/* Length-prefixed message reassembly across DATA frames. */
typedef struct sp_rpc_deframer {
  uint8_t hdr[5];
  bool in_body; /* next to hdr: one per open stream on a server */
  size_t hdr_have;
  uint8_t *buf;
  size_t need, have, cap;
  size_t max;
  /* Optional: a budget shared with other deframers (a server's, across
   * all its connections). Partial-message buffers are charged to *used
   * before they are allocated and released when freed; charged is what
   * this one holds. */
  size_t *used;
  size_t used_max;
  size_t charged;
} sp_rpc_deframer;

typedef int (*sp_rpc_msg_fn)(void *ud, const uint8_t *msg, size_t len);

void sp_rpc_deframer_init(sp_rpc_deframer *d, size_t max);
void sp_rpc_deframer_free(sp_rpc_deframer *d);
/* Feeds bytes; calls fn for each complete message (pointer valid during the
 * call). Returns 0, SP_ETOOBIG (a prefix announced more than max, checked
 * before allocating), SP_EUNSUPPORTED (compressed flag: no codec is
 * negotiated), SP_EFORMAT (flag byte not 0/1), SP_ENOMEM, SP_EAGAIN (the
 * shared budget, when set, cannot hold the buffer), or the first
 * non-zero value fn returned. *len_out, when given, receives the announced
 * size on SP_ETOOBIG. */
int sp_rpc_deframer_feed(sp_rpc_deframer *d, const uint8_t *data, size_t len,
                         sp_rpc_msg_fn fn, void *ud, uint64_t *len_out);
/* Inside the message callback only: hands over the buffer the message was
 * reassembled in, so a large message is not copied again; the caller frees
 * it with sp_rpc_deframer_buf_free(buf, *cap). NULL when the message lay in
 * the input as fed (it is then at most one feed's bytes). With a shared
 * budget the buffer stays charged: *charged gets the amount, which the
 * caller releases when it frees the buffer. */
uint8_t *sp_rpc_deframer_take(sp_rpc_deframer *d, size_t *charged, size_t *cap);
/* Frees a buffer sp_rpc_deframer_take handed over (large ones are
 * mappings); cap 0 frees a malloc'd one. */
void sp_rpc_deframer_buf_free(uint8_t *buf, size_t cap);
/* Whether a message is partly received (EOS now would truncate it). */
bool sp_rpc_deframer_partial(const sp_rpc_deframer *d);

/* Framed messages waiting for a data provider, shared by the server's
 * responses and the client's requests. `bytes` counts whole messages
 * (prefix included) until their last byte is taken. */
typedef struct sp_rpc_outq {
  struct sp_rpc_outmsg *head, *tail;
  size_t bytes;
  sp_rpc_mem *mem; /* where messages come from; NULL: malloc */
} sp_rpc_outq;

/* Frames one message: packed from msg when given, else copied from data.
 * SP_ENOMEM. */
int sp_rpc_outq_push(sp_rpc_outq *q, const ProtobufCMessage *msg,
                     const uint8_t *data, size_t len);
/* Copies up to cap bytes into buf, freeing each message once it is all
 * taken; returns the bytes copied. */
size_t sp_rpc_outq_pull(sp_rpc_outq *q, uint8_t *buf, size_t cap);
bool sp_rpc_outq_empty(const sp_rpc_outq *q);
void sp_rpc_outq_clear(sp_rpc_outq *q);

/* Writes the 5-byte prefix for an uncompressed message. */
void sp_rpc_frame_prefix(uint8_t out[5], uint32_t len);

/* Maps an HTTP/2 RST_STREAM error code to a gRPC status. */
int sp_rpc_code_from_rst(uint32_t h2_error);
/* Maps a non-200 HTTP status to a gRPC status. */
int sp_rpc_code_from_http(int http_status);

#endif
