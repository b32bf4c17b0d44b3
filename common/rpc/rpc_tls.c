/* OpenSSL contexts and one connection's TLS over memory BIOs (see
 * rpc_tls.h). */
#include "rpc_tls.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <openssl/err.h>
#include <openssl/x509v3.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The reasons on OpenSSL's error queue, earliest (the root cause) first,
 * joined by ": "; clears the queue. */
static void queue_reasons(char *out, size_t cap) {
  size_t len = 0;
  out[0] = '\0';
  unsigned long e;
  const char *data = NULL;
  int flags = 0;
  while ((e = ERR_get_error_all(NULL, NULL, NULL, &data, &flags)) != 0) {
    const char *r = ERR_reason_error_string(e);
    char one[160];
    if (r == NULL) r = "unknown error";
    if ((flags & ERR_TXT_STRING) && data != NULL && data[0] != '\0')
      snprintf(one, sizeof one, "%s (%s)", r, data);
    else
      snprintf(one, sizeof one, "%s", r);
    /* the same reason raised at several levels reads once */
    if (strstr(out, one) != NULL) continue;
    int n = snprintf(out + len, cap - len, "%s%s", len ? ": " : "", one);
    if (n < 0 || (size_t)n >= cap - len) break;
    len += (size_t)n;
  }
  if (out[0] == '\0') snprintf(out, cap, "unknown OpenSSL error");
  ERR_clear_error();
}

int sp_tls_check_(int ok, sp_diag *d, int err, const char *file, int line,
                  const char *fmt, ...) {
  if (ok) return 0;
  char what[256], why[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  queue_reasons(why, sizeof why);
  const char *base = strrchr(file, '/');
  return sp_diag_set(d, err, "%s: %s (%s:%d)", what, why,
                     base ? base + 1 : file, line);
}

/* ---------------- contexts ---------------- */

static const unsigned char k_alpn_h2[] = {2, 'h', '2'};

/* The server's ALPN choice: h2 or a fatal no_application_protocol alert. */
static int alpn_select(SSL *s, const unsigned char **out, unsigned char *outlen,
                       const unsigned char *in, unsigned int inlen, void *arg) {
  (void)s;
  (void)arg;
  unsigned char *sel = NULL;
  if (SSL_select_next_proto(&sel, outlen, k_alpn_h2, sizeof k_alpn_h2, in,
                            inlen) != OPENSSL_NPN_NEGOTIATED)
    return SSL_TLSEXT_ERR_ALERT_FATAL;
  *out = sel;
  return SSL_TLSEXT_ERR_OK;
}

/* OpenSSL calls the ALPN callback only when the client offers ALPN at
 * all; a client that offers none would otherwise complete the handshake
 * and then speak who knows what. */
static int client_hello(SSL *s, int *al, void *arg) {
  (void)arg;
  const unsigned char *p;
  size_t n;
  if (!SSL_client_hello_get0_ext(
          s, TLSEXT_TYPE_application_layer_protocol_negotiation, &p, &n)) {
    *al = SSL_AD_NO_APPLICATION_PROTOCOL;
    return SSL_CLIENT_HELLO_ERROR;
  }
  return SSL_CLIENT_HELLO_SUCCESS;
}

/* What both sides share: versions, options, TLS 1.2 ciphers. */
static int ctx_policy(SSL_CTX *ctx, sp_diag *d) {
  int rc = SP_TLS_CHECK(SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION), d,
                        SP_EIO, "TLS: cannot require TLS 1.2");
  if (rc != 0) return rc;
  SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_COMPRESSION);
  /* RFC 7540 §9.2.2: TLS 1.2 only with ephemeral key exchange and AEAD
   * (TLS 1.3's suites all are) */
  rc = SP_TLS_CHECK(SSL_CTX_set_cipher_list(ctx, "ECDHE+AESGCM:ECDHE+CHACHA20"),
                    d, SP_EIO, "TLS: cannot set the TLS 1.2 ciphers");
  if (rc != 0) return rc;
  /* An idle connection gives its 16 KiB record buffers back: the
   * coordinator holds thousands of mostly idle connections. */
  SSL_CTX_set_mode(ctx, SSL_MODE_RELEASE_BUFFERS);
  return 0;
}

