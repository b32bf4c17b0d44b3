/* Tokens and token files (token.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include "auth/token.h"
#include "rpc/rpc_tls.h"

static const char *const k_roles[] = {NULL, "worker", "reader", "admin"};

const char *sp_auth_role_name(int role) {
  return role >= SP_ROLE_WORKER && role <= SP_ROLE_ADMIN ? k_roles[role] : "?";
}

int sp_auth_role_parse(const char *s) {
  for (int r = SP_ROLE_WORKER; r <= SP_ROLE_ADMIN; r++)
    if (s != NULL && strcmp(s, k_roles[r]) == 0) return r;
  return 0;
}

/* ---- tokens ---- */

static void b64url(const uint8_t *in, size_t n, char *out) {
  static const char a[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  size_t o = 0;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < n; i++) {
    acc = (acc << 8) | in[i];
    bits += 8;
    while (bits >= 6) {
      bits -= 6;
      out[o++] = a[(acc >> bits) & 63];
    }
  }
  if (bits > 0) out[o++] = a[(acc << (6 - bits)) & 63];
  out[o] = '\0';
}

int sp_auth_token_new(char out[SP_AUTH_TOKEN_LEN + 1], sp_diag *d) {
  uint8_t r[32];
  /* every OpenSSL call goes through the engine's check, which names the
   * call site and OpenSSL's reasons */
  int rc = SP_TLS_CHECK(RAND_bytes(r, sizeof r) == 1, d, SP_EIO,
                        "no random bytes for a token");
  if (rc != 0) return rc;
  memcpy(out, SP_AUTH_TOKEN_PREFIX, 4);
  b64url(r, sizeof r, out + 4);
  OPENSSL_cleanse(r, sizeof r);
  return 0;
}

int sp_auth_token_hash(const char *token, size_t len, uint8_t h[32],
                       sp_diag *d) {
  return SP_TLS_CHECK(SHA256((const unsigned char *)token, len, h) != NULL, d,
                      SP_EIO, "cannot hash a token");
}

bool sp_auth_name_valid(const char *s) {
  size_t n = s ? strlen(s) : 0;
  if (n == 0 || n > SP_AUTH_NAME_MAX) return false;
  for (size_t i = 0; i < n; i++) {
    char c = s[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
          (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-'))
      return false;
  }
  return true;
}

/* An open file that only its owner may read or write. */
static int check_private(int fd, const char *path, sp_diag *d) {
  struct stat st;
  if (fstat(fd, &st) != 0)
    return sp_diag_set(d, SP_EIO, "%s: %s", path, strerror(errno));
  if (!S_ISREG(st.st_mode))
    return sp_diag_set(d, SP_ESTATE, "%s: not a regular file", path);
  if (st.st_mode & 077)
    return sp_diag_set(d, SP_ESTATE,
                       "%s: mode %03o lets others read or change tokens; "
                       "chmod 600 it",
                       path, (unsigned)(st.st_mode & 0777));
  return 0;
}

static int write_all(int fd, const char *s, size_t n, const char *path,
                     sp_diag *d) {
  while (n > 0) {
    ssize_t w = write(fd, s, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return sp_diag_set(d, SP_EIO, "%s: %s", path, strerror(errno));
    s += w;
    n -= (size_t)w;
  }
  return 0;
}

int sp_auth_file_add(const char *path, const char *token, int role,
                     const char *name, sp_diag *d) {
  if (path == NULL || token == NULL)
    return sp_diag_set(d, SP_EINVAL, "token file: no path or token");
  if (role < SP_ROLE_WORKER || role > SP_ROLE_ADMIN)
    return sp_diag_set(d, SP_EINVAL, "unknown role %d", role);
  if (!sp_auth_name_valid(name))
    return sp_diag_set(d, SP_EINVAL,
                       "token name \"%s\": expected 1-%d of A-Z a-z 0-9 . _ -",
                       name ? name : "", SP_AUTH_NAME_MAX);
  uint8_t h[32];
  int rc = sp_auth_token_hash(token, strlen(token), h, d);
  if (rc != 0) return rc;
  char line[16 + 64 + 16 + SP_AUTH_NAME_MAX];
  int n = snprintf(line, sizeof line, "sha256:");
  for (int i = 0; i < 32; i++)
    n += snprintf(line + n, sizeof line - (size_t)n, "%02x", h[i]);
  n += snprintf(line + n, sizeof line - (size_t)n, " %s %s\n",
                sp_auth_role_name(role), name);
  int fd =
      open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0)
    return sp_diag_set(d, SP_EIO, "token file %s: %s", path, strerror(errno));
  rc = check_private(fd, path, d);
  if (rc == 0) rc = write_all(fd, line, (size_t)n, path, d);
  if (rc == 0 && fsync(fd) != 0)
    rc = sp_diag_set(d, SP_EIO, "%s: %s", path, strerror(errno));
  close(fd);
  return rc;
}

int sp_auth_token_write(const char *path, const char *token, sp_diag *d) {
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    return sp_diag_set(d, errno == EEXIST ? SP_EEXIST : SP_EIO, "%s: %s", path,
                       strerror(errno));
  int rc = write_all(fd, token, strlen(token), path, d);
  if (rc == 0) rc = write_all(fd, "\n", 1, path, d);
  close(fd);
  return rc;
}
