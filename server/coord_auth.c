/* The coordinator's check of bearer tokens (coord_auth.h). */
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

#include "coord_auth.h"
#include "rpc/coord_service.h"
#include "rpc/rpc_tls.h"

/* ---- the table ---- */

typedef struct auth_entry {
  sp_rpc_principal p; /* first: a principal pointer is its entry's */
  uint8_t hash[32];
  char name[SP_AUTH_NAME_MAX + 1];
  uint64_t bytes, keys; /* what its store keys hold now */
} auth_entry;

/* Which token holds each store key: open addressing, linear probing,
 * tombstones. The whole key is kept, so a crafted hash collision cannot
 * make two keys share an account. */
typedef struct owned_key {
  char *key; /* NULL: empty; TOMB: deleted */
  size_t klen;
  uint64_t hash;
  uint64_t bytes;
  auth_entry *owner;
} owned_key;

static char k_tomb;
#define TOMB (&k_tomb)

struct sp_coord_auth {
  auth_entry *e;
  size_t n;
  sp_coord_auth_quota quota;
  owned_key *slots;
  size_t cap, used; /* used counts tombstones too */
  size_t keys_live;
};

size_t sp_coord_auth_count(const sp_coord_auth *a) { return a ? a->n : 0; }

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

/* One line (NUL-terminated, no newline) into e. */
static int parse_line(char *line, auth_entry *e, const char *path, size_t ln,
                      sp_diag *d) {
  char *save = NULL;
  char *hash = strtok_r(line, " \t", &save);
  char *role = strtok_r(NULL, " \t", &save);
  char *name = strtok_r(NULL, " \t", &save);
  char *extra = strtok_r(NULL, " \t", &save);
  if (hash == NULL || role == NULL || name == NULL || extra != NULL)
    return sp_diag_set(d, SP_EFORMAT,
                       "%s:%zu: expected \"sha256:<64 hex> <role> <name>\"",
                       path, ln);
  if (strncmp(hash, "sha256:", 7) != 0 || strlen(hash + 7) != 64)
    return sp_diag_set(d, SP_EFORMAT,
                       "%s:%zu: the hash must be sha256: and 64 lower-case "
                       "hex digits (the file holds hashes, never tokens)",
                       path, ln);
  for (int i = 0; i < 32; i++) {
    int hi = hexval(hash[7 + 2 * i]), lo = hexval(hash[8 + 2 * i]);
    if (hi < 0 || lo < 0)
      return sp_diag_set(d, SP_EFORMAT,
                         "%s:%zu: the hash must be sha256: and 64 lower-case "
                         "hex digits",
                         path, ln);
    e->hash[i] = (uint8_t)(hi << 4 | lo);
  }
  e->p.role = sp_auth_role_parse(role);
  if (e->p.role == 0)
    return sp_diag_set(d, SP_EFORMAT,
                       "%s:%zu: role \"%.32s\": expected worker, reader or "
                       "admin",
                       path, ln, role);
  if (!sp_auth_name_valid(name))
    return sp_diag_set(d, SP_EFORMAT,
                       "%s:%zu: name \"%.64s\": expected 1-%d of A-Z a-z 0-9 "
                       ". _ -",
                       path, ln, name, SP_AUTH_NAME_MAX);
  snprintf(e->name, sizeof e->name, "%s", name);
  return 0;
}

static int parse_file(sp_coord_auth *a, char *buf, size_t len, const char *path,
                      sp_diag *d) {
  size_t lines = 1;
  for (size_t i = 0; i < len; i++) lines += buf[i] == '\n';
  a->e = calloc(lines, sizeof *a->e);
  if (a->e == NULL) return sp_diag_set(d, SP_ENOMEM, "out of memory");
  size_t ln = 0;
  for (char *p = buf; p < buf + len;) {
    char *nl = memchr(p, '\n', (size_t)(buf + len - p));
    char *end = nl ? nl : buf + len;
    *end = '\0';
    ln++;
    if (memchr(p, '\0', (size_t)(end - p)) != NULL)
      return sp_diag_set(d, SP_EFORMAT, "%s:%zu: NUL byte", path, ln);
    while (end > p && (end[-1] == '\r' || end[-1] == ' ' || end[-1] == '\t'))
      *--end = '\0';
    while (*p == ' ' || *p == '\t') p++;
    if (*p != '\0' && *p != '#') {
      auth_entry *e = &a->e[a->n];
      int rc = parse_line(p, e, path, ln, d);
      if (rc != 0) return rc;
      for (size_t k = 0; k < a->n; k++)
        if (memcmp(a->e[k].hash, e->hash, 32) == 0)
          return sp_diag_set(d, SP_EFORMAT,
                             "%s:%zu: the same token hash as token \"%s\"",
                             path, ln, a->e[k].name);
      e->p.name = e->name;
      a->n++;
    }
    p = nl ? nl + 1 : buf + len;
  }
  return 0;
}