/* OpenSSL's own words for a file it cannot open are "system lib"; this
 * says which file and why, before OpenSSL is asked to read it. */
static int readable(const char *path, const char *what, sp_diag *d) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return sp_diag_set(d, SP_EIO, "TLS: cannot read the %s %s: %s", what, path,
                       strerror(errno));
  fclose(f);
  return 0;
}

/* A certificate chain and its key, checked against each other. */
static int ctx_identity(SSL_CTX *ctx, const char *cert, const char *key,
                        sp_diag *d) {
  int rc = readable(cert, "certificate chain", d);
  if (rc == 0) rc = readable(key, "private key", d);
  if (rc == 0)
    rc =
        SP_TLS_CHECK(SSL_CTX_use_certificate_chain_file(ctx, cert) == 1, d,
                     SP_EIO, "TLS: cannot load the certificate chain %s", cert);
  if (rc == 0)
    rc = SP_TLS_CHECK(
        SSL_CTX_use_PrivateKey_file(ctx, key, SSL_FILETYPE_PEM) == 1, d, SP_EIO,
        "TLS: cannot use the private key %s with the certificate %s", key,
        cert);
  if (rc == 0)
    rc = SP_TLS_CHECK(SSL_CTX_check_private_key(ctx) == 1, d, SP_EIO,
                      "TLS: the private key %s does not match the "
                      "certificate %s",
                      key, cert);
  return rc;
}

int sp_tls_server_ctx_new(const sp_rpc_tls_server_opts *o, SSL_CTX **out,
                          sp_diag *d) {
  if (o == NULL || out == NULL) return SP_EINVAL;
  if (o->cert_file == NULL || o->key_file == NULL)
    return sp_diag_set(d, SP_EINVAL,
                       "TLS: a server needs a certificate and a key file");
  SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
  int rc = SP_TLS_CHECK(ctx != NULL, d, SP_ENOMEM, "TLS: no server context");
  if (rc == 0) rc = ctx_policy(ctx, d);
  if (rc == 0) rc = ctx_identity(ctx, o->cert_file, o->key_file, d);
  if (rc == 0 && o->client_ca_file != NULL) {
    rc = readable(o->client_ca_file, "client CA bundle", d);
    if (rc == 0)
      rc = SP_TLS_CHECK(
          SSL_CTX_load_verify_locations(ctx, o->client_ca_file, NULL) == 1, d,
          SP_EIO, "TLS: cannot load the client CA bundle %s",
          o->client_ca_file);
    if (rc == 0) {
      /* tells clients which CAs to pick a certificate for */
      STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(o->client_ca_file);
      rc = SP_TLS_CHECK(names != NULL, d, SP_EIO,
                        "TLS: no CA certificate in the client CA bundle %s",
                        o->client_ca_file);
      if (rc == 0) SSL_CTX_set_client_CA_list(ctx, names);
    }
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT,
                       NULL);
  }
  if (rc != 0) {
    SSL_CTX_free(ctx);
    return rc;
  }
  SSL_CTX_set_alpn_select_cb(ctx, alpn_select, NULL);
  SSL_CTX_set_client_hello_cb(ctx, client_hello, NULL);
  /* Our client never resumes sessions: tickets would cost every
   * handshake two more messages and their encryption for nothing. */
  SSL_CTX_set_num_tickets(ctx, 0);
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
  *out = ctx;
  return 0;
}

