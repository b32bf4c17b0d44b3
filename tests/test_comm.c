/* Tests for communicators (client/lib/comm/comm.c, comm_gloo.cc): groups of 1
 * to 4 members, each a thread of this process with its own sp_comm over
 * Gloo on loopback, bootstrapped through an in-memory store. Every op and
 * dtype is checked bit for bit against a reference computed here, including
 * counts not divisible by the group size and large counts; sums are checked
 * for member order and for float32 accumulation of bfloat16/float16; abort
 * (also at random moments of a stream of collectives), a member that
 * leaves, a member process that is killed, a member that never joins,
 * desynchronised members and bad arguments must end in the right error,
 * quickly.
 *
 * cmocka's assertions longjmp, which is only valid on the test's own thread,
 * so member threads record their first failure (and abort every member's
 * communicator so nobody waits for a timeout); the main thread asserts after
 * joining them. */
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "cast/cast_scalar.h"
#include "base/clock.h"
#include "support/mem_store.h"
#include "lib/shardplane.h"
#include "support/testutil.h"

#define MAX_W 4

/* ---- groups of member threads -------------------------------------------- */

typedef struct group group;

typedef struct member {
  group *g;
  uint32_t rank;
  sp_comm *c;
  int new_rc;
  sp_diag new_diag;
  char fail[600];
  /* per-test outputs */
  int rc[8];
  sp_diag diag[8];
  double t[8];
  uint64_t hash;
} member;

typedef void (*member_fn)(member *m);

struct group {
  uint32_t size;
  char prefix[64];
  uint64_t timeout_ms;
  sp_mstore store;
  member_fn fn;
  void *arg;
  member_fn before; /* optional: runs before sp_comm_new */
  member m[MAX_W];
  _Atomic(sp_comm *) comms[MAX_W];
  pthread_barrier_t done;
  atomic_int failed;
};

static void member_fail(member *m, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Records the first failure and aborts every member, so peers blocked in a
 * collective with this one return at once instead of at their timeout. */
static void member_fail(member *m, int line, const char *fmt, ...) {
  if (m->fail[0] == '\0') {
    int n =
        snprintf(m->fail, sizeof m->fail, "rank %u line %d: ", m->rank, line);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof m->fail)
      vsnprintf(m->fail + n, sizeof m->fail - (size_t)n, fmt, ap);
    va_end(ap);
  }
  atomic_store(&m->g->failed, 1);
  for (uint32_t i = 0; i < m->g->size; i++) {
    sp_comm *c = atomic_load(&m->g->comms[i]);
    if (c != NULL) sp_comm_abort(c);
  }
}

#define MCHECK(m, cond, ...)                   \
  do {                                         \
    if (!(cond)) {                             \
      member_fail((m), __LINE__, __VA_ARGS__); \
      return;                                  \
    }                                          \
  } while (0)

#define MCHECK_RC(m, expr, diag)                                               \
  do {                                                                         \
    int rc_ = (expr);                                                          \
    MCHECK((m), rc_ == 0, "%s = %s: %s", #expr, sp_err_name(rc_), (diag).msg); \
  } while (0)

static void *member_main(void *p) {
  member *m = p;
  group *g = m->g;
  sp_comm_opts o = {
      .backend = SP_BACKEND_GLOO,
      .store = sp_mstore_comm_store(&g->store),
      .prefix = g->prefix,
      .rank = m->rank,
      .size = g->size,
      .timeout_ms = g->timeout_ms,
  };
  if (g->before != NULL) g->before(m);
  m->new_rc = sp_comm_new(&o, &m->c, &m->new_diag);
  if (m->new_rc == 0) atomic_store(&g->comms[m->rank], m->c);
  if (g->fn != NULL) g->fn(m);
  /* Nobody leaves before everybody is done: freeing closes this member's
   * connections, which peers still inside a collective would see as a lost
   * member. */
  pthread_barrier_wait(&g->done);
  atomic_store(&g->comms[m->rank], NULL);
  sp_comm_free(m->c);
  m->c = NULL;
  return NULL;
}

static unsigned group_seq;

static void group_init(group *g, uint32_t size, uint64_t timeout_ms,
                       member_fn fn, void *arg) {
  memset(g, 0, sizeof *g);
  g->size = size;
  g->timeout_ms = timeout_ms;
  g->fn = fn;
  g->arg = arg;
  snprintf(g->prefix, sizeof g->prefix, "test/comm%u", ++group_seq);
  sp_mstore_init(&g->store);
  for (uint32_t i = 0; i < MAX_W; i++) {
    g->m[i].g = g;
    g->m[i].rank = i;
    atomic_init(&g->comms[i], NULL);
  }
  atomic_init(&g->failed, 0);
}

/* Runs the members listed in ranks (all of them when ranks is NULL) and
 * joins them; fails the test with the first member's failure. */
static void group_run_ranks(group *g, const uint32_t *ranks, uint32_t n) {
  pthread_t th[MAX_W];
  uint32_t who[MAX_W];
  for (uint32_t i = 0; i < n; i++) who[i] = ranks != NULL ? ranks[i] : i;
  assert_int_equal(pthread_barrier_init(&g->done, NULL, n), 0);
  for (uint32_t i = 0; i < n; i++)
    assert_int_equal(pthread_create(&th[i], NULL, member_main, &g->m[who[i]]),
                     0);
  for (uint32_t i = 0; i < n; i++) pthread_join(th[i], NULL);
  pthread_barrier_destroy(&g->done);
  for (uint32_t i = 0; i < n; i++)
    if (g->m[who[i]].fail[0] != '\0') fail_msg("%s", g->m[who[i]].fail);
}

static void group_run(group *g) { group_run_ranks(g, NULL, g->size); }

static void group_done(group *g) { sp_mstore_destroy(&g->store); }

/* ---- data and the reference --------------------------------------------- */

static float f32_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

/* Finite values of many magnitudes, so that the order of additions shows
 * in the bits, with the odd special (signed zero, subnormal, infinity, NaN
 * with a payload) mixed in. */
static double gen_real(sp_test_rng *r, int emin, int emax) {
  uint64_t x = sp_test_rng_next(r);
  switch (x & 127) {
    case 0: return -0.0;
    case 1: return 0.0;
    case 2: return ldexp(1.0, emin - 3) * (double)((x >> 8) & 7); /* tiny */
    case 3: return (x >> 8) & 1 ? INFINITY : -INFINITY;
    case 4: {
      double nan;
      uint64_t nb = 0x7FF8000000000000ull | ((x >> 8) & 0xFFFFFull) << 29;
      memcpy(&nan, &nb, sizeof nan);
      return nan;
    }
    default: break;
  }
  double mant = (double)(x >> 11) / 9007199254740992.0 - 0.5;
  int e = emin + (int)((x >> 3) % (uint64_t)(emax - emin + 1));
  return ldexp(mant, e);
}

static void gen(void *buf, sp_dtype dt, size_t n, uint64_t seed) {
  sp_test_rng r = {seed * 0x9E3779B97F4A7C15ull + 12345};
  unsigned char *p = buf;
  for (size_t i = 0; i < n; i++) {
    switch (dt) {
      case SP_FLOAT32: {
        float v = (float)gen_real(&r, -20, 20);
        memcpy(p + i * 4, &v, 4);
        break;
      }
      case SP_FLOAT64: {
        double v = gen_real(&r, -40, 40);
        memcpy(p + i * 8, &v, 8);
        break;
      }
      case SP_BFLOAT16: {
        uint16_t h = sp_f32_to_bf16_bits(bits_of((float)gen_real(&r, -20, 20)));
        memcpy(p + i * 2, &h, 2);
        break;
      }
      case SP_FLOAT16: {
        uint16_t h = sp_f32_to_f16_bits(bits_of((float)gen_real(&r, -12, 12)));
        memcpy(p + i * 2, &h, 2);
        break;
      }
      case SP_INT64:
      case SP_INT32:
      case SP_INT16:
      case SP_INT8:
      case SP_UINT8: {
        size_t esz = sp_dtype_size(dt);
        uint64_t v = sp_test_rng_next(&r);
        memcpy(p + i * esz, &v, esz);
        break;
      }
      case SP_BOOL: p[i] = (unsigned char)(sp_test_rng_next(&r) & 1); break;
      default: break;
    }
  }
}

/* out[k] = in[0][k] + ... + in[w-1][k], one element at a time, written
 * independently of comm_sum.c's chunked loop. A NaN sum is the default
 * quiet NaN (comm_sum.h says why). */
static void ref_sum(void *out, sp_dtype dt, const void *const *in, uint32_t w,
                    size_t count) {
  unsigned char *o = out;
  for (size_t k = 0; k < count; k++) {
    switch (dt) {
      case SP_FLOAT32: {
        float acc, v;
        memcpy(&acc, (const unsigned char *)in[0] + k * 4, 4);
        for (uint32_t i = 1; i < w; i++) {
          memcpy(&v, (const unsigned char *)in[i] + k * 4, 4);
          acc += v;
        }
        if (isnan(acc)) acc = f32_of(0x7FC00000u);
        memcpy(o + k * 4, &acc, 4);
        break;
      }
      case SP_FLOAT64: {
        double acc, v;
        memcpy(&acc, (const unsigned char *)in[0] + k * 8, 8);
        for (uint32_t i = 1; i < w; i++) {
          memcpy(&v, (const unsigned char *)in[i] + k * 8, 8);
          acc += v;
        }
        if (isnan(acc)) {
          uint64_t q = 0x7FF8000000000000ull;
          memcpy(&acc, &q, 8);
        }
        memcpy(o + k * 8, &acc, 8);
        break;
      }
      case SP_BFLOAT16:
      case SP_FLOAT16: {
        float acc = 0;
        for (uint32_t i = 0; i < w; i++) {
          uint16_t h;
          memcpy(&h, (const unsigned char *)in[i] + k * 2, 2);
          float v = f32_of(dt == SP_BFLOAT16 ? sp_bf16_to_f32_bits(h)
                                             : sp_f16_to_f32_bits(h));
          acc = i == 0 ? v : acc + v;
        }
        uint16_t h = dt == SP_BFLOAT16 ? sp_f32_to_bf16_bits(bits_of(acc))
                                       : sp_f32_to_f16_bits(bits_of(acc));
        if (isnan(acc)) h = dt == SP_BFLOAT16 ? 0x7FC0 : 0x7E00;
        memcpy(o + k * 2, &h, 2);
        break;
      }
      case SP_INT64: {
        uint64_t acc = 0, v;
        for (uint32_t i = 0; i < w; i++) {
          memcpy(&v, (const unsigned char *)in[i] + k * 8, 8);
          acc += v;
        }
        memcpy(o + k * 8, &acc, 8);
        break;
      }
      case SP_INT32: {
        uint32_t acc = 0, v;
        for (uint32_t i = 0; i < w; i++) {
          memcpy(&v, (const unsigned char *)in[i] + k * 4, 4);
          acc += v;
        }
        memcpy(o + k * 4, &acc, 4);
        break;
      }
      default: break;
    }
  }
}

static uint64_t fnv(const void *p, size_t n, uint64_t h) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001B3ull;
  return h;
}