int sp_coord_auth_load(const char *path, const sp_coord_auth_quota *q,
                       sp_coord_auth **out, sp_diag *d) {
  if (path == NULL || out == NULL)
    return sp_diag_set(d, SP_EINVAL, "token file: no path");
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return sp_diag_set(d, SP_EIO, "token file %s: %s", path, strerror(errno));
  struct stat st;
  int rc = 0;
  if (fstat(fd, &st) != 0)
    rc = sp_diag_set(d, SP_EIO, "token file %s: %s", path, strerror(errno));
  else if (!S_ISREG(st.st_mode))
    rc = sp_diag_set(d, SP_EFORMAT, "token file %s: not a regular file", path);
  else if (st.st_mode & 022)
    rc = sp_diag_set(d, SP_ESTATE,
                     "token file %s: mode %03o lets others add tokens; chmod "
                     "600 it",
                     path, (unsigned)(st.st_mode & 0777));
  else if (st.st_size > SP_COORD_AUTH_FILE_MAX)
    rc = sp_diag_set(d, SP_ETOOBIG,
                     "token file %s: %lld bytes, over the %u-byte limit", path,
                     (long long)st.st_size, SP_COORD_AUTH_FILE_MAX);
  if (rc != 0) {
    close(fd);
    return rc;
  }
  size_t len = (size_t)st.st_size;
  char *buf = malloc(len + 1);
  sp_coord_auth *a = calloc(1, sizeof *a);
  if (buf == NULL || a == NULL) {
    close(fd);
    free(buf);
    free(a);
    return sp_diag_set(d, SP_ENOMEM, "out of memory");
  }
  size_t got = 0;
  while (got < len) {
    ssize_t r = read(fd, buf + got, len - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(fd);
  buf[got] = '\0';
  rc = parse_file(a, buf, got, path, d);
  OPENSSL_cleanse(buf, got);
  free(buf);
  if (rc != 0) {
    sp_coord_auth_free(a);
    return rc;
  }
  a->quota.bytes = q && q->bytes ? q->bytes : SP_COORD_AUTH_QUOTA_BYTES;
  a->quota.keys = q && q->keys ? q->keys : SP_COORD_AUTH_QUOTA_KEYS;
  *out = a;
  return 0;
}

void sp_coord_auth_free(sp_coord_auth *a) {
  if (a == NULL) return;
  for (size_t i = 0; i < a->cap; i++)
    if (a->slots[i].key != NULL && a->slots[i].key != TOMB)
      free(a->slots[i].key);
  free(a->slots);
  free(a->e);
  free(a);
}

const sp_rpc_principal *sp_coord_auth_lookup(const sp_coord_auth *a,
                                             const char *token, size_t len) {
  if (a == NULL || token == NULL) return NULL;
  uint8_t h[32];
  if (sp_auth_token_hash(token, len, h, NULL) != 0) return NULL;
  const auth_entry *hit = NULL;
  for (size_t i = 0; i < a->n; i++)
    if (CRYPTO_memcmp(h, a->e[i].hash, 32) == 0) hit = &a->e[i];
  return hit ? &hit->p : NULL;
}

/* ---- which role may call what ---- */

#define W (1u << SP_ROLE_WORKER)
#define R (1u << SP_ROLE_READER)

/* Admins may call every method; this table says who else may. */
static const struct {
  const char *method;
  unsigned roles;
} k_policy[] = {
    {"GetJob", W | R},
    {"GetPlan", W | R},
    {"GetModelSpec", W | R},
    {"LocateParam", R},
    {"ListModules", R},
    {"ListBuffers", R},
    {"ListRanks", R},
    {"Watch", R},
    {"Attach", W},
    {"Detach", W},
    {"Session", W},
    {"ReportTransition", W},
    {"StoreSet", W},
    {"StoreAdd", W},
    {"StoreCompareSet", W},
    {"StoreDelete", W},
    {"StoreGet", W | R},
    {"StoreWait", W | R},
    /* hang diagnosis: an operator's questions, not a worker's */
    {"GetVerdict", R},
    {"GetTrace", R},
    {"GetDump", R},
    /* a host's agent holds a worker token */
    {"AgentSession", W},
    {"ListIncarnations", W | R},
};

static bool role_may_call(int role, const char *path) {
  if (role == SP_ROLE_ADMIN) return true;
  static const char svc[] = "/" SP_COORD_SERVICE "/";
  if (strncmp(path, svc, sizeof svc - 1) != 0) return false;
  const char *m = path + sizeof svc - 1;
  for (size_t i = 0; i < sizeof k_policy / sizeof k_policy[0]; i++)
    if (strcmp(m, k_policy[i].method) == 0)
      return (k_policy[i].roles & (1u << role)) != 0;
  return false;
}

/* The token of an "authorization: Bearer <token>" value ("bearer" in any
 * case, as RFC 6750 allows), or NULL. */
static const char *bearer(const uint8_t *v, size_t n, size_t *len) {
  if (v == NULL || n < 8 || strncasecmp((const char *)v, "bearer ", 7) != 0)
    return NULL;
  size_t i = 7;
  while (i < n && v[i] == ' ') i++;
  if (i == n) return NULL;
  *len = n - i;
  return (const char *)v + i;
}

int sp_coord_auth_authorize(sp_rpc_call *call, void *arg, char *msg,
                            size_t cap) {
  const sp_coord_auth *a = arg;
  size_t n = 0, tlen = 0;
  const uint8_t *v = sp_rpc_call_metadata(call, "authorization", &n);
  const char *tok = bearer(v, n, &tlen);
  const sp_rpc_principal *p = tok ? sp_coord_auth_lookup(a, tok, tlen) : NULL;
  if (p == NULL) {
    snprintf(msg, cap, "missing or invalid bearer token");
    return SP_RPC_UNAUTHENTICATED;
  }
  const char *path = sp_rpc_call_path(call);
  if (!role_may_call(p->role, path)) {
    const char *m = strrchr(path, '/');
    snprintf(msg, cap, "token \"%s\" has role %s, which may not call %s",
             p->name, sp_auth_role_name(p->role), m ? m + 1 : path);
    return SP_RPC_PERMISSION_DENIED;
  }
  sp_rpc_call_set_principal(call, p);
  return SP_RPC_OK;
}

#define WORKER_PREFIX "comm/"

int sp_coord_auth_store_may_write(const sp_rpc_principal *p, const char *key,
                                  char *msg, size_t cap) {
  if (p == NULL || p->role == SP_ROLE_ADMIN) return SP_RPC_OK;
  if (p->role == SP_ROLE_WORKER &&
      strncmp(key, WORKER_PREFIX, sizeof WORKER_PREFIX - 1) == 0)
    return SP_RPC_OK;
  snprintf(msg, cap, "token \"%s\" has role %s, which may %s (key \"%.64s\")",
           p->name, sp_auth_role_name(p->role),
           p->role == SP_ROLE_WORKER
               ? "write only store keys under \"" WORKER_PREFIX "\""
               : "not write the store",
           key);
  return SP_RPC_PERMISSION_DENIED;
}

/* ---- quota ---- */

static uint64_t key_hash(const char *k, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)k[i]) * 0x100000001b3ull;
  return h;
}

