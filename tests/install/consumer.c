/* A program outside the tree that uses the installed libshardplane: it
 * opens a session as one rank, prints the plan it got, and closes.
 * Built by test_install against an installed prefix, with pkg-config and
 * with find_package(shardplane), shared and static. */
#include <shardplane/shardplane.h>

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: consumer HOST:PORT RANK\n");
    return 2;
  }
  sp_session_opts o = {.coordinator = argv[1],
                       .rank = (uint32_t)strtoul(argv[2], NULL, 10),
                       .connect_timeout_ms = 5000};
  sp_diag d = {{0}};
  sp_session *s = NULL;
  int rc = sp_session_open(&o, &s, &d);
  if (rc != 0) {
    fprintf(stderr, "consumer: open: %s: %s\n", sp_strerror(rc), d.msg);
    return 1;
  }
  const sp_plan *p = sp_session_plan(s);
  const char *last =
      sp_session_model(s)->modules[p->units[p->n_units - 1].module].fqn;
  printf(
      "shardplane %s cuda %d nccl %d: rank %u of %u, %zu units, plan %s, "
      "last unit %s (c = %lld)\n",
      SHARDPLANE_VERSION, SHARDPLANE_HAVE_CUDA, SHARDPLANE_HAVE_NCCL,
      sp_session_rank(s), sp_session_world(s), p->n_units, p->version_hex,
      last[0] ? last : "(root)",
      (long long)p->units[p->n_units - 1].shard_numel);
  rc = sp_session_close(s, 5000, &d);
  if (rc != 0) {
    fprintf(stderr, "consumer: close: %s: %s\n", sp_strerror(rc), d.msg);
    return 1;
  }
  return 0;
}