/* Seeds: distinct per test case, op, member. */
static uint64_t seed_of(uint32_t w, sp_dtype dt, size_t count, int op,
                        uint32_t rank) {
  return ((((uint64_t)w * 31 + (uint64_t)dt) * 1000003 + count) * 7 +
          (uint64_t)op) *
             16 +
         rank;
}

/* ---- every op, every dtype, against the reference ------------------------ */

static const size_t k_counts[] = {0, 1, 2, 5, 1000, 1001, 100003};
#define N_COUNTS (sizeof k_counts / sizeof k_counts[0])

/* One (dtype, count) case on one member; inputs of the others are
 * regenerated from their seeds. */
static void check_case(member *m, sp_dtype dt, size_t count, uint64_t *hash) {
  sp_comm *c = m->c;
  const uint32_t w = m->g->size, me = m->rank;
  const size_t esz = sp_dtype_size(dt), nb = count * esz;
  const bool sums =
      sp_dtype_is_floating(dt) || dt == SP_INT64 || dt == SP_INT32;
  sp_diag d = {{0}};
  /* One extra element each, so a zero count still gets real pointers. */
  unsigned char *in = malloc(nb * w + esz);
  unsigned char *out = malloc(nb * w + esz);
  unsigned char *ref = malloc(nb * w + esz);
  unsigned char *others = malloc(nb * w + esz);
  const void *blocks[MAX_W];
  MCHECK(m, in && out && ref && others, "out of memory");

  /* all_gather, separate buffers: block i of recv is member i's send. */
  gen(in, dt, count, seed_of(w, dt, count, 1, me));
  memset(out, 0xA5, nb * w);
  MCHECK_RC(m, sp_comm_all_gather(c, in, out, count, dt, &d), d);
  for (uint32_t i = 0; i < w; i++)
    gen(ref + i * nb, dt, count, seed_of(w, dt, count, 1, i));
  MCHECK(m, memcmp(out, ref, nb * w) == 0,
         "all_gather %s count %zu: wrong result", sp_dtype_name(dt), count);
  /* ... and in place: send is recv + rank * count. */
  memset(out, 0x5A, nb * w);
  gen(out + me * nb, dt, count, seed_of(w, dt, count, 1, me));
  MCHECK_RC(m, sp_comm_all_gather(c, out + me * nb, out, count, dt, &d), d);
  MCHECK(m, memcmp(out, ref, nb * w) == 0,
         "in-place all_gather %s count %zu: wrong result", sp_dtype_name(dt),
         count);

  /* broadcast from a root that moves with the case. */
  uint32_t root = (uint32_t)(count % w);
  gen(out, dt, count, seed_of(w, dt, count, 2, me));
  gen(ref, dt, count, seed_of(w, dt, count, 2, root));
  MCHECK_RC(m, sp_comm_broadcast(c, out, count, dt, root, &d), d);
  MCHECK(m, memcmp(out, ref, nb) == 0, "broadcast %s count %zu root %u",
         sp_dtype_name(dt), count, root);

  if (sums) {
    /* reduce_scatter: my block of everyone's send, summed in member order. */
    gen(in, dt, count * w, seed_of(w, dt, count, 3, me));
    unsigned char *all = malloc(nb * w * w + esz);
    MCHECK(m, all != NULL, "out of memory");
    for (uint32_t i = 0; i < w; i++) {
      gen(all + i * nb * w, dt, count * w, seed_of(w, dt, count, 3, i));
      blocks[i] = all + i * nb * w + me * nb;
    }
    ref_sum(ref, dt, blocks, w, count);
    memset(out, 0xEE, nb);
    int rc = sp_comm_reduce_scatter(c, in, out, count, dt, &d);
    free(all);
    MCHECK(m, rc == 0, "reduce_scatter: %s: %s", sp_err_name(rc), d.msg);
    if (memcmp(out, ref, nb) != 0) {
      size_t k = 0;
      while (memcmp(out + k * esz, ref + k * esz, esz) == 0) k++;
      uint64_t gv = 0, rv = 0;
      memcpy(&gv, out + k * esz, esz);
      memcpy(&rv, ref + k * esz, esz);
      MCHECK(m, 0,
             "reduce_scatter %s count %zu: element %zu is 0x%llx, want 0x%llx",
             sp_dtype_name(dt), count, k, (unsigned long long)gv,
             (unsigned long long)rv);
    }

    /* all_reduce, twice: the same bits every run. */
    for (uint32_t i = 0; i < w; i++) {
      gen(others + i * nb, dt, count, seed_of(w, dt, count, 4, i));
      blocks[i] = others + i * nb;
    }
    ref_sum(ref, dt, blocks, w, count);
    for (int run = 0; run < 2; run++) {
      gen(out, dt, count, seed_of(w, dt, count, 4, me));
      MCHECK_RC(m, sp_comm_all_reduce(c, out, count, dt, &d), d);
      MCHECK(m, memcmp(out, ref, nb) == 0, "all_reduce %s count %zu run %d",
             sp_dtype_name(dt), count, run);
    }
    *hash = fnv(out, nb, *hash);
  }
  free(in);
  free(out);
  free(ref);
  free(others);
}

