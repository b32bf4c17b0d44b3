/* The coordinator's key-value store (see kvstore.h for the contract).
 *
 * Layout: a chained hash table of entries. An entry is either a present key
 * (with its value and version) or a *placeholder*: an absent key that at
 * least one waiter is missing. Placeholders let a set find the waiters of a
 * key with the same single lookup that finds the key, so one set wakes all
 * of them in one pass, and they vanish when their last waiter goes.
 *
 * A waiter holds one link per key it was missing when it registered; a link
 * sits on its placeholder's list until the key appears. The waiter counts
 * its attached links (`missing`); the set that brings it to zero fires it.
 *
 * Entries never move once allocated (only the bucket array is resized), so
 * links may point at them directly, and callbacks that insert keys cannot
 * invalidate anything a wake pass holds.
 */
#include "kvstore.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#define DEFAULT_MAX_KEY ((size_t)8 << 10)
#define DEFAULT_MAX_VALUE ((size_t)8 << 20)
#define DEFAULT_MAX_KEYS ((size_t)1000000)
#define DEFAULT_MAX_BYTES \
  ((size_t)(UINT64_C(4) << 30 > SIZE_MAX ? SIZE_MAX : UINT64_C(4) << 30))
#define DEFAULT_MAX_WAITERS ((size_t)1000000)
/* Per-entry sizes are kept far below SIZE_MAX so that len + 1 and
 * klen + vlen never wrap, whatever limits a caller passes. */
#define HARD_MAX_LEN (SIZE_MAX / 4)
#define MIN_BUCKETS ((size_t)16)

typedef struct entry entry;
typedef struct wlink wlink;

/* One key a waiter is still missing. */
struct wlink {
  sp_kvstore_waiter *w;
  entry *e;           /* the placeholder it waits on; NULL once it appeared */
  wlink *prev, *next; /* on e->waiters */
};

struct entry {
  entry *next; /* bucket chain */
  uint64_t hash;
  uint64_t version; /* 0 while a placeholder */
  uint8_t *value;   /* vlen bytes + a NUL; NULL while a placeholder */
  size_t vlen;
  wlink *waiters; /* placeholders only; never empty for a placeholder */
  size_t klen;
  bool present;
  uint8_t key[];
};

enum { W_WAITING, W_FIRING, W_CANCELLED };

struct sp_kvstore_waiter {
  sp_kvstore_wake_fn fn;
  void *arg;
  sp_kvstore_waiter *prev, *next; /* s->waiters, while W_WAITING */
  sp_kvstore_waiter *fire_next;   /* the wake pass's list, once firing */
  size_t n;                       /* links used */
  size_t missing;                 /* links still attached to a placeholder */
  int state;
  wlink links[];
};

struct sp_kvstore {
  sp_kvstore_limits lim;
  entry **buckets;
  size_t nbuckets;  /* power of two */
  size_t n_entries; /* present keys + placeholders: what max_keys bounds */
  size_t n_keys;    /* present keys */
  size_t bytes;     /* present keys + values */
  size_t reserved;  /* placeholder key bytes, also charged to max_bytes */
  size_t n_waiters;
  sp_kvstore_waiter *waiters;
  uint64_t sets, wakes;
  uint64_t k0, k1; /* hash key */
};

/* ---- hashing ---------------------------------------------------------- */

/* SipHash-1-3 with a per-store random key, as Redis uses for its dicts:
 * keys come from the network, and a fixed hash would let one client pile
 * every key into one chain. */
#define ROTL(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND       \
  do {                 \
    v0 += v1;          \
    v1 = ROTL(v1, 13); \
    v1 ^= v0;          \
    v0 = ROTL(v0, 32); \
    v2 += v3;          \
    v3 = ROTL(v3, 16); \
    v3 ^= v2;          \
    v0 += v3;          \
    v3 = ROTL(v3, 21); \
    v3 ^= v0;          \
    v2 += v1;          \
    v1 = ROTL(v1, 17); \
    v1 ^= v2;          \
    v2 = ROTL(v2, 32); \
  } while (0)

