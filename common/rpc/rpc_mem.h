/* A small-block cache for the allocations a loop makes and frees on every
 * call: nghttp2's per-stream state (streams, frame items, header copies,
 * header buffers) and the engine's own per-call structs. A freed block of
 * up to SP_RPC_MEM_MAX bytes goes on a free list by its size and the next
 * allocation of that size takes it back, without going through malloc.
 *
 * Why: a unary call made about 40 mallocs and frees on the two ends
 * together, and with calls in flight they overran glibc's per-thread cache
 * (7 blocks a size), so most went through its arena code (malloc, free and
 * their helpers were 15% of user CPU in bench/rpc).
 *
 * The blocks are malloc's own, sized as malloc sizes them (16-byte steps)
 * and told apart by malloc_usable_size, with no header: a block costs
 * what it would without the cache, which matters for what lives as long
 * as a connection (a first version with power-of-two classes and a header
 * per block cost the coordinator 1 KiB more per connection in
 * bench/coordinator). Any block may be given to free() or realloc(), and
 * any malloc'd block to sp_rpc_mem_free.
 *
 * One cache per server or client, used only on its loop's thread (no
 * locking). The free lists hold at most SP_RPC_MEM_KEEP_BYTES in all, only
 * blocks that were in use at once before. Without glibc, and under
 * AddressSanitizer (so that use after free is still caught), the cache
 * passes everything to malloc and free. */
#ifndef SP_RPC_MEM_H
#define SP_RPC_MEM_H

#include <nghttp2/nghttp2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Blocks of malloc_usable_size 24, 40, ..., 2040 bytes: glibc's chunk
 * sizes (16-byte steps less its 8-byte header), each a class. */
#define SP_RPC_MEM_MAX 2040u
#define SP_RPC_MEM_CLASSES 127
/* 64 calls in flight on a connection freed more than 32 blocks of a size
 * at once; 128 KiB holds the blocks of about 40 unary calls. A server
 * also empties its lists on its connection sweep (at least once a
 * second), so they hold blocks only through a burst: kept for good, 256
 * KiB of them cost the coordinator 0.25 KiB more per rank at 1,024 ranks
 * in bench/coordinator. */
#define SP_RPC_MEM_KEEP_BYTES (128u << 10)

typedef struct sp_rpc_mem {
  nghttp2_mem nv; /* for nghttp2_session_*_new3; mem_user_data: this */
  void *free[SP_RPC_MEM_CLASSES];
  size_t kept; /* bytes on the free lists */
} sp_rpc_mem;

void sp_rpc_mem_init(sp_rpc_mem *m);
/* Frees the blocks on the free lists. */
void sp_rpc_mem_release(sp_rpc_mem *m);

/* m NULL: plain malloc, calloc, realloc and free (for lists that may
 * have no cache). NULL when out of memory. calloc checks n * size for
 * overflow. */
/* Returning freed memory to the system. glibc gives back the free memory
 * at the top of its heap (past M_TRIM_THRESHOLD), never what is freed
 * below a block still in use: a burst of calls that ends (100,000 ranks'
 * waiting StoreGet calls answered at once, then their Session streams
 * opened) leaves that much free but resident for good, 59 MB in one free
 * chunk in bench/coordinator at 100,000 ranks (0.58 KiB a rank).
 * sp_rpc_mem_trim, called from a timer, runs malloc_trim(0) (which
 * releases the whole free pages inside free chunks, MADV_DONTNEED) when
 * the heap's free bytes grew by threshold since it last ran; pages reused
 * since fault back in as they are written. Process-wide: every thread's
 * arena is trimmed. Only with glibc (2.33, for mallinfo2) and without a
 * sanitizer's allocator; elsewhere it does nothing. */
typedef struct sp_rpc_mem_trimmer {
  size_t threshold; /* bytes; 0: never trims */
  size_t base;      /* free bytes when it last trimmed, or fewer since */
  uint64_t trims;
} sp_rpc_mem_trimmer;
/* True when it trimmed. Costs mallinfo2, a walk of the free lists. */
bool sp_rpc_mem_trim(sp_rpc_mem_trimmer *t);
/* Whether sp_rpc_mem_trim can ever trim in this build. */
bool sp_rpc_mem_trim_supported(void);

void *sp_rpc_mem_alloc(sp_rpc_mem *m, size_t size);
void *sp_rpc_mem_calloc(sp_rpc_mem *m, size_t n, size_t size);
/* NULL when out of memory, the old block still valid. */
void *sp_rpc_mem_realloc(sp_rpc_mem *m, void *p, size_t size);
/* p from malloc or from a cache, or NULL. */
void sp_rpc_mem_free(sp_rpc_mem *m, void *p);

#endif
