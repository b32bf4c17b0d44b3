#include "strmap.h"

#include <stdlib.h>
#include <string.h>

#include "sp_error.h"

typedef struct slot {
  const char *key; /* NULL: empty */
  uint64_t hash;
  int32_t value;
} slot;

struct sp_strmap {
  slot *slots;
  size_t cap; /* power of two */
  size_t size;
};

char *sp_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *p = malloc(n);
  if (p != NULL) memcpy(p, s, n);
  return p;
}

uint64_t sp_fnv1a64(uint64_t h, const void *data, size_t len) {
  const unsigned char *p = data;
  for (size_t i = 0; i < len; i++) {
    h ^= p[i];
    h *= UINT64_C(0x100000001b3);
  }
  return h;
}

static uint64_t hash_key(const char *key) {
  return sp_fnv1a64(SP_FNV1A64_INIT, key, strlen(key));
}

sp_strmap *sp_strmap_new(size_t expected) {
  sp_strmap *m = calloc(1, sizeof *m);
  if (m == NULL) return NULL;
  size_t cap = 16;
  while (cap < expected * 2 && cap < ((size_t)1 << 40)) cap <<= 1;
  m->slots = calloc(cap, sizeof *m->slots);
  if (m->slots == NULL) {
    free(m);
    return NULL;
  }
  m->cap = cap;
  return m;
}

void sp_strmap_free(sp_strmap *m) {
  if (m == NULL) return;
  free(m->slots);
  free(m);
}

static slot *find_slot(slot *slots, size_t cap, const char *key, uint64_t h) {
  size_t i = (size_t)h & (cap - 1);
  for (;;) {
    slot *s = &slots[i];
    if (s->key == NULL || (s->hash == h && strcmp(s->key, key) == 0)) return s;
    i = (i + 1) & (cap - 1);
  }
}

static int grow(sp_strmap *m) {
  size_t cap = m->cap * 2;
  slot *slots = calloc(cap, sizeof *slots);
  if (slots == NULL) return SP_ENOMEM;
  for (size_t i = 0; i < m->cap; i++) {
    if (m->slots[i].key == NULL) continue;
    *find_slot(slots, cap, m->slots[i].key, m->slots[i].hash) = m->slots[i];
  }
  free(m->slots);
  m->slots = slots;
  m->cap = cap;
  return 0;
}

int sp_strmap_put(sp_strmap *m, const char *key, int32_t value) {
  /* keep the load factor under 1/2 so probe sequences stay short */
  if ((m->size + 1) * 2 > m->cap) {
    int rc = grow(m);
    if (rc != 0) return rc;
  }
  uint64_t h = hash_key(key);
  slot *s = find_slot(m->slots, m->cap, key, h);
  if (s->key != NULL) return SP_EEXIST;
  s->key = key;
  s->hash = h;
  s->value = value;
  m->size++;
  return 0;
}

int32_t sp_strmap_get(const sp_strmap *m, const char *key) {
  if (m == NULL || key == NULL) return -1;
  slot *s = find_slot(m->slots, m->cap, key, hash_key(key));
  return s->key != NULL ? s->value : -1;
}

size_t sp_strmap_size(const sp_strmap *m) { return m->size; }
