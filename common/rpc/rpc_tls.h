/* TLS under the gRPC engine (OpenSSL 3), internal to common/rpc: contexts
 * built from the public option structs, and one connection's TLS state
 * over a pair of memory BIOs. The TLS layer never touches a socket:
 * h2conn.c feeds it the ciphertext it read and writes out the
 * ciphertext it produces, so libuv keeps the I/O and nghttp2 sees only
 * plaintext. All functions run on the loop thread of their connection.
 *
 * Policy, the same on both sides: TLS 1.2 or later (1.3 preferred), no
 * renegotiation, no compression, TLS 1.2 only with ECDHE and AEAD ciphers
 * (RFC 7540 §9.2), ALPN "h2" only. */
#ifndef SP_RPC_TLS_H
#define SP_RPC_TLS_H

#include <openssl/ssl.h>
#include <stdbool.h>
#include <stddef.h>

#include "rpc.h"

/* Fails with the OpenSSL error queue (which it clears) turned into one
 * line in d: "<what>: <OpenSSL's reasons> (rpc_tls.c:LINE)". Returns 0
 * when ok is true, otherwise err. */
#define SP_TLS_CHECK(ok, d, err, ...) \
  sp_tls_check_((ok), (d), (err), __FILE__, __LINE__, __VA_ARGS__)
int sp_tls_check_(int ok, sp_diag *d, int err, const char *file, int line,
                  const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* A server context: certificate chain, key (checked against each other)
 * and, with client_ca_file, mandatory client certificates. Errors name the
 * file. The caller frees it with SSL_CTX_free. */
int sp_tls_server_ctx_new(const sp_rpc_tls_server_opts *o, SSL_CTX **out,
                          sp_diag *d);
/* A client context: peer verification against ca_file (or the system's
 * trust store) and, with cert_file, a client certificate. */
int sp_tls_client_ctx_new(const sp_rpc_tls_client_opts *o, SSL_CTX **out,
                          sp_diag *d);

struct sp_h2conn;

/* Why a connection's TLS failed: its message is kept for the owner (the
 * client turns it into the calls' status). */
#define SP_TLS_ERR_MAX 200

/* One connection's TLS state. Allocated only for TLS connections; the
 * cleartext connection holds a NULL pointer instead. */
typedef struct sp_tls_conn {
  SSL *ssl;
  BIO *in;     /* ciphertext read from the socket, for OpenSSL to consume */
  BIO *out;    /* ciphertext OpenSSL produced, for the socket */
  bool ready;  /* handshake done and ALPN h2 checked */
  bool failed; /* fatal: what is left to send is an alert */
  bool final;  /* the failure would repeat (verification, protocol) */
  bool shutdown_sent; /* close_notify queued */
  /* Client: called once the connection is ready for HTTP/2. */
  void (*on_ready)(struct sp_h2conn *c);
  char err[SP_TLS_ERR_MAX]; /* "" until something failed */
} sp_tls_conn;

/* A connection's TLS state on ctx. Client side: name is what the server
 * certificate must carry (DNS name: checked and sent as SNI; IP address:
 * checked, no SNI), and the ClientHello is queued at once. SP_ENOMEM,
 * SP_EINVAL (no name for a client). */
int sp_tls_conn_new(SSL_CTX *ctx, bool server, const char *name,
                    sp_tls_conn **out);
void sp_tls_conn_free(sp_tls_conn *t);

/* Ciphertext from the socket. Then, until ready, sp_tls_conn_handshake:
 * 1 ready, 0 in progress, negative on failure (t->err says why). */
int sp_tls_conn_feed(sp_tls_conn *t, const void *data, size_t len);
int sp_tls_conn_handshake(sp_tls_conn *t);
/* Plaintext received, at most cap bytes: > 0 bytes, 0 when it needs more
 * input, SP_ENOENT on the peer's close_notify, SP_EIO on failure. */
long sp_tls_conn_read(sp_tls_conn *t, void *buf, size_t cap);
/* Encrypts all len bytes into the output. */
int sp_tls_conn_write(sp_tls_conn *t, const void *data, size_t len);
/* Queues close_notify (the orderly end). */
void sp_tls_conn_shutdown(sp_tls_conn *t);
/* Ciphertext waiting to go out, and moving it into buf (at most cap). */
size_t sp_tls_conn_pending(const sp_tls_conn *t);
size_t sp_tls_conn_take(sp_tls_conn *t, void *buf, size_t cap);

#endif