int sp_tls_client_ctx_new(const sp_rpc_tls_client_opts *o, SSL_CTX **out,
                          sp_diag *d) {
  if (o == NULL || out == NULL) return SP_EINVAL;
  if ((o->cert_file == NULL) != (o->key_file == NULL))
    return sp_diag_set(d, SP_EINVAL,
                       "TLS: a client certificate needs its key file and a "
                       "key file its certificate");
  SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
  int rc = SP_TLS_CHECK(ctx != NULL, d, SP_ENOMEM, "TLS: no client context");
  if (rc == 0) rc = ctx_policy(ctx, d);
  if (rc == 0 && o->ca_file != NULL) rc = readable(o->ca_file, "CA bundle", d);
  if (rc == 0 && o->ca_file != NULL)
    rc = SP_TLS_CHECK(SSL_CTX_load_verify_locations(ctx, o->ca_file, NULL) == 1,
                      d, SP_EIO, "TLS: cannot load the CA bundle %s",
                      o->ca_file);
  else if (rc == 0)
    rc = SP_TLS_CHECK(SSL_CTX_set_default_verify_paths(ctx) == 1, d, SP_EIO,
                      "TLS: cannot load the system's trusted CAs");
  if (rc == 0 && o->cert_file != NULL)
    rc = ctx_identity(ctx, o->cert_file, o->key_file, d);
  /* inverted: 0 is success */
  if (rc == 0)
    rc = SP_TLS_CHECK(
        SSL_CTX_set_alpn_protos(ctx, k_alpn_h2, sizeof k_alpn_h2) == 0, d,
        SP_ENOMEM, "TLS: cannot set ALPN");
  if (rc != 0) {
    SSL_CTX_free(ctx);
    return rc;
  }
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
  *out = ctx;
  return 0;
}

/* ---------------- connections ---------------- */

static bool is_ip(const char *name) {
  unsigned char buf[sizeof(struct in6_addr)];
  return inet_pton(AF_INET, name, buf) == 1 ||
         inet_pton(AF_INET6, name, buf) == 1;
}

int sp_tls_conn_new(SSL_CTX *ctx, bool server, const char *name,
                    sp_tls_conn **out) {
  if (ctx == NULL || out == NULL || (!server && name == NULL)) return SP_EINVAL;
  sp_tls_conn *t = calloc(1, sizeof *t);
  if (t == NULL) return SP_ENOMEM;
  ERR_clear_error();
  t->ssl = SSL_new(ctx);
  t->in = BIO_new(BIO_s_mem());
  t->out = BIO_new(BIO_s_mem());
  if (t->ssl == NULL || t->in == NULL || t->out == NULL) {
    BIO_free(t->in);
    BIO_free(t->out);
    SSL_free(t->ssl);
    free(t);
    ERR_clear_error();
    return SP_ENOMEM;
  }
  /* an empty input BIO means "wait for more", not end of stream */
  BIO_set_mem_eof_return(t->in, -1);
  BIO_set_mem_eof_return(t->out, -1);
  SSL_set_bio(t->ssl, t->in, t->out); /* the SSL owns both now */
  int ok = 1;
  if (server) {
    SSL_set_accept_state(t->ssl);
  } else {
    SSL_set_connect_state(t->ssl);
    SSL_set_hostflags(t->ssl, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    if (is_ip(name)) /* RFC 6066 §3: no SNI for an address */
      ok = X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(t->ssl), name);
    else
      ok =
          SSL_set1_host(t->ssl, name) && SSL_set_tlsext_host_name(t->ssl, name);
  }
  if (!ok) {
    sp_tls_conn_free(t);
    ERR_clear_error();
    return SP_EINVAL;
  }
  /* a client's first step only queues its ClientHello */
  if (!server && sp_tls_conn_handshake(t) < 0) {
    sp_tls_conn_free(t);
    return SP_EIO;
  }
  *out = t;
  return 0;
}

void sp_tls_conn_free(sp_tls_conn *t) {
  if (t == NULL) return;
  SSL_free(t->ssl);
  free(t);
}

/* Marks the connection failed, with the reasons on the error queue and,
 * for a certificate the verification refused, why it did. */