static uint64_t siphash13(uint64_t k0, uint64_t k1, const uint8_t *p,
                          size_t n) {
  uint64_t v0 = k0 ^ UINT64_C(0x736f6d6570736575);
  uint64_t v1 = k1 ^ UINT64_C(0x646f72616e646f6d);
  uint64_t v2 = k0 ^ UINT64_C(0x6c7967656e657261);
  uint64_t v3 = k1 ^ UINT64_C(0x7465646279746573);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t m = 0;
    for (int j = 0; j < 8; j++) m |= (uint64_t)p[i + (size_t)j] << (8 * j);
    v3 ^= m;
    SIPROUND;
    v0 ^= m;
  }
  uint64_t b = (uint64_t)n << 56;
  for (size_t j = 0; i + j < n; j++) b |= (uint64_t)p[i + j] << (8 * j);
  v3 ^= b;
  SIPROUND;
  v0 ^= b;
  v2 ^= 0xff;
  SIPROUND;
  SIPROUND;
  SIPROUND;
  return v0 ^ v1 ^ v2 ^ v3;
}

static uint64_t hash_of(const sp_kvstore *s, const void *key, size_t klen) {
  return siphash13(s->k0, s->k1, key, klen);
}

static void seed(sp_kvstore *s) {
  uint64_t k[2] = {0, 0};
  if (getrandom(k, sizeof k, GRND_NONBLOCK) != (ssize_t)sizeof k) {
    /* Early boot or a seccomp filter: a weaker seed still beats none. */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    k[0] ^= (uint64_t)(uintptr_t)s * UINT64_C(0x9e3779b97f4a7c15);
    k[1] ^= ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec;
  }
  s->k0 = k[0];
  s->k1 = k[1];
}

/* ---- table ------------------------------------------------------------ */

/* The pointer that points at the entry for key (or at the NULL that ends
 * its chain), so callers can insert or unlink in place. */
static entry **find_slot(const sp_kvstore *s, uint64_t h, const void *key,
                         size_t klen) {
  entry **slot = &s->buckets[h & (s->nbuckets - 1)];
  while (*slot != NULL) {
    entry *e = *slot;
    if (e->hash == h && e->klen == klen && memcmp(e->key, key, klen) == 0)
      return slot;
    slot = &e->next;
  }
  return slot;
}

static entry *find_present(const sp_kvstore *s, const void *key, size_t klen) {
  entry *e = *find_slot(s, hash_of(s, key, klen), key, klen);
  return e != NULL && e->present ? e : NULL;
}

/* Best effort: on ENOMEM the table keeps its size and only gets slower. */
static void resize(sp_kvstore *s, size_t nb) {
  entry **b = calloc(nb, sizeof *b);
  if (b == NULL) return;
  for (size_t i = 0; i < s->nbuckets; i++) {
    entry *e = s->buckets[i];
    while (e != NULL) {
      entry *next = e->next;
      entry **slot = &b[e->hash & (nb - 1)];
      e->next = *slot;
      *slot = e;
      e = next;
    }
  }
  free(s->buckets);
  s->buckets = b;
  s->nbuckets = nb;
}

static void maybe_grow(sp_kvstore *s) {
  if (s->n_entries > s->nbuckets &&
      s->nbuckets <= SIZE_MAX / 2 / sizeof(entry *))
    resize(s, s->nbuckets * 2);
}

/* Shrinks with hysteresis (1/8 full) so a key set and deleted in a loop at
 * the boundary does not rehash every time. */
static void maybe_shrink(sp_kvstore *s) {
  if (s->nbuckets > MIN_BUCKETS && s->n_entries < s->nbuckets / 8)
    resize(s, s->nbuckets / 2);
}

/* Unlinks and frees an entry, present or placeholder (whose waiter list the
 * caller has emptied). */
static void remove_entry(sp_kvstore *s, entry *e) {
  entry **slot = &s->buckets[e->hash & (s->nbuckets - 1)];
  while (*slot != e) slot = &(*slot)->next;
  *slot = e->next;
  if (e->present) {
    s->n_keys--;
    s->bytes -= e->klen + e->vlen;
    free(e->value);
  } else {
    s->reserved -= e->klen;
  }
  s->n_entries--;
  free(e);
  maybe_shrink(s);
}

/* Whether `add` more bytes fit once `sub` are released. */
static bool fits(const sp_kvstore *s, size_t add, size_t sub) {
  size_t used = s->bytes + s->reserved - sub;
  return add <= s->lim.max_bytes - used;
}

static int check_key(const sp_kvstore *s, const void *key, size_t klen) {
  if (key == NULL || klen == 0) return SP_EINVAL;
  if (klen > s->lim.max_key) return SP_ETOOBIG;
  return 0;
}

