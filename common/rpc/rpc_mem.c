#include "rpc_mem.h"

#include <stdlib.h>
#include <string.h>

#if defined(__SANITIZE_ADDRESS__)
#define SP_RPC_MEM_CACHE 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SP_RPC_MEM_CACHE 0
#endif
#endif
#ifndef SP_RPC_MEM_CACHE
#define SP_RPC_MEM_CACHE 1
#endif

/* Every block starts with this header, which keeps the caller's pointer
 * aligned as malloc's is. */
typedef struct sp_rpc_mem_blk {
  union {
    struct sp_rpc_mem_blk *next; /* on a free list */
    size_t cls;                  /* in use: its class, or LARGE */
  } u;
  size_t pad;
} sp_rpc_mem_blk;

#define LARGE ((size_t)SP_RPC_MEM_CLASSES)
#define CLASS_BYTES(c) ((size_t)64 << (c))

_Static_assert(CLASS_BYTES(SP_RPC_MEM_CLASSES - 1) == SP_RPC_MEM_MAX,
               "the last class holds SP_RPC_MEM_MAX bytes");
_Static_assert(sizeof(sp_rpc_mem_blk) == 16, "keeps 16-byte alignment");

static size_t class_of(size_t size) {
  if (!SP_RPC_MEM_CACHE || size > SP_RPC_MEM_MAX) return LARGE;
  if (size <= CLASS_BYTES(0)) return 0;
  /* the smallest c with 64 << c >= size */
  return (size_t)(64 - __builtin_clzll((unsigned long long)(size - 1))) - 6;
}

static void *nv_malloc(size_t size, void *m) { return sp_rpc_mem_alloc(m, size); }
static void nv_free(void *p, void *m) { sp_rpc_mem_free(m, p); }
static void *nv_calloc(size_t n, size_t size, void *m) {
  return sp_rpc_mem_calloc(m, n, size);
}
static void *nv_realloc(void *p, size_t size, void *m) {
  return sp_rpc_mem_realloc(m, p, size);
}

void sp_rpc_mem_init(sp_rpc_mem *m) {
  memset(m, 0, sizeof *m);
  m->nv = (nghttp2_mem){m, nv_malloc, nv_free, nv_calloc, nv_realloc};
}

void sp_rpc_mem_release(sp_rpc_mem *m) {
  for (size_t c = 0; c < SP_RPC_MEM_CLASSES; c++) {
    while (m->free[c] != NULL) {
      sp_rpc_mem_blk *b = m->free[c];
      m->free[c] = b->u.next;
      free(b);
    }
    m->n_free[c] = 0;
  }
}

void *sp_rpc_mem_alloc(sp_rpc_mem *m, size_t size) {
  if (m == NULL) return malloc(size);
  size_t c = class_of(size);
  sp_rpc_mem_blk *b;
  if (c != LARGE && m->free[c] != NULL) {
    b = m->free[c];
    m->free[c] = b->u.next;
    m->n_free[c]--;
  } else {
    size_t n = c != LARGE ? CLASS_BYTES(c) : size;
    if (n > SIZE_MAX - sizeof *b) return NULL;
    b = malloc(sizeof *b + n);
    if (b == NULL) return NULL;
  }
  b->u.cls = c;
  return b + 1;
}

void *sp_rpc_mem_calloc(sp_rpc_mem *m, size_t n, size_t size) {
  if (size != 0 && n > SIZE_MAX / size) return NULL;
  if (m == NULL) return calloc(n, size);
  void *p = sp_rpc_mem_alloc(m, n * size);
  if (p != NULL) memset(p, 0, n * size);
  return p;
}

void sp_rpc_mem_free(sp_rpc_mem *m, void *p) {
  if (p == NULL) return;
  if (m == NULL) {
    free(p);
    return;
  }
  sp_rpc_mem_blk *b = (sp_rpc_mem_blk *)p - 1;
  size_t c = b->u.cls;
  if (c == LARGE || m->n_free[c] >= SP_RPC_MEM_KEEP_BYTES / CLASS_BYTES(c)) {
    free(b);
    return;
  }
  b->u.next = m->free[c];
  m->free[c] = b;
  m->n_free[c]++;
}

void *sp_rpc_mem_realloc(sp_rpc_mem *m, void *p, size_t size) {
  if (m == NULL) return realloc(p, size);
  if (p == NULL) return sp_rpc_mem_alloc(m, size);
  sp_rpc_mem_blk *b = (sp_rpc_mem_blk *)p - 1;
  size_t c = b->u.cls;
  if (c != LARGE && size <= CLASS_BYTES(c)) return p;
  if (c == LARGE && class_of(size) == LARGE) {
    if (size > SIZE_MAX - sizeof *b) return NULL;
    sp_rpc_mem_blk *nb = realloc(b, sizeof *b + size);
    return nb != NULL ? nb + 1 : NULL;
  }
  /* between a class and a large block, or to a bigger class */
  void *q = sp_rpc_mem_alloc(m, size);
  if (q == NULL) return NULL;
  /* a large block holds more than any class, so it gives `size` bytes */
  size_t old = c != LARGE ? CLASS_BYTES(c) : size;
  memcpy(q, p, old < size ? old : size);
  sp_rpc_mem_free(m, p);
  return q;
}