static owned_key *slot_find(const sp_coord_auth *a, const char *key,
                            size_t klen, uint64_t h) {
  if (a->cap == 0) return NULL;
  for (size_t i = h & (a->cap - 1), probes = 0; probes < a->cap;
       i = (i + 1) & (a->cap - 1), probes++) {
    owned_key *s = &a->slots[i];
    if (s->key == NULL) return NULL;
    if (s->key != TOMB && s->hash == h && s->klen == klen &&
        memcmp(s->key, key, klen) == 0)
      return s;
  }
  return NULL;
}

static int slots_grow(sp_coord_auth *a) {
  size_t cap = a->cap ? a->cap * 2 : 64;
  /* only tombstones made it full: rebuild at the same size */
  if (a->cap && (a->used - a->keys_live) * 2 > a->cap) cap = a->cap;
  owned_key *s = calloc(cap, sizeof *s);
  if (s == NULL) return SP_ENOMEM;
  for (size_t i = 0; i < a->cap; i++) {
    owned_key *o = &a->slots[i];
    if (o->key == NULL || o->key == TOMB) continue;
    size_t j = o->hash & (cap - 1);
    while (s[j].key != NULL) j = (j + 1) & (cap - 1);
    s[j] = *o;
  }
  free(a->slots);
  a->slots = s;
  a->cap = cap;
  a->used = a->keys_live;
  return 0;
}