static entry *new_entry(uint64_t h, const void *key, size_t klen) {
  entry *e = malloc(sizeof *e + klen);
  if (e == NULL) return NULL;
  memset(e, 0, sizeof *e);
  e->hash = h;
  e->klen = klen;
  memcpy(e->key, key, klen);
  return e;
}

/* Stores value under key (hash h) and returns its entry. Every limit is
 * checked before anything is allocated, and on failure nothing changed.
 * The caller wakes the entry's waiters (wake_if_any) once its outputs are
 * written: callbacks may change the key again. */
static int put(sp_kvstore *s, uint64_t h, const void *key, size_t klen,
               const void *value, size_t vlen, entry **out) {
  if (vlen > s->lim.max_value) return SP_ETOOBIG;
  entry **slot = find_slot(s, h, key, klen);
  entry *e = *slot;
  if (e == NULL) {
    if (s->n_entries >= s->lim.max_keys || !fits(s, klen + vlen, 0))
      return SP_ETOOBIG;
  } else if (!fits(s, vlen, e->present ? e->vlen : 0)) {
    return SP_ETOOBIG;
  }
  /* One spare byte so values are NUL-terminated (kvstore.h promises it;
   * ADD parses in place). */
  uint8_t *v = malloc(vlen + 1);
  if (v == NULL) return SP_ENOMEM;
  if (vlen > 0) memcpy(v, value, vlen);
  v[vlen] = 0;
  if (e == NULL) {
    e = new_entry(h, key, klen);
    if (e == NULL) {
      free(v);
      return SP_ENOMEM;
    }
    *slot = e;
    s->n_entries++;
    e->present = true;
    e->version = 1;
    s->n_keys++;
    s->bytes += klen;
    maybe_grow(s);
  } else if (e->present) {
    free(e->value);
    s->bytes -= e->vlen;
    e->version++;
  } else {
    /* A placeholder becomes the key; it already counts in n_entries. */
    s->reserved -= klen;
    e->present = true;
    e->version = 1;
    s->n_keys++;
    s->bytes += klen;
  }
  e->value = v;
  e->vlen = vlen;
  s->bytes += vlen;
  s->sets++;
  *out = e;
  return 0;
}

/* ---- waiters ---------------------------------------------------------- */

static void waiter_unlist(sp_kvstore *s, sp_kvstore_waiter *w) {
  if (w->prev != NULL)
    w->prev->next = w->next;
  else
    s->waiters = w->next;
  if (w->next != NULL) w->next->prev = w->prev;
  w->prev = w->next = NULL;
  s->n_waiters--;
}

/* Detaches every link still on a placeholder; a placeholder left with no
 * waiter has no reason to exist. */
static void drop_links(sp_kvstore *s, sp_kvstore_waiter *w) {
  for (size_t i = 0; i < w->n; i++) {
    wlink *l = &w->links[i];
    entry *e = l->e;
    if (e == NULL) continue;
    if (l->prev != NULL)
      l->prev->next = l->next;
    else
      e->waiters = l->next;
    if (l->next != NULL) l->next->prev = l->prev;
    l->e = NULL;
    if (e->waiters == NULL) remove_entry(s, e);
  }
  w->missing = 0;
}

/* The key of e just appeared: count it off for every waiter on it, then run
 * the callbacks of the waiters it completed.
 *
 * Two phases because callbacks may call back into the store: the first
 * phase touches only this entry's list and leaves no pointer into the
 * table; the second walks a private list of waiters that are already out
 * of every store structure. A callback that cancels a waiter later in the
 * list only marks it (W_CANCELLED); this loop frees it without running it.
 */
static void wake_if_any(sp_kvstore *s, entry *e) {
  if (e->waiters == NULL) return;
  sp_kvstore_waiter *fire = NULL;
  wlink *l = e->waiters;
  e->waiters = NULL;
  while (l != NULL) {
    wlink *next = l->next;
    sp_kvstore_waiter *w = l->w;
    l->e = NULL;
    l->prev = l->next = NULL;
    if (--w->missing == 0) {
      waiter_unlist(s, w);
      w->state = W_FIRING;
      /* Links are pushed at the head of e->waiters, so prepending here
       * puts the fire list back in registration order. */
      w->fire_next = fire;
      fire = w;
    }
    l = next;
  }
  while (fire != NULL) {
    sp_kvstore_waiter *w = fire;
    fire = w->fire_next;
    if (w->state == W_FIRING) {
      s->wakes++;
      w->fn(w->arg);
    }
    free(w);
  }
}

