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
#if !defined(SP_RPC_MEM_CACHE) && defined(__GLIBC__)
#define SP_RPC_MEM_CACHE 1
#endif
#ifndef SP_RPC_MEM_CACHE
#define SP_RPC_MEM_CACHE 0
#endif
/* glibc's own heap is the one in use (not a sanitizer's): its statistics
 * and malloc_trim mean something */
#if SP_RPC_MEM_CACHE
#if __GLIBC_PREREQ(2, 33)
#define SP_RPC_MEM_TRIM 1
#endif
#endif
#ifndef SP_RPC_MEM_TRIM
#define SP_RPC_MEM_TRIM 0
#endif
#if SP_RPC_MEM_CACHE
#include <malloc.h>
#endif

/* usable bytes of a class's blocks */
#define CLASS_BYTES(c) ((size_t)24 + (size_t)16 * (c))

_Static_assert(CLASS_BYTES(SP_RPC_MEM_CLASSES - 1) == SP_RPC_MEM_MAX,
               "the last class holds SP_RPC_MEM_MAX bytes");

static void *nv_malloc(size_t size, void *m) {
  return sp_rpc_mem_alloc(m, size);
}
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
      void *b = m->free[c];
      memcpy(&m->free[c], b, sizeof(void *));
      free(b);
    }
  }
  m->kept = 0;
}

void *sp_rpc_mem_alloc(sp_rpc_mem *m, size_t size) {
  if (!SP_RPC_MEM_CACHE || m == NULL || size > SP_RPC_MEM_MAX)
    return malloc(size);
  /* the class malloc itself would round this size to */
  size_t c = size <= CLASS_BYTES(0) ? 0 : (size - CLASS_BYTES(0) + 15) / 16;
  void *b = m->free[c];
  if (b == NULL) return malloc(CLASS_BYTES(c));
  memcpy(&m->free[c], b, sizeof(void *)); /* the next block */
  m->kept -= CLASS_BYTES(c);
  return b;
}

void *sp_rpc_mem_calloc(sp_rpc_mem *m, size_t n, size_t size) {
  if (size != 0 && n > SIZE_MAX / size) return NULL;
  void *p = sp_rpc_mem_alloc(m, n * size);
  if (p != NULL) memset(p, 0, n * size);
  return p;
}

void sp_rpc_mem_free(sp_rpc_mem *m, void *p) {
  if (p == NULL) return;
#if SP_RPC_MEM_CACHE
  if (m != NULL) {
    size_t u = malloc_usable_size(p);
    if (u >= CLASS_BYTES(0) && u <= SP_RPC_MEM_MAX) {
      size_t c = (u - CLASS_BYTES(0)) / 16; /* its size or just below */
      if (m->kept + CLASS_BYTES(c) <= SP_RPC_MEM_KEEP_BYTES) {
        memcpy(p, &m->free[c], sizeof(void *));
        m->free[c] = p;
        m->kept += CLASS_BYTES(c);
        return;
      }
    }
  }
#else
  (void)m;
#endif
  free(p);
}

void *sp_rpc_mem_realloc(sp_rpc_mem *m, void *p, size_t size) {
  if (p == NULL) return sp_rpc_mem_alloc(m, size);
  return realloc(p, size); /* every block is malloc's */
}

bool sp_rpc_mem_trim(sp_rpc_mem_trimmer *t) {
#if SP_RPC_MEM_TRIM
  if (t->threshold == 0) return false;
  struct mallinfo2 mi = mallinfo2();
  /* free chunks, less the top one (glibc trims that itself past
   * M_TRIM_THRESHOLD) */
  size_t free_bytes = mi.fordblks > mi.keepcost ? mi.fordblks - mi.keepcost : 0;
  /* Reused since: its pages are resident again, and the next growth is
   * counted from here. */
  if (free_bytes < t->base) t->base = free_bytes;
  if (free_bytes - t->base < t->threshold) return false;
  malloc_trim(0);
  t->base = free_bytes; /* trimmed chunks still count as free */
  t->trims++;
  return true;
#else
  (void)t;
  return false;
#endif
}

bool sp_rpc_mem_trim_supported(void) { return SP_RPC_MEM_TRIM; }