static const sp_dtype k_all_dtypes[] = {
    SP_FLOAT32, SP_FLOAT64, SP_BFLOAT16, SP_FLOAT16, SP_INT64,
    SP_INT32,   SP_INT16,   SP_INT8,     SP_UINT8,   SP_BOOL};
#define N_ALL_DTYPES (sizeof k_all_dtypes / sizeof k_all_dtypes[0])

static void all_ops_member(member *m) {
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s: %s", sp_err_name(m->new_rc),
         m->new_diag.msg);
  MCHECK(m, sp_comm_rank(m->c) == m->rank && sp_comm_size(m->c) == m->g->size,
         "rank/size");
  sp_diag d = {{0}};
  MCHECK_RC(m, sp_comm_barrier(m->c, &d), d);
  uint64_t h = 0xCBF29CE484222325ull;
  for (size_t t = 0; t < N_ALL_DTYPES; t++)
    for (size_t k = 0; k < N_COUNTS; k++) {
      check_case(m, k_all_dtypes[t], k_counts[k], &h);
      if (m->fail[0] != '\0' || atomic_load(&m->g->failed)) return;
    }
  MCHECK_RC(m, sp_comm_barrier(m->c, &d), d);
  m->hash = h;
}

static void run_all_ops(uint32_t w) {
  group g;
  group_init(&g, w, 20000, all_ops_member, NULL);
  group_run(&g);
  /* The reference already pins every member's result; equal hashes say the
   * members hold the same bits without trusting that. */
  for (uint32_t i = 1; i < w; i++) assert_true(g.m[i].hash == g.m[0].hash);
  group_done(&g);
}

static void test_all_ops_w1(void **state) {
  (void)state;
  run_all_ops(1);
}
static void test_all_ops_w2(void **state) {
  (void)state;
  run_all_ops(2);
}
static void test_all_ops_w3(void **state) {
  (void)state;
  run_all_ops(3);
}
static void test_all_ops_w4(void **state) {
  (void)state;
  run_all_ops(4);
}

/* ---- reductions moved in rounds ----------------------------------------- */

/* Gloo moves a reduce-scatter's blocks and an all-reduce's segments in
 * rounds of 1 MiB per peer (comm_gloo.cc, kRoundBytes): counts that need
 * two to four rounds, with a short last one and, for the all-reduce,
 * segments of unequal length, give the reference's bits as one round
 * does. float32: 262144 elements a round, bfloat16 524288, float64
 * 131072. */
static const struct {
  sp_dtype dt;
  size_t count;
} k_round_cases[] = {
    {SP_FLOAT32, 800003}, /* reduce-scatter 4 rounds; all-reduce 2 */
    {SP_BFLOAT16, 1100003},
    {SP_FLOAT64, 300007},
};

static void rounds_member(member *m) {
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s: %s", sp_err_name(m->new_rc),
         m->new_diag.msg);
  uint64_t h = 0xCBF29CE484222325ull;
  for (size_t i = 0; i < sizeof k_round_cases / sizeof k_round_cases[0]; i++) {
    check_case(m, k_round_cases[i].dt, k_round_cases[i].count, &h);
    if (m->fail[0] != '\0' || atomic_load(&m->g->failed)) return;
  }
  m->hash = h;
}

static void test_reductions_in_rounds(void **state) {
  (void)state;
  for (uint32_t w = 2; w <= 3; w++) {
    group g;
    group_init(&g, w, 20000, rounds_member, NULL);
    group_run(&g);
    for (uint32_t i = 1; i < w; i++) assert_true(g.m[i].hash == g.m[0].hash);
    group_done(&g);
  }
}

/* ---- the order of additions and the single rounding ---------------------- */

/* Three members; member i contributes v[i]. The expected sums hold only for
 * the order 0, 1, 2 with float32 accumulation:
 *   float32  1 + 2^-24 + 2^-24: each step is a tie that rounds to even, so
 *            the sum stays 1 (the order 1, 2, 0 would give 1 + 2^-23);
 *   bfloat16 1 + 2^-8 + 2^-8 = 1 + 2^-7 exactly in float32, representable in
 *            bfloat16 (rounding after every step would give 1);
 *   float16  1 + 2^-11 + 2^-11 = 1 + 2^-10 likewise. */
static void order_member(member *m) {
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s", m->new_diag.msg);
  sp_diag d = {{0}};
  const float f32_in[3] = {1.0f, 0x1p-24f, 0x1p-24f};
  const uint16_t bf16_in[3] = {0x3F80, 0x3B80, 0x3B80}; /* 1, 2^-8, 2^-8 */
  const uint16_t f16_in[3] = {0x3C00, 0x1000, 0x1000};  /* 1, 2^-11, 2^-11 */
  for (int run = 0; run < 3; run++) {
    float f = f32_in[m->rank];
    MCHECK_RC(m, sp_comm_all_reduce(m->c, &f, 1, SP_FLOAT32, &d), d);
    MCHECK(m, bits_of(f) == bits_of(1.0f), "float32 sum %a, want 1", f);
    uint16_t b[3];
    for (int i = 0; i < 3; i++) b[i] = bf16_in[m->rank];
    uint16_t rb = 0;
    MCHECK_RC(m, sp_comm_reduce_scatter(m->c, b, &rb, 1, SP_BFLOAT16, &d), d);
    MCHECK(m, rb == 0x3F81, "bfloat16 sum 0x%04x, want 0x3f81", rb);
    uint16_t h = f16_in[m->rank];
    MCHECK_RC(m, sp_comm_all_reduce(m->c, &h, 1, SP_FLOAT16, &d), d);
    MCHECK(m, h == 0x3C01, "float16 sum 0x%04x, want 0x3c01", h);
  }
}

static void test_sum_order_and_rounding(void **state) {
  (void)state;
  group g;
  group_init(&g, 3, 20000, order_member, NULL);
  group_run(&g);
  group_done(&g);
}

/* The host-side sum on its own, where aliasing is easy to provoke: a
 * size-1 reduce_scatter with recv == send and an all_reduce are the sum of
 * one block into itself, at counts around the chunk size, for every dtype
 * (NaN inputs come out as the default NaN, the rest unchanged). */