/* ---- public ----------------------------------------------------------- */

int sp_kvstore_new(const sp_kvstore_limits *limits, sp_kvstore **out) {
  if (out == NULL) return SP_EINVAL;
  *out = NULL;
  sp_kvstore *s = calloc(1, sizeof *s);
  if (s == NULL) return SP_ENOMEM;
  sp_kvstore_limits l = limits != NULL ? *limits : (sp_kvstore_limits){0};
  if (l.max_key == 0) l.max_key = DEFAULT_MAX_KEY;
  if (l.max_value == 0) l.max_value = DEFAULT_MAX_VALUE;
  if (l.max_keys == 0) l.max_keys = DEFAULT_MAX_KEYS;
  if (l.max_bytes == 0) l.max_bytes = DEFAULT_MAX_BYTES;
  if (l.max_waiters == 0) l.max_waiters = DEFAULT_MAX_WAITERS;
  if (l.max_key > HARD_MAX_LEN) l.max_key = HARD_MAX_LEN;
  if (l.max_value > HARD_MAX_LEN) l.max_value = HARD_MAX_LEN;
  s->lim = l;
  s->nbuckets = MIN_BUCKETS;
  s->buckets = calloc(s->nbuckets, sizeof *s->buckets);
  if (s->buckets == NULL) {
    free(s);
    return SP_ENOMEM;
  }
  seed(s);
  *out = s;
  return 0;
}

void sp_kvstore_free(sp_kvstore *s) {
  if (s == NULL) return;
  /* Waiters first: their links point into entries, but nothing is read
   * through them here. */
  sp_kvstore_waiter *w = s->waiters;
  while (w != NULL) {
    sp_kvstore_waiter *next = w->next;
    free(w);
    w = next;
  }
  for (size_t i = 0; i < s->nbuckets; i++) {
    entry *e = s->buckets[i];
    while (e != NULL) {
      entry *next = e->next;
      free(e->value);
      free(e);
      e = next;
    }
  }
  free(s->buckets);
  free(s);
}

int sp_kvstore_set(sp_kvstore *s, const void *key, size_t klen,
                   const void *value, size_t vlen, uint64_t *version) {
  if (s == NULL || (value == NULL && vlen > 0)) return SP_EINVAL;
  int rc = check_key(s, key, klen);
  if (rc != 0) return rc;
  if (vlen > s->lim.max_value) return SP_ETOOBIG;
  entry *e;
  rc = put(s, hash_of(s, key, klen), key, klen, value, vlen, &e);
  if (rc != 0) return rc;
  if (version != NULL) *version = e->version;
  wake_if_any(s, e);
  return 0;
}

int sp_kvstore_restore(sp_kvstore *s, const void *key, size_t klen,
                       const void *value, size_t vlen, uint64_t version) {
  if (s == NULL || (value == NULL && vlen > 0) || version == 0)
    return SP_EINVAL;
  int rc = check_key(s, key, klen);
  if (rc != 0) return rc;
  if (vlen > s->lim.max_value) return SP_ETOOBIG;
  entry *e;
  rc = put(s, hash_of(s, key, klen), key, klen, value, vlen, &e);
  if (rc != 0) return rc;
  /* the version the key had when it was written down, so that a client
   * comparing versions across a restart sees no change */
  e->version = version;
  wake_if_any(s, e);
  return 0;
}

int sp_kvstore_get(const sp_kvstore *s, const void *key, size_t klen,
                   const uint8_t **value, size_t *vlen, uint64_t *version) {
  if (s == NULL) return SP_EINVAL;
  int rc = check_key(s, key, klen);
  if (rc != 0) return rc;
  entry *e = find_present(s, key, klen);
  if (e == NULL) return SP_ENOENT;
  if (value != NULL) *value = e->value;
  if (vlen != NULL) *vlen = e->vlen;
  if (version != NULL) *version = e->version;
  return 0;
}

/* Strict ASCII decimal: an optional sign, then one or more digits, nothing
 * else (no spaces, unlike strtoll). SP_EFORMAT otherwise, SP_ERANGE when
 * the digits do not fit in int64. Accumulates negatively so INT64_MIN
 * parses. */