static auth_entry *entry_of(const sp_rpc_principal *p) {
  return (auth_entry *)(uintptr_t)p;
}

int sp_coord_auth_quota_check(sp_coord_auth *a, const sp_rpc_principal *p,
                              const char *key, size_t klen, size_t vlen,
                              char *msg, size_t cap) {
  if (a == NULL || p == NULL) return SP_RPC_OK;
  const auth_entry *e = entry_of(p);
  const owned_key *s = slot_find(a, key, klen, key_hash(key, klen));
  uint64_t size = klen + vlen;
  uint64_t keys = e->keys, bytes = e->bytes;
  if (s != NULL && s->owner == e) {
    bytes = bytes - s->bytes + size;
  } else {
    keys++;
    bytes += size;
  }
  if (keys > a->quota.keys) {
    snprintf(msg, cap,
             "store quota of token \"%s\": at most %llu keys "
             "(--store-quota-keys)",
             e->name, (unsigned long long)a->quota.keys);
    return SP_RPC_RESOURCE_EXHAUSTED;
  }
  if (bytes > a->quota.bytes) {
    snprintf(msg, cap,
             "store quota of token \"%s\": at most %llu bytes of "
             "keys and values, %llu held (--store-quota-bytes)",
             e->name, (unsigned long long)a->quota.bytes,
             (unsigned long long)e->bytes);
    return SP_RPC_RESOURCE_EXHAUSTED;
  }
  return SP_RPC_OK;
}

int sp_coord_auth_quota_wrote(sp_coord_auth *a, const sp_rpc_principal *p,
                              const char *key, size_t klen, size_t vlen) {
  if (a == NULL || p == NULL) return 0;
  auth_entry *e = entry_of(p);
  uint64_t h = key_hash(key, klen);
  owned_key *s = slot_find(a, key, klen, h);
  if (s != NULL) {
    s->owner->keys--;
    s->owner->bytes -= s->bytes;
  } else {
    if ((a->used + 1) * 4 > a->cap * 3) {
      int rc = slots_grow(a);
      if (rc != 0) return rc;
    }
    char *k = malloc(klen + 1);
    if (k == NULL) return SP_ENOMEM;
    memcpy(k, key, klen);
    k[klen] = '\0';
    size_t i = h & (a->cap - 1);
    while (a->slots[i].key != NULL && a->slots[i].key != TOMB)
      i = (i + 1) & (a->cap - 1);
    s = &a->slots[i];
    if (s->key == NULL) a->used++;
    a->keys_live++;
    *s = (owned_key){.key = k, .klen = klen, .hash = h};
  }
  s->owner = e;
  s->bytes = klen + vlen;
  e->keys++;
  e->bytes += s->bytes;
  return 0;
}

void sp_coord_auth_quota_deleted(sp_coord_auth *a, const char *key,
                                 size_t klen) {
  if (a == NULL) return;
  owned_key *s = slot_find(a, key, klen, key_hash(key, klen));
  if (s == NULL) return;
  s->owner->keys--;
  s->owner->bytes -= s->bytes;
  free(s->key);
  s->key = TOMB;
  a->keys_live--;
}

void sp_coord_auth_quota_usage(const sp_coord_auth *a,
                               const sp_rpc_principal *p, uint64_t *bytes,
                               uint64_t *keys) {
  const auth_entry *e = a && p ? entry_of(p) : NULL;
  if (bytes) *bytes = e ? e->bytes : 0;
  if (keys) *keys = e ? e->keys : 0;
}