static void test_sum_blocks_aliasing(void **state) {
  (void)state;
  sp_comm *c = NULL;
  sp_comm_opts o = {.backend = SP_BACKEND_GLOO, .rank = 0, .size = 1};
  assert_int_equal(sp_comm_new(&o, &c, NULL), 0);
  const sp_dtype dts[] = {SP_FLOAT32, SP_FLOAT64, SP_BFLOAT16,
                          SP_FLOAT16, SP_INT64,   SP_INT32};
  for (size_t t = 0; t < sizeof dts / sizeof dts[0]; t++)
    for (size_t n = 1; n < 2000; n += 173) {
      size_t esz = sp_dtype_size(dts[t]);
      unsigned char *a = malloc(n * esz), *b = malloc(n * esz);
      gen(a, dts[t], n, n);
      const void *blk[1] = {a};
      ref_sum(b, dts[t], blk, 1, n);
      assert_int_equal(sp_comm_reduce_scatter(c, a, a, n, dts[t], NULL), 0);
      assert_memory_equal(a, b, n * esz);
      gen(a, dts[t], n, n);
      assert_int_equal(sp_comm_all_reduce(c, a, n, dts[t], NULL), 0);
      assert_memory_equal(a, b, n * esz);
      free(a);
      free(b);
    }
  /* And the NaN rule itself, through the full-size path. */
  float nanp = f32_of(0xFFC12345u), one = 1.0f;
  assert_int_equal(sp_comm_all_reduce(c, &nanp, 1, SP_FLOAT32, NULL), 0);
  assert_int_equal(bits_of(nanp), 0x7FC00000u);
  assert_int_equal(sp_comm_all_reduce(c, &one, 1, SP_FLOAT32, NULL), 0);
  assert_true(one == 1.0f);
  sp_comm_free(c);
}

/* ---- abort ----------------------------------------------------------------
 */

typedef struct abort_ctx {
  atomic_int phase; /* 0: running, 1: member 0 returned from its op */
  double abort_at;
} abort_ctx;

static void *aborter(void *p) {
  member *m0 = p;
  abort_ctx *a = m0->g->arg;
  sp_test_sleep_ms(300);
  a->abort_at = sp_clock_s();
  sp_comm_abort(m0->c);
  return NULL;
}

/* Member 0 enters an all_reduce that member 1 never joins; another thread
 * aborts member 0's communicator. */
static void abort_member(member *m) {
  abort_ctx *a = m->g->arg;
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s", m->new_diag.msg);
  if (m->rank == 0) {
    float buf[1000] = {0};
    pthread_t th;
    MCHECK(m, pthread_create(&th, NULL, aborter, m) == 0, "pthread_create");
    double t0 = sp_clock_s();
    m->rc[0] = sp_comm_all_reduce(m->c, buf, 1000, SP_FLOAT32, &m->diag[0]);
    double t1 = sp_clock_s();
    pthread_join(th, NULL);
    m->t[0] = t1 - a->abort_at;
    m->t[1] = t1 - t0;
    /* Later operations fail at once. */
    t0 = sp_clock_s();
    m->rc[1] = sp_comm_barrier(m->c, &m->diag[1]);
    m->rc[2] = sp_comm_all_gather(m->c, buf, buf, 1, SP_FLOAT32, &m->diag[2]);
    m->t[2] = sp_clock_s() - t0;
    sp_comm_abort(m->c); /* twice is fine */
    atomic_store(&a->phase, 1);
  } else {
    while (atomic_load(&a->phase) == 0) sp_test_sleep_ms(5);
    /* Member 0's abort closed its connections: this member's next
     * operation fails instead of waiting out its 20 s timeout. */
    double t0 = sp_clock_s();
    m->rc[0] = sp_comm_barrier(m->c, &m->diag[0]);
    m->t[0] = sp_clock_s() - t0;
    m->rc[1] = sp_comm_barrier(m->c, &m->diag[1]);
  }
}

static void test_abort_unblocks(void **state) {
  (void)state;
  abort_ctx a;
  atomic_init(&a.phase, 0);
  a.abort_at = 0;
  group g;
  group_init(&g, 2, 20000, abort_member, &a);
  group_run(&g);
  member *m0 = &g.m[0], *m1 = &g.m[1];
  print_message("abort: op returned %.1f ms after sp_comm_abort (%s)\n",
                m0->t[0] * 1e3, m0->diag[0].msg);
  assert_int_equal(m0->rc[0], SP_ECANCELED);
  assert_true(m0->t[1] >= 0.25); /* it really was blocked */
  assert_true(m0->t[0] < 0.5);   /* and woke promptly */
  assert_non_null(strstr(m0->diag[0].msg, g.prefix));
  assert_non_null(strstr(m0->diag[0].msg, "all_reduce"));
  assert_non_null(strstr(m0->diag[0].msg, "rank 0/2"));
  assert_int_equal(m0->rc[1], SP_ECANCELED);
  assert_int_equal(m0->rc[2], SP_ECANCELED);
  assert_true(m0->t[2] < 0.05);
  print_message("abort: peer's barrier failed in %.1f ms: %s\n", m1->t[0] * 1e3,
                m1->diag[0].msg);
  assert_true(m1->rc[0] < 0);
  assert_true(m1->t[0] < 2.0);
  /* The peer's communicator is broken now: the same error, at once. */
  assert_int_equal(m1->rc[1], m1->rc[0]);
  assert_non_null(strstr(m1->diag[1].msg, "earlier failure"));
  group_done(&g);
}

/* Abort before any operation, and on a single member. */
static void test_abort_before_and_single(void **state) {
  (void)state;
  sp_comm *c = NULL;
  sp_comm_opts o = {.backend = SP_BACKEND_GLOO, .rank = 0, .size = 1};
  assert_int_equal(sp_comm_new(&o, &c, NULL), 0);
  float x = 1;
  assert_int_equal(sp_comm_all_reduce(c, &x, 1, SP_FLOAT32, NULL), 0);
  sp_comm_abort(c);
  sp_diag d = {{0}};
  assert_int_equal(sp_comm_all_reduce(c, &x, 1, SP_FLOAT32, &d), SP_ECANCELED);
  assert_non_null(strstr(d.msg, "aborted"));
  assert_int_equal(sp_comm_barrier(c, NULL), SP_ECANCELED);
  sp_comm_free(c);
  sp_comm_abort(NULL);
  sp_comm_free(NULL);
}

static void abort_early_member(member *m) {
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s", m->new_diag.msg);
  if (m->rank == 1) sp_comm_abort(m->c);
  /* Member 1 fails at once; member 0 finds its peer gone. */
  double t0 = sp_clock_s();
  m->rc[0] = sp_comm_barrier(m->c, &m->diag[0]);
  m->t[0] = sp_clock_s() - t0;
}

static void test_abort_before_first_op(void **state) {
  (void)state;
  group g;
  group_init(&g, 2, 20000, abort_early_member, NULL);
  group_run(&g);
  assert_int_equal(g.m[1].rc[0], SP_ECANCELED);
  assert_true(g.m[1].t[0] < 0.05);
  assert_true(g.m[0].rc[0] < 0);
  assert_true(g.m[0].t[0] < 2.0);
  group_done(&g);
}

/* Aborts at random moments of a stream of collectives: whatever the member
 * was doing (posting, waiting, summing, between operations), every member
 * ends its loop with an error soon after, nothing crashes, and under
 * AddressSanitizer nothing touches freed memory. */
typedef struct storm_ctx {
  unsigned delay_us;
  uint32_t victim;
  double abort_at;
  /* An abort while a peer is still in its rendezvous fails that peer's
   * sp_comm_new, rightly; this test is about operations. */
  pthread_barrier_t ready;
} storm_ctx;