static int parse_i64(const uint8_t *p, size_t n, int64_t *out) {
  size_t i = 0;
  bool neg = false;
  if (n > 0 && (p[0] == '-' || p[0] == '+')) {
    neg = p[0] == '-';
    i = 1;
  }
  if (i == n) return SP_EFORMAT;
  int64_t v = 0;
  bool range = false;
  for (; i < n; i++) {
    if (p[i] < '0' || p[i] > '9') return SP_EFORMAT;
    int d = p[i] - '0';
    /* On overflow keep scanning: a letter later still means EFORMAT. */
    if (!range &&
        (__builtin_mul_overflow(v, 10, &v) || __builtin_sub_overflow(v, d, &v)))
      range = true;
  }
  if (range) return SP_ERANGE;
  if (!neg) {
    if (v == INT64_MIN) return SP_ERANGE;
    v = -v;
  }
  *out = v;
  return 0;
}

static size_t format_i64(int64_t v, char buf[24]) {
  char tmp[24];
  size_t n = 0;
  /* Work in uint64 so INT64_MIN has a magnitude. */
  uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
  do {
    tmp[n++] = (char)('0' + u % 10);
    u /= 10;
  } while (u != 0);
  size_t len = 0;
  if (v < 0) buf[len++] = '-';
  while (n > 0) buf[len++] = tmp[--n];
  buf[len] = 0;
  return len;
}

int sp_kvstore_add(sp_kvstore *s, const void *key, size_t klen, int64_t delta,
                   int64_t *result, uint64_t *version) {
  if (s == NULL) return SP_EINVAL;
  int rc = check_key(s, key, klen);
  if (rc != 0) return rc;
  uint64_t h = hash_of(s, key, klen);
  entry *e = *find_slot(s, h, key, klen);
  int64_t cur = 0;
  if (e != NULL && e->present && (rc = parse_i64(e->value, e->vlen, &cur)) != 0)
    return rc;
  int64_t r;
  if (__builtin_add_overflow(cur, delta, &r)) return SP_ERANGE;
  char buf[24];
  size_t len = format_i64(r, buf);
  if ((rc = put(s, h, key, klen, buf, len, &e)) != 0) return rc;
  if (result != NULL) *result = r;
  if (version != NULL) *version = e->version;
  wake_if_any(s, e);
  return 0;
}

int sp_kvstore_compare_set(sp_kvstore *s, const void *key, size_t klen,
                           const void *expected, size_t elen,
                           bool expect_absent, const void *desired, size_t dlen,
                           bool *swapped, const uint8_t **value, size_t *vlen,
                           bool *found, uint64_t *version) {
  if (s == NULL || (desired == NULL && dlen > 0) ||
      (!expect_absent && expected == NULL && elen > 0))
    return SP_EINVAL;
  int rc = check_key(s, key, klen);
  if (rc != 0) return rc;
  /* An expected value the store could never hold is a caller bug, and is
   * refused like an oversize desired one. */
  if (dlen > s->lim.max_value || (!expect_absent && elen > s->lim.max_value))
    return SP_ETOOBIG;
  uint64_t h = hash_of(s, key, klen);
  entry *e = *find_slot(s, h, key, klen);
  bool present = e != NULL && e->present;
  bool match = expect_absent
                   ? !present
                   : present && e->vlen == elen &&
                         (elen == 0 || memcmp(e->value, expected, elen) == 0);
  if (match) {
    if ((rc = put(s, h, key, klen, desired, dlen, &e)) != 0) return rc;
    if (e->waiters != NULL) {
      wake_if_any(s, e);
      /* The callbacks may have changed or deleted the key: report it as it
       * is now, never a pointer they freed. */
      e = find_present(s, key, klen);
    }
    present = e != NULL;
  }
  if (swapped != NULL) *swapped = match;
  if (found != NULL) *found = present;
  if (value != NULL) *value = present ? e->value : NULL;
  if (vlen != NULL) *vlen = present ? e->vlen : 0;
  if (version != NULL) *version = present ? e->version : 0;
  return 0;
}

int sp_kvstore_delete(sp_kvstore *s, const void *key, size_t klen,
                      bool *deleted) {
  if (s == NULL) return SP_EINVAL;
  int rc = check_key(s, key, klen);
  if (rc != 0) return rc;
  entry *e = find_present(s, key, klen);
  if (deleted != NULL) *deleted = e != NULL;
  /* A placeholder is not a key: deleting it would strand its waiters. */
  if (e != NULL) remove_entry(s, e);
  return 0;
}