static void conn_fail(sp_tls_conn *t, int ssl_err) {
  t->failed = true;
  t->final = ssl_err == SSL_ERROR_SSL;
  char why[SP_TLS_ERR_MAX];
  if (ssl_err == SSL_ERROR_SSL)
    queue_reasons(why, sizeof why);
  else
    snprintf(why, sizeof why, "TLS error %d", ssl_err);
  ERR_clear_error();
  /* what a TLS client reads from a cleartext HTTP/2 server's SETTINGS */
  if (!t->ready && strstr(why, "wrong version number") != NULL) {
    size_t n = strlen(why);
    snprintf(why + n, sizeof why - n, " (does the peer speak TLS?)");
  }
  long v = SSL_get_verify_result(t->ssl);
  if (v != X509_V_OK)
    snprintf(t->err, sizeof t->err, "%.100s (%s)", why,
             X509_verify_cert_error_string(v));
  else
    snprintf(t->err, sizeof t->err, "%s", why);
}

int sp_tls_conn_feed(sp_tls_conn *t, const void *data, size_t len) {
  if (len > INT_MAX) return SP_ETOOBIG;
  if (len == 0) return 0;
  if (BIO_write(t->in, data, (int)len) != (int)len) {
    ERR_clear_error();
    t->failed = true;
    snprintf(t->err, sizeof t->err, "out of memory");
    return SP_ENOMEM;
  }
  return 0;
}

int sp_tls_conn_handshake(sp_tls_conn *t) {
  if (t->ready) return 1;
  if (t->failed) return SP_EIO;
  ERR_clear_error();
  int r = SSL_do_handshake(t->ssl);
  if (r == 1) {
    const unsigned char *p = NULL;
    unsigned int n = 0;
    SSL_get0_alpn_selected(t->ssl, &p, &n);
    if (n != 2 || memcmp(p, "h2", 2) != 0) {
      t->failed = t->final = true;
      snprintf(t->err, sizeof t->err,
               "the peer did not agree on ALPN \"h2\" (HTTP/2)");
      return SP_EIO;
    }
    t->ready = true;
    return 1;
  }
  int e = SSL_get_error(t->ssl, r);
  if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) return 0;
  conn_fail(t, e);
  return SP_EIO;
}

long sp_tls_conn_read(sp_tls_conn *t, void *buf, size_t cap) {
  if (t->failed) return SP_EIO;
  size_t got = 0;
  ERR_clear_error();
  if (SSL_read_ex(t->ssl, buf, cap, &got) == 1) return (long)got;
  int e = SSL_get_error(t->ssl, 0);
  if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) return 0;
  if (e == SSL_ERROR_ZERO_RETURN) return SP_ENOENT;
  conn_fail(t, e);
  return SP_EIO;
}

int sp_tls_conn_write(sp_tls_conn *t, const void *data, size_t len) {
  if (t->failed) return SP_EIO;
  size_t done = 0;
  ERR_clear_error();
  /* memory BIOs take everything: one call writes it all */
  if (SSL_write_ex(t->ssl, data, len, &done) == 1 && done == len) return 0;
  conn_fail(t, SSL_get_error(t->ssl, 0));
  return SP_EIO;
}

void sp_tls_conn_shutdown(sp_tls_conn *t) {
  if (t->shutdown_sent || !t->ready || t->failed) return;
  t->shutdown_sent = true;
  ERR_clear_error();
  SSL_shutdown(t->ssl); /* 0: sent, the peer's is not awaited */
  ERR_clear_error();
}

size_t sp_tls_conn_pending(const sp_tls_conn *t) {
  return BIO_ctrl_pending(t->out);
}

size_t sp_tls_conn_take(sp_tls_conn *t, void *buf, size_t cap) {
  if (cap > INT_MAX) cap = INT_MAX;
  int n = BIO_read(t->out, buf, (int)cap);
  return n > 0 ? (size_t)n : 0;
}