static void *storm_aborter(void *p) {
  member *m = p;
  storm_ctx *s = m->g->arg;
  struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)s->delay_us * 1000L};
  nanosleep(&ts, NULL);
  s->abort_at = sp_clock_s();
  sp_comm_abort(m->c);
  return NULL;
}

static void storm_member(member *m) {
  storm_ctx *s = m->g->arg;
  pthread_barrier_wait(&s->ready);
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s", m->new_diag.msg);
  pthread_t th;
  bool victim = m->rank == s->victim;
  if (victim)
    MCHECK(m, pthread_create(&th, NULL, storm_aborter, m) == 0,
           "pthread_create");
  float *buf = malloc(20000 * sizeof *buf);
  int rc = 0;
  sp_diag d = {{0}};
  for (int i = 0; i < 100000 && rc == 0; i++) {
    for (int k = 0; k < 20000; k++) buf[k] = (float)(k + i);
    switch (i % 3) {
      case 0: rc = sp_comm_all_reduce(m->c, buf, 20000, SP_FLOAT32, &d); break;
      case 1:
        rc = sp_comm_all_gather(m->c, buf + m->rank * 5000, buf, 5000,
                                SP_FLOAT32, &d);
        break;
      default: rc = sp_comm_barrier(m->c, &d); break;
    }
  }
  m->t[0] = sp_clock_s();
  free(buf);
  if (victim) pthread_join(th, NULL);
  m->rc[0] = rc;
  m->diag[0] = d;
}

static void test_abort_storm(void **state) {
  (void)state;
  sp_test_rng r = {42};
  for (int round = 0; round < 12; round++) {
    storm_ctx s = {.delay_us = (unsigned)sp_test_rng_below(&r, 30000),
                   .victim = (uint32_t)sp_test_rng_below(&r, 3)};
    assert_int_equal(pthread_barrier_init(&s.ready, NULL, 3), 0);
    group g;
    group_init(&g, 3, 10000, storm_member, &s);
    group_run(&g);
    pthread_barrier_destroy(&s.ready);
    for (uint32_t i = 0; i < 3; i++) {
      assert_true(g.m[i].rc[0] < 0);
      if (i == s.victim) assert_int_equal(g.m[i].rc[0], SP_ECANCELED);
      double late = g.m[i].t[0] - s.abort_at;
      if (late > 2.0)
        fail_msg(
            "round %d (victim %u, abort after %u us): rank %u ended "
            "%.3f s after the abort: %s; others: [%s] [%s] [%s]",
            round, s.victim, s.delay_us, i, late, g.m[i].diag[0].msg,
            g.m[0].diag[0].msg, g.m[1].diag[0].msg, g.m[2].diag[0].msg);
    }
    group_done(&g);
  }
}

/* A member aborted in the middle of receiving a large broadcast: the root
 * is then blocked on a send that is half written. Gloo does not tell a
 * waiting send that its connection died; the watchdog must, well before the
 * 20 s timeout. */
static void *bcast_aborter(void *p) {
  member *m = p;
  sp_test_sleep_ms(2);
  sp_comm_abort(m->c);
  return NULL;
}

static void big_bcast_member(member *m) {
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s", m->new_diag.msg);
  sp_diag d = {{0}};
  MCHECK_RC(m, sp_comm_barrier(m->c, &d), d);
  size_t n = (size_t)64 << 20;
  unsigned char *buf = malloc(n);
  MCHECK(m, buf != NULL, "out of memory");
  memset(buf, (int)m->rank, n);
  pthread_t th;
  if (m->rank == 1 && pthread_create(&th, NULL, bcast_aborter, m) != 0) {
    free(buf);
    MCHECK(m, 0, "pthread_create");
  }
  double t0 = sp_clock_s();
  m->rc[0] = sp_comm_broadcast(m->c, buf, n, SP_UINT8, 0, &m->diag[0]);
  m->t[0] = sp_clock_s() - t0;
  if (m->rank == 1) pthread_join(th, NULL);
  free(buf);
}

static void test_abort_mid_transfer(void **state) {
  (void)state;
  group g;
  group_init(&g, 2, 20000, big_bcast_member, NULL);
  group_run(&g);
  print_message("mid-transfer: root %s after %.1f ms: %s\n",
                sp_err_name(g.m[0].rc[0]), g.m[0].t[0] * 1e3,
                g.m[0].diag[0].msg);
  assert_true(g.m[1].rc[0] == SP_ECANCELED || g.m[1].rc[0] == 0);
  /* Success is possible (the abort came after the last byte); a hang is
   * not. */
  assert_true(g.m[0].t[0] < 2.0);
  group_done(&g);
}

/* ---- a member that leaves --------------------------------------------------
 */

/* Members 0 and 1 all_gather; member 2 frees its communicator instead (the
 * closest a thread gets to a process dying: its sockets close). */
static void leave_member(member *m) {
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s", m->new_diag.msg);
  if (m->rank == 2) {
    sp_test_sleep_ms(200);
    atomic_store(&m->g->comms[2], NULL);
    sp_comm_free(m->c);
    m->c = NULL;
    return;
  }
  double buf[3 * 64];
  for (int i = 0; i < 64; i++) buf[m->rank * 64 + i] = m->rank + i;
  double t0 = sp_clock_s();
  m->rc[0] = sp_comm_all_gather(m->c, buf + m->rank * 64, buf, 64, SP_FLOAT64,
                                &m->diag[0]);
  m->t[0] = sp_clock_s() - t0;
}

static void test_peer_leaves(void **state) {
  (void)state;
  group g;
  group_init(&g, 3, 20000, leave_member, NULL);
  group_run(&g);
  for (uint32_t r = 0; r < 2; r++) {
    print_message("peer left: rank %u: %s after %.1f ms: %s\n", r,
                  sp_err_name(g.m[r].rc[0]), g.m[r].t[0] * 1e3,
                  g.m[r].diag[0].msg);
    assert_int_equal(g.m[r].rc[0], SP_EIO);
    assert_true(g.m[r].t[0] < 5.0);
    assert_non_null(strstr(g.m[r].diag[0].msg, "all_gather"));
  }
  group_done(&g);
}

/* A root whose broadcast only sends, to a member that has left: the send
 * must fail, not wait for the timeout. */
static void leave_root_member(member *m) {
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s", m->new_diag.msg);
  if (m->rank == 1) {
    sp_test_sleep_ms(300);
    atomic_store(&m->g->comms[1], NULL);
    sp_comm_free(m->c);
    m->c = NULL;
    return;
  }
  double buf[64] = {0};
  double t0 = sp_clock_s();
  m->rc[0] = sp_comm_broadcast(m->c, buf, 64, SP_FLOAT64, 0, &m->diag[0]);
  m->t[0] = sp_clock_s() - t0;
}

static void test_peer_leaves_root_sends(void **state) {
  (void)state;
  group g;
  group_init(&g, 2, 5000, leave_root_member, NULL);
  group_run(&g);
  print_message("root alone: %s after %.1f ms: %s\n", sp_err_name(g.m[0].rc[0]),
                g.m[0].t[0] * 1e3, g.m[0].diag[0].msg);
  assert_true(g.m[0].rc[0] < 0);
  assert_true(g.m[0].t[0] < 2.0);
  group_done(&g);
}

/* ---- a member that is a process, killed -----------------------------------
 */