int sp_kvstore_clear(sp_kvstore *s,
                     void (*each)(void *arg, const void *key, size_t klen),
                     void *arg) {
  if (s == NULL) return SP_EINVAL;
  if (s->n_keys == 0) return 0;
  /* gathered first: removing shrinks and rehashes the table */
  entry **all = malloc(s->n_keys * sizeof *all);
  if (all == NULL) return SP_ENOMEM;
  size_t n = 0;
  for (size_t b = 0; b < s->nbuckets; b++)
    for (entry *e = s->buckets[b]; e != NULL; e = e->next)
      if (e->present) all[n++] = e;
  for (size_t i = 0; i < n; i++) {
    if (each != NULL) each(arg, all[i]->key, all[i]->klen);
    remove_entry(s, all[i]);
  }
  free(all);
  return 0;
}

int sp_kvstore_wait(sp_kvstore *s, const void *const *keys, const size_t *klens,
                    size_t n, sp_kvstore_wake_fn fn, void *arg,
                    sp_kvstore_waiter **out) {
  if (out != NULL) *out = NULL;
  if (s == NULL || fn == NULL || (n > 0 && (keys == NULL || klens == NULL)))
    return SP_EINVAL;
  /* First pass: validate everything and count, allocating nothing, so the
   * common case (every key already there) costs no allocation. */
  size_t missing = 0;
  for (size_t i = 0; i < n; i++) {
    int rc = check_key(s, keys[i], klens[i]);
    if (rc != 0) return rc;
    if (find_present(s, keys[i], klens[i]) == NULL) missing++;
  }
  if (missing == 0) return 1;
  /* A wait may not name more keys than the store may hold: it bounds the
   * links one waiter allocates even when a key is repeated. */
  if (s->n_waiters >= s->lim.max_waiters || n > s->lim.max_keys ||
      missing > (SIZE_MAX - sizeof(sp_kvstore_waiter)) / sizeof(wlink))
    return SP_ETOOBIG;
  sp_kvstore_waiter *w = malloc(sizeof *w + missing * sizeof(wlink));
  if (w == NULL) return SP_ENOMEM;
  memset(w, 0, sizeof *w);
  w->fn = fn;
  w->arg = arg;
  w->state = W_WAITING;
  int rc = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t h = hash_of(s, keys[i], klens[i]);
    entry **slot = find_slot(s, h, keys[i], klens[i]);
    entry *e = *slot;
    if (e != NULL && e->present) continue;
    if (e == NULL) {
      /* A placeholder costs what a key with an empty value costs, and is
       * charged to the same limits. */
      if (s->n_entries >= s->lim.max_keys || !fits(s, klens[i], 0)) {
        rc = SP_ETOOBIG;
        break;
      }
      if ((e = new_entry(h, keys[i], klens[i])) == NULL) {
        rc = SP_ENOMEM;
        break;
      }
      *slot = e;
      s->n_entries++;
      s->reserved += klens[i];
      maybe_grow(s);
    }
    wlink *l = &w->links[w->n++];
    l->w = w;
    l->e = e;
    l->prev = NULL;
    l->next = e->waiters;
    if (e->waiters != NULL) e->waiters->prev = l;
    e->waiters = l;
    w->missing++;
  }
  if (rc != 0) {
    /* Undo: placeholders created above lose their only waiter and go. */
    drop_links(s, w);
    free(w);
    return rc;
  }
  w->next = s->waiters;
  if (s->waiters != NULL) s->waiters->prev = w;
  s->waiters = w;
  s->n_waiters++;
  if (out != NULL) *out = w;
  return 0;
}

void sp_kvstore_cancel_wait(sp_kvstore *s, sp_kvstore_waiter *w) {
  if (s == NULL || w == NULL) return;
  if (w->state != W_WAITING) {
    /* Already taken by a wake pass that has not reached it (or is running
     * it): that pass frees it and will not call it. */
    w->state = W_CANCELLED;
    return;
  }
  drop_links(s, w);
  waiter_unlist(s, w);
  free(w);
}

void sp_kvstore_get_stats(const sp_kvstore *s, sp_kvstore_stats *st) {
  if (st == NULL) return;
  memset(st, 0, sizeof *st);
  if (s == NULL) return;
  st->keys = s->n_keys;
  st->bytes = s->bytes;
  st->waiters = s->n_waiters;
  st->sets = s->sets;
  st->wakes = s->wakes;
}
