/* A small-block cache for the allocations a loop makes and frees on every
 * call: nghttp2's per-stream state (streams, frame items, header copies,
 * header buffers) and the engine's own per-call structs. Freed blocks of
 * up to SP_RPC_MEM_MAX bytes go on a free list by size class and the next
 * allocation of that class takes one back, without going through malloc.
 *
 * Why: a unary call made about 40 mallocs and frees on the two ends
 * together, and with calls in flight they overran glibc's per-thread cache
 * (7 blocks a size), so most went through its arena code (malloc, free and
 * their helpers were 15% of user CPU in bench/rpc).
 *
 * One cache per server or client, used only on its loop's thread (no
 * locking), and outliving every block it handed out. The free lists
 * are bounded (SP_RPC_MEM_KEEP_BYTES a class, 384 KiB in all) and hold
 * only blocks that were in use at once before.
 * Under AddressSanitizer the cache passes everything to malloc and free,
 * so that use after free is still caught. */
#ifndef SP_RPC_MEM_H
#define SP_RPC_MEM_H

#include <nghttp2/nghttp2.h>
#include <stddef.h>
#include <stdint.h>

/* Size classes: 64, 128, ..., 2048 bytes (the largest per-call block
 * nghttp2 made in bench/rpc was a 1.6 KiB header copy). */
#define SP_RPC_MEM_CLASSES 6
#define SP_RPC_MEM_MAX 2048u
/* Each class keeps at most this many bytes of free blocks (1,024 blocks
 * of 64 bytes, 32 of 2 KiB): 32 blocks a class were too few for 64 calls
 * in flight, and a third of the allocations still went to malloc. */
#define SP_RPC_MEM_KEEP_BYTES (64u << 10)

typedef struct sp_rpc_mem {
  nghttp2_mem nv; /* for nghttp2_session_*_new3; mem_user_data: this */
  struct sp_rpc_mem_blk *free[SP_RPC_MEM_CLASSES];
  uint32_t n_free[SP_RPC_MEM_CLASSES];
} sp_rpc_mem;

void sp_rpc_mem_init(sp_rpc_mem *m);
/* Frees the cached blocks; every block must be freed before. */
void sp_rpc_mem_release(sp_rpc_mem *m);

/* m NULL: plain malloc, calloc, realloc and free (for lists that may
 * have no cache). NULL when out of memory. calloc checks n * size for
 * overflow. */
void *sp_rpc_mem_alloc(sp_rpc_mem *m, size_t size);
void *sp_rpc_mem_calloc(sp_rpc_mem *m, size_t n, size_t size);
/* NULL when out of memory, the old block still valid. */
void *sp_rpc_mem_realloc(sp_rpc_mem *m, void *p, size_t size);
/* p from this cache, or NULL. */
void sp_rpc_mem_free(sp_rpc_mem *m, void *p);

#endif
