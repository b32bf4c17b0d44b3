#include "mem_store.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

struct sp_mstore_entry {
  char *key;
  uint8_t *val;
  size_t len;
  sp_mstore_entry *next;
};

void sp_mstore_init(sp_mstore *s) {
  memset(s, 0, sizeof *s);
  pthread_mutex_init(&s->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cv, &ca);
  pthread_condattr_destroy(&ca);
}

void sp_mstore_destroy(sp_mstore *s) {
  for (sp_mstore_entry *e = s->head, *n; e != NULL; e = n) {
    n = e->next;
    free(e->key);
    free(e->val);
    free(e);
  }
  pthread_cond_destroy(&s->cv);
  pthread_mutex_destroy(&s->mu);
}

/* Under s->mu. */
static sp_mstore_entry *find(sp_mstore *s, const char *key) {
  for (sp_mstore_entry *e = s->head; e != NULL; e = e->next)
    if (strcmp(e->key, key) == 0) return e;
  return NULL;
}

int sp_mstore_set(void *user, const char *key, const void *val, size_t len,
                  sp_diag *d) {
  sp_mstore *s = user;
  pthread_mutex_lock(&s->mu);
  s->sets++;
  if (s->fail_set != 0) {
    int rc = s->fail_set;
    pthread_mutex_unlock(&s->mu);
    return sp_diag_set(d, rc, "test store refuses set '%s'", key);
  }
  uint8_t *copy = malloc(len > 0 ? len : 1);
  if (copy == NULL) {
    pthread_mutex_unlock(&s->mu);
    return sp_diag_set(d, SP_ENOMEM, "test store: no memory");
  }
  if (len > 0) memcpy(copy, val, len);
  sp_mstore_entry *e = find(s, key);
  if (e == NULL) {
    e = calloc(1, sizeof *e);
    char *k = strdup(key);
    if (e == NULL || k == NULL) {
      pthread_mutex_unlock(&s->mu);
      free(e);
      free(k);
      free(copy);
      return sp_diag_set(d, SP_ENOMEM, "test store: no memory");
    }
    e->key = k;
    e->next = s->head;
    s->head = e;
  } else {
    free(e->val);
  }
  e->val = copy;
  e->len = len;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return 0;
}

int sp_mstore_get(void *user, const char *key, uint64_t wait_ms, uint8_t **val,
                  size_t *len, sp_diag *d) {
  sp_mstore *s = user;
  struct timespec dl;
  clock_gettime(CLOCK_MONOTONIC, &dl);
  dl.tv_sec += (time_t)(wait_ms / 1000);
  dl.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&s->mu);
  s->gets++;
  sp_mstore_entry *e;
  while ((e = find(s, key)) == NULL) {
    if (wait_ms == 0) {
      pthread_mutex_unlock(&s->mu);
      return sp_diag_set(d, SP_ENOENT, "no key '%s'", key);
    }
    if (pthread_cond_timedwait(&s->cv, &s->mu, &dl) != 0 &&
        find(s, key) == NULL) {
      pthread_mutex_unlock(&s->mu);
      return sp_diag_set(d, SP_ETIMEDOUT, "key '%s' did not appear", key);
    }
  }
  *val = malloc(e->len > 0 ? e->len : 1);
  if (*val == NULL) {
    pthread_mutex_unlock(&s->mu);
    return sp_diag_set(d, SP_ENOMEM, "test store: no memory");
  }
  memcpy(*val, e->val, e->len);
  *len = e->len;
  pthread_mutex_unlock(&s->mu);
  return 0;
}

sp_comm_store sp_mstore_comm_store(sp_mstore *s) {
  sp_comm_store st = {.set = sp_mstore_set, .get = sp_mstore_get, .user = s};
  return st;
}

long sp_mstore_len(sp_mstore *s, const char *key) {
  pthread_mutex_lock(&s->mu);
  sp_mstore_entry *e = find(s, key);
  long n = e != NULL ? (long)e->len : -1;
  pthread_mutex_unlock(&s->mu);
  return n;
}