/* The in-memory store does not cross fork(); this one keeps each key in a
 * file of a temporary directory (written to a temporary name, then renamed,
 * so a reader never sees half a value) and polls for it. */
typedef struct fstore {
  char dir[256];
} fstore;

static void fstore_path(const fstore *f, const char *key, char *out, size_t cap,
                        const char *suffix) {
  int n = snprintf(out, cap, "%s/", f->dir);
  for (const char *k = key; *k != '\0' && n > 0 && (size_t)n + 1 < cap; k++)
    out[n++] = *k == '/' ? '_' : *k;
  out[n] = '\0';
  strncat(out, suffix, cap - strlen(out) - 1);
}

static int fstore_set(void *user, const char *key, const void *val, size_t len,
                      sp_diag *d) {
  char tmp[512], path[512];
  fstore_path(user, key, tmp, sizeof tmp, ".tmp");
  fstore_path(user, key, path, sizeof path, "");
  FILE *fp = fopen(tmp, "wb");
  if (fp == NULL) return sp_diag_set(d, SP_EIO, "cannot write %s", tmp);
  size_t w = fwrite(val, 1, len, fp);
  if (fclose(fp) != 0 || w != len || rename(tmp, path) != 0)
    return sp_diag_set(d, SP_EIO, "cannot write %s", path);
  return 0;
}

static int fstore_get(void *user, const char *key, uint64_t wait_ms,
                      uint8_t **val, size_t *len, sp_diag *d) {
  char path[512];
  fstore_path(user, key, path, sizeof path, "");
  double until = sp_clock_s() + (double)wait_ms / 1e3;
  for (;;) {
    FILE *fp = fopen(path, "rb");
    if (fp != NULL) {
      uint8_t *buf = malloc(4096);
      size_t n = buf != NULL ? fread(buf, 1, 4096, fp) : 0;
      fclose(fp);
      if (buf == NULL) return SP_ENOMEM;
      *val = buf;
      *len = n;
      return 0;
    }
    if (sp_clock_s() >= until)
      return sp_diag_set(d, wait_ms ? SP_ETIMEDOUT : SP_ENOENT, "no key %s",
                         key);
    sp_test_sleep_ms(2);
  }
}

static sp_comm_opts fstore_opts(fstore *f, uint32_t rank) {
  sp_comm_opts o = {.backend = SP_BACKEND_GLOO,
                    .store = {.set = fstore_set, .get = fstore_get, .user = f},
                    .prefix = "proc",
                    .rank = rank,
                    .size = 2,
                    .timeout_ms = 20000};
  return o;
}

typedef struct killer_arg {
  pid_t pid;
  double at;
} killer_arg;

static void *killer(void *p) {
  killer_arg *k = p;
  sp_test_sleep_ms(300);
  k->at = sp_clock_s();
  kill(k->pid, SIGKILL);
  return NULL;
}

/* Member 1 is a child process; after a barrier the parent enters an
 * all_reduce the child never joins, and the child is killed: the parent's
 * operation fails at once (the kernel closes the child's sockets), not at
 * its 20 s timeout. */
static void test_peer_process_killed(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  fstore f;
  snprintf(f.dir, sizeof f.dir, "%s", dir);
  fflush(NULL);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    /* Only async-safe-ish work and _exit here: this is a copy of the test
     * process, cmocka included. */
    sp_comm *c = NULL;
    sp_comm_opts o = fstore_opts(&f, 1);
    if (sp_comm_new(&o, &c, NULL) != 0 || sp_comm_barrier(c, NULL) != 0)
      _exit(3);
    for (;;) pause();
  }
  sp_comm *c = NULL;
  sp_diag d = {{0}};
  sp_comm_opts o = fstore_opts(&f, 0);
  int rc = sp_comm_new(&o, &c, &d);
  if (rc == 0) rc = sp_comm_barrier(c, &d);
  if (rc != 0) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    fail_msg("parent: %s: %s", sp_err_name(rc), d.msg);
  }
  killer_arg k = {.pid = pid, .at = 0};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, killer, &k), 0);
  double v[100] = {0};
  rc = sp_comm_all_reduce(c, v, 100, SP_FLOAT64, &d);
  double t = sp_clock_s();
  pthread_join(th, NULL);
  int status = 0;
  waitpid(pid, &status, 0);
  print_message("child killed: parent's all_reduce %s %.1f ms later: %s\n",
                sp_err_name(rc), (t - k.at) * 1e3, d.msg);
  assert_int_equal(rc, SP_EIO);
  assert_true(t - k.at < 2.0);
  assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  /* Broken for good, and freeing it is fine. */
  assert_int_equal(sp_comm_barrier(c, &d), SP_EIO);
  sp_comm_free(c);
  sp_test_rmtree(dir);
  free(dir);
}

/* ---- timeouts
 * ---------------------------------------------------------------- */

static void new_only_member(member *m) {
  m->rc[0] = m->new_rc;
  m->diag[0] = m->new_diag;
}

/* Three members expected, two come: both time out naming the missing one. */
static void test_rendezvous_timeout(void **state) {
  (void)state;
  group g;
  group_init(&g, 3, 400, new_only_member, NULL);
  const uint32_t ranks[2] = {0, 1};
  double t0 = sp_clock_s();
  group_run_ranks(&g, ranks, 2);
  double dt = sp_clock_s() - t0;
  for (uint32_t r = 0; r < 2; r++) {
    print_message("rendezvous: %s\n", g.m[r].diag[0].msg);
    assert_int_equal(g.m[r].rc[0], SP_ETIMEDOUT);
    assert_null(g.m[r].c);
    assert_non_null(strstr(g.m[r].diag[0].msg, g.prefix));
    assert_non_null(strstr(g.m[r].diag[0].msg, "rank 2"));
  }
  assert_true(dt < 3.0);
  group_done(&g);
}

/* A store that fails: its code and message come through. */
static void test_rendezvous_store_error(void **state) {
  (void)state;
  group g;
  group_init(&g, 2, 2000, new_only_member, NULL);
  g.store.fail_set = SP_EIO;
  group_run(&g);
  for (uint32_t r = 0; r < 2; r++) {
    assert_int_equal(g.m[r].rc[0], SP_EIO);
    assert_non_null(strstr(g.m[r].diag[0].msg, "test store refuses set"));
  }
  group_done(&g);
}

/* The rendezvous record a member publishes ("<prefix>/<rank>"): for each
 * peer, Gloo's address of the socket it listens on (a sockaddr_storage,
 * then a 64-bit sequence number). Only the socket address's own bytes, for
 * its family, may be non-zero: never what was in memory before. */
#define REC_W 3
#define REC_ENTRY (sizeof(struct sockaddr_storage) + sizeof(int64_t))

/* Leaves `pattern` on this thread's stack and in freed heap blocks, where
 * memory the rendezvous does not initialise would pick it up. */
static __attribute__((noinline)) void dirty_memory(uint8_t pattern) {
  volatile uint8_t stack[64 << 10];
  for (size_t i = 0; i < sizeof stack; i++) stack[i] = pattern;
  void *blocks[64];
  for (int i = 0; i < 64; i++) {
    size_t n = (size_t)16 << (i % 10);
    blocks[i] = malloc(n);
    if (blocks[i] != NULL) memset(blocks[i], pattern, n);
  }
  for (int i = 0; i < 64; i++) free(blocks[i]);
}

static void dirty_member(member *m) { dirty_memory(*(uint8_t *)m->g->arg); }

static void joined_member(member *m) {
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s", m->new_diag.msg);
}

