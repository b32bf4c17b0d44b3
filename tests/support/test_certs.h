/* Certificates for the TLS tests, made at test time by the openssl command
 * (tests/support/make_test_certs.sh, which the interop scripts run too):
 * a CA, a server certificate it signed for IP:127.0.0.1 and DNS:localhost,
 * a client certificate it signed, and an unrelated CA with a certificate
 * of its own (same names, server and client use). */
#ifndef SP_TEST_CERTS_H
#define SP_TEST_CERTS_H

typedef struct sp_test_certs {
  /* Paths of PEM files in the directory given; owned by the struct. */
  char *ca, *ca_key;
  char *server_cert, *server_key;
  char *client_cert, *client_key;
  char *other_ca;               /* the unrelated CA */
  char *other_cert, *other_key; /* signed by other_ca */
} sp_test_certs;

/* Makes the certificates in dir (which must exist). Returns 0;
 * SP_EUNSUPPORTED when there is no openssl command (the caller skips the
 * test, saying so); SP_EIO when the command failed. */
int sp_test_certs_make(const char *dir, sp_test_certs *out);
void sp_test_certs_free(sp_test_certs *c);

#endif