/* One rendezvous of REC_W members after dirtying memory with `pattern`:
 * the record each published, as the store holds it (malloc'd). */
static void rendezvous_records(uint8_t pattern, uint8_t **rec, size_t *len) {
  group g;
  group_init(&g, REC_W, 20000, joined_member, &pattern);
  g.before = dirty_member;
  dirty_memory(pattern);
  group_run(&g);
  for (uint32_t r = 0; r < REC_W; r++) {
    char key[96];
    snprintf(key, sizeof key, "%s/%u", g.prefix, r);
    sp_diag d = {{0}};
    if (sp_mstore_get(&g.store, key, 0, &rec[r], &len[r], &d) != 0)
      fail_msg("%s: %s", key, d.msg);
  }
  group_done(&g);
}

/* Fails unless every byte of rank r's record past each socket address's
 * length is zero; returns the offset of each entry's port. */
static void check_record(const uint8_t *rec, size_t len, uint32_t r,
                         const char *run, size_t port_off[REC_W - 1]) {
  if (len != (REC_W - 1) * REC_ENTRY)
    fail_msg("%s run: rank %u's record has %zu bytes, expected %zu", run, r,
             len, (size_t)((REC_W - 1) * REC_ENTRY));
  for (size_t e = 0; e < REC_W - 1; e++) {
    const uint8_t *p = rec + e * REC_ENTRY;
    struct sockaddr_storage ss;
    memcpy(&ss, p, sizeof ss);
    size_t used = sizeof ss;
    if (ss.ss_family == AF_INET) {
      used = sizeof(struct sockaddr_in);
      port_off[e] = offsetof(struct sockaddr_in, sin_port);
    } else if (ss.ss_family == AF_INET6) {
      used = sizeof(struct sockaddr_in6);
      port_off[e] = offsetof(struct sockaddr_in6, sin6_port);
    } else {
      fail_msg("%s run: rank %u, entry %zu: address family %d", run, r, e,
               (int)ss.ss_family);
    }
    for (size_t i = used; i < sizeof ss; i++)
      if (p[i] != 0)
        fail_msg(
            "%s run: rank %u, entry %zu: byte %zu of the socket address "
            "(past its %zu bytes) is 0x%02x, not 0",
            run, r, e, i, used, p[i]);
  }
}

/* Two rendezvous, memory dirtied differently before each: the records are
 * byte-identical once the listening ports (the kernel's pick) are made the
 * same, and carry nothing past the socket addresses. */
static void test_rendezvous_record_clean(void **state) {
  (void)state;
  uint8_t *a[REC_W], *b[REC_W];
  size_t la[REC_W], lb[REC_W];
  rendezvous_records(0x5a, a, la);
  rendezvous_records(0xa5, b, lb);
  for (uint32_t r = 0; r < REC_W; r++) {
    size_t pa[REC_W - 1], pb[REC_W - 1];
    check_record(a[r], la[r], r, "first", pa);
    check_record(b[r], lb[r], r, "second", pb);
    for (size_t e = 0; e < REC_W - 1; e++) {
      assert_int_equal(pa[e], pb[e]);
      memcpy(b[r] + e * REC_ENTRY + pb[e], a[r] + e * REC_ENTRY + pa[e], 2);
    }
    for (size_t i = 0; i < la[r]; i++)
      if (a[r][i] != b[r][i])
        fail_msg("rank %u's records differ at byte %zu: 0x%02x, then 0x%02x", r,
                 i, a[r][i], b[r][i]);
    free(a[r]);
    free(b[r]);
  }
}

/* Member 1 never calls the all_reduce member 0 is in: member 0 times out
 * and its communicator is broken afterwards. */
static void op_timeout_member(member *m) {
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s", m->new_diag.msg);
  if (m->rank == 0) {
    int64_t v[3] = {1, 2, 3};
    double t0 = sp_clock_s();
    m->rc[0] = sp_comm_all_reduce(m->c, v, 3, SP_INT64, &m->diag[0]);
    m->t[0] = sp_clock_s() - t0;
    t0 = sp_clock_s();
    m->rc[1] = sp_comm_all_reduce(m->c, v, 3, SP_INT64, &m->diag[1]);
    m->t[1] = sp_clock_s() - t0;
  }
}

static void test_op_timeout(void **state) {
  (void)state;
  group g;
  group_init(&g, 2, 300, op_timeout_member, NULL);
  group_run(&g);
  member *m0 = &g.m[0];
  print_message("op timeout after %.0f ms: %s\n", m0->t[0] * 1e3,
                m0->diag[0].msg);
  assert_int_equal(m0->rc[0], SP_ETIMEDOUT);
  assert_true(m0->t[0] >= 0.25 && m0->t[0] < 2.0);
  assert_non_null(strstr(m0->diag[0].msg, "all_reduce(int64, count 3)"));
  /* Gloo says whose data never came: the member that did not take part */
  assert_non_null(strstr(m0->diag[0].msg,
                         "member 1 of this 2-member "
                         "communicator (this rank is "
                         "member 0) did not take part"));
  assert_int_equal(m0->rc[1], SP_ETIMEDOUT);
  assert_true(m0->t[1] < 0.05);
  assert_non_null(strstr(m0->diag[1].msg, "earlier failure"));
  group_done(&g);
}

/* Members that disagree on the count neither crash nor mix their data: they
 * time out. */
static void mismatch_member(member *m) {
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s", m->new_diag.msg);
  float v[11] = {0};
  m->rc[0] = sp_comm_all_reduce(m->c, v, 10 + m->rank, SP_FLOAT32, &m->diag[0]);
}

static void test_mismatched_count(void **state) {
  (void)state;
  group g;
  group_init(&g, 2, 300, mismatch_member, NULL);
  group_run(&g);
  for (uint32_t r = 0; r < 2; r++)
    assert_true(g.m[r].rc[0] == SP_ETIMEDOUT || g.m[r].rc[0] == SP_EIO);
  assert_true(g.m[0].rc[0] == SP_ETIMEDOUT || g.m[1].rc[0] == SP_ETIMEDOUT);
  group_done(&g);
}

/* ---- arguments
 * ---------------------------------------------------------------- */

static void test_bad_arguments(void **state) {
  (void)state;
  sp_comm *c = (sp_comm *)&c;
  sp_diag d = {{0}};
  sp_mstore st;
  sp_mstore_init(&st);
  sp_comm_opts o = {.backend = SP_BACKEND_GLOO,
                    .store = sp_mstore_comm_store(&st),
                    .prefix = "bad",
                    .rank = 0,
                    .size = 1};
  assert_int_equal(sp_comm_new(NULL, &c, &d), SP_EINVAL);
  assert_null(c);
  assert_int_equal(sp_comm_new(&o, NULL, &d), SP_EINVAL);
  o.size = 0;
  assert_int_equal(sp_comm_new(&o, &c, &d), SP_EINVAL);
  o.size = 2;
  o.rank = 2;
  assert_int_equal(sp_comm_new(&o, &c, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "rank 2"));
  o.rank = 0;
  o.backend = SP_BACKEND_NCCL;
#if SHARDPLANE_HAVE_NCCL
  /* built in: refused for the missing opts.device "cuda:N", before any
   * store access (tests/test_comm_nccl.c has the rest) */
  assert_int_equal(sp_comm_new(&o, &c, &d), SP_EINVAL);
#else
  assert_int_equal(sp_comm_new(&o, &c, &d), SP_EUNSUPPORTED);
#endif
  o.backend = (sp_backend)77;
  assert_int_equal(sp_comm_new(&o, &c, &d), SP_EINVAL);
  o.backend = SP_BACKEND_GLOO;
  o.prefix = "";
  assert_int_equal(sp_comm_new(&o, &c, &d), SP_EINVAL);
  o.prefix = "bad";
  o.store.get = NULL;
  assert_int_equal(sp_comm_new(&o, &c, &d), SP_EINVAL);
  o.store.get = sp_mstore_get;
  assert_int_equal(st.sets, 0); /* nothing reached the store */

  /* Operations on a single member: the checks come before any transfer. */
  o.size = 1;
  assert_int_equal(sp_comm_new(&o, &c, &d), 0);
  float f[4] = {1, 2, 3, 4};
  uint8_t u8[4] = {1, 2, 3, 4};
  assert_int_equal(sp_comm_all_reduce(NULL, f, 4, SP_FLOAT32, &d), SP_EINVAL);
  assert_int_equal(sp_comm_barrier(NULL, &d), SP_EINVAL);
  assert_int_equal(sp_comm_rank(NULL), 0);
  assert_int_equal(sp_comm_size(NULL), 0);
  assert_int_equal(sp_comm_all_reduce(c, f, 4, SP_DTYPE_INVALID, &d),
                   SP_EINVAL);
  assert_int_equal(sp_comm_all_reduce(c, f, 4, (sp_dtype)99, &d), SP_EINVAL);
  assert_int_equal(sp_comm_all_reduce(c, u8, 4, SP_UINT8, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "uint8"));
  assert_non_null(strstr(d.msg, "'bad'"));
  assert_int_equal(sp_comm_all_reduce(c, u8, 4, SP_BOOL, &d), SP_EINVAL);
  assert_int_equal(sp_comm_reduce_scatter(c, u8, u8, 4, SP_BOOL, &d),
                   SP_EINVAL);
  assert_int_equal(sp_comm_reduce_scatter(c, u8, u8, 2, SP_INT16, &d),
                   SP_EINVAL);
  /* Non-summable dtypes move fine. */
  uint8_t g8[4];
  assert_int_equal(sp_comm_all_gather(c, u8, g8, 4, SP_BOOL, &d), 0);
  assert_memory_equal(g8, u8, 4);
  assert_int_equal(sp_comm_broadcast(c, u8, 4, SP_UINT8, 0, &d), 0);
  /* Sizes that overflow size_t, before anything is touched. */
  assert_int_equal(sp_comm_all_reduce(c, f, SIZE_MAX / 2, SP_FLOAT32, &d),
                   SP_EINVAL);
  assert_non_null(strstr(d.msg, "overflow"));
  assert_int_equal(
      sp_comm_all_gather(c, f, f, SIZE_MAX / 8 + 1, SP_FLOAT64, &d), SP_EINVAL);
  assert_int_equal(sp_comm_broadcast(c, f, SIZE_MAX / 4 + 1, SP_INT32, 0, &d),
                   SP_EINVAL);
  /* NULL buffers with a count, roots out of range. */
  assert_int_equal(sp_comm_all_reduce(c, NULL, 4, SP_FLOAT32, &d), SP_EINVAL);
  assert_int_equal(sp_comm_all_gather(c, f, NULL, 4, SP_FLOAT32, &d),
                   SP_EINVAL);
  assert_int_equal(sp_comm_reduce_scatter(c, NULL, f, 4, SP_FLOAT32, &d),
                   SP_EINVAL);
  assert_int_equal(sp_comm_broadcast(c, f, 4, SP_FLOAT32, 1, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "root 1"));
  /* Count 0 needs no buffers and does nothing. */
  assert_int_equal(sp_comm_all_reduce(c, NULL, 0, SP_FLOAT32, &d), 0);
  assert_int_equal(sp_comm_all_gather(c, NULL, NULL, 0, SP_FLOAT32, &d), 0);
  assert_int_equal(sp_comm_reduce_scatter(c, NULL, NULL, 0, SP_BFLOAT16, &d),
                   0);
  assert_int_equal(sp_comm_broadcast(c, NULL, 0, SP_INT64, 0, &d), 0);
  /* None of that broke the communicator. */
  assert_int_equal(sp_comm_all_reduce(c, f, 4, SP_FLOAT32, &d), 0);
  assert_int_equal(sp_comm_barrier(c, &d), 0);
  sp_comm_free(c);
  sp_mstore_destroy(&st);
}

/* Two communicators on the same members, used alternately, and a size-1
 * communicator without a store: independent namespaces, no crosstalk. */
static void two_comms_member(member *m) {
  MCHECK(m, m->new_rc == 0, "sp_comm_new: %s", m->new_diag.msg);
  sp_diag d = {{0}};
  sp_comm *c2 = NULL;
  char prefix[80];
  snprintf(prefix, sizeof prefix, "%s/second", m->g->prefix);
  sp_comm_opts o = {.backend = SP_BACKEND_GLOO,
                    .store = sp_mstore_comm_store(&m->g->store),
                    .prefix = prefix,
                    /* reversed ranks: a different group order */
                    .rank = m->g->size - 1 - m->rank,
                    .size = m->g->size,
                    .timeout_ms = 20000};
  MCHECK_RC(m, sp_comm_new(&o, &c2, &d), d);
  for (int i = 0; i < 20; i++) {
    int64_t a = (int64_t)m->rank + i, b = (int64_t)m->rank * 10 + i;
    int rc = sp_comm_all_reduce(m->c, &a, 1, SP_INT64, &d);
    if (rc == 0) rc = sp_comm_all_reduce(c2, &b, 1, SP_INT64, &d);
    if (rc != 0) {
      sp_comm_free(c2);
      MCHECK(m, 0, "all_reduce: %s: %s", sp_err_name(rc), d.msg);
    }
    int64_t w = m->g->size, s = w * (w - 1) / 2;
    if (a != s + w * i || b != 10 * s + w * i) {
      sp_comm_free(c2);
      MCHECK(m, 0, "iteration %d: %lld %lld", i, (long long)a, (long long)b);
    }
  }
  int rc = sp_comm_barrier(c2, &d);
  sp_comm_free(c2);
  MCHECK(m, rc == 0, "barrier: %s", d.msg);
}

static void test_two_communicators(void **state) {
  (void)state;
  group g;
  group_init(&g, 3, 20000, two_comms_member, NULL);
  group_run(&g);
  group_done(&g);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bad_arguments),
      cmocka_unit_test(test_sum_blocks_aliasing),
      cmocka_unit_test(test_all_ops_w1),
      cmocka_unit_test(test_all_ops_w2),
      cmocka_unit_test(test_all_ops_w3),
      cmocka_unit_test(test_all_ops_w4),
      cmocka_unit_test(test_reductions_in_rounds),
      cmocka_unit_test(test_sum_order_and_rounding),
      cmocka_unit_test(test_two_communicators),
      cmocka_unit_test(test_abort_before_and_single),
      cmocka_unit_test(test_abort_unblocks),
      cmocka_unit_test(test_abort_before_first_op),
      cmocka_unit_test(test_abort_storm),
      cmocka_unit_test(test_abort_mid_transfer),
      cmocka_unit_test(test_peer_leaves),
      cmocka_unit_test(test_peer_leaves_root_sends),
      cmocka_unit_test(test_peer_process_killed),
      cmocka_unit_test(test_rendezvous_timeout),
      cmocka_unit_test(test_rendezvous_store_error),
      cmocka_unit_test(test_rendezvous_record_clean),
      cmocka_unit_test(test_op_timeout),
      cmocka_unit_test(test_mismatched_count),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
