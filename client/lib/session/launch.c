/* Where a worker is: the identity a launcher hands it through the
 * environment, and the address its peers reach it at. */
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/flag.h"
#include "rpc/rpc.h"
#include "lib/shardplane.h"

/* The first of names that is set and not empty; its value in *val. */
static const char *first_set(const char *const *names, size_t n,
                             const char **val) {
  for (size_t i = 0; i < n; i++) {
    const char *v = getenv(names[i]);
    if (v != NULL && v[0] != '\0') {
      *val = v;
      return names[i];
    }
  }
  *val = NULL;
  return NULL;
}

/* One number from the first variable of names that is set: -1 when none
 * is; an error naming the variable when its value is not in [min, max]. */
static int read_var(const char *const *names, size_t n, long long min,
                    long long max, long *out, const char **from, sp_diag *d) {
  const char *val;
  const char *name = first_set(names, n, &val);
  *out = -1;
  *from = name;
  if (name == NULL) return 0;
  char flag[64] = "$";
  strncat(flag, name, sizeof flag - 2);
  long long x;
  int rc = sp_flag_int(flag, val, min, max, &x, d);
  if (rc != 0) return rc;
  *out = (long)x;
  return 0;
}

int sp_launch_env_read(sp_launch_env *e, sp_diag *d) {
  if (e == NULL) return sp_diag_set(d, SP_EINVAL, "sp_launch_env_read: NULL");
  memset(e, 0, sizeof *e);
  /* torchrun's names first, then Slurm's (srun sets them for every task) */
  static const char *const rank[] = {"RANK", "SLURM_PROCID"};
  static const char *const local[] = {"LOCAL_RANK", "SLURM_LOCALID"};
  static const char *const world[] = {"WORLD_SIZE", "SLURM_NTASKS"};
  static const char *const local_world[] = {"LOCAL_WORLD_SIZE"};
  int rc =
      read_var(rank, 2, 0, SP_JOB_MAX_WORLD - 1, &e->rank, &e->rank_var, d);
  if (rc == 0)
    rc = read_var(local, 2, 0, SP_JOB_MAX_WORLD - 1, &e->local_rank,
                  &e->local_rank_var, d);
  if (rc == 0)
    rc = read_var(world, 2, 1, SP_JOB_MAX_WORLD, &e->world_size,
                  &e->world_size_var, d);
  if (rc == 0)
    rc = read_var(local_world, 1, 1, SP_JOB_MAX_WORLD, &e->local_world_size,
                  &e->local_world_size_var, d);
  if (rc != 0) return rc;
  if (e->rank >= 0 && e->world_size > 0 && e->rank >= e->world_size)
    return sp_diag_set(d, SP_EINVAL, "$%s=%ld is not below $%s=%ld",
                       e->rank_var, e->rank, e->world_size_var, e->world_size);
  const char *coord = getenv(SP_COORDINATOR_ENV);
  e->coordinator = coord != NULL && coord[0] != '\0' ? coord : NULL;
  const char *grace = getenv(SP_COORDINATOR_GRACE_ENV);
  if (grace != NULL && grace[0] != '\0')
    return sp_coordinator_grace_parse("$" SP_COORDINATOR_GRACE_ENV, grace,
                                      &e->coordinator_grace_ms, d);
  return 0;
}

int sp_coordinator_grace_parse(const char *what, const char *value,
                               uint64_t *ms, sp_diag *d) {
  double sec;
  int rc = sp_flag_number(what, value, 0.001, &sec, d);
  if (rc == 0 && sec > 604800.0)
    rc = sp_flag_fail(d, what, value, "seconds in [0.001, 604800]");
  if (rc != 0) return rc;
  *ms = (uint64_t)(sec * 1000.0 + 0.5);
  return 0;
}

int sp_local_addr_toward(const char *addr, char *out, size_t cap, sp_diag *d) {
  if (addr == NULL || out == NULL || cap == 0)
    return sp_diag_set(d, SP_EINVAL, "sp_local_addr_toward: NULL");
  struct sockaddr_storage peer;
  int rc = sp_rpc_resolve(addr, &peer, d);
  if (rc != 0) return rc;
  /* Connecting a UDP socket sends nothing: the kernel only picks the route,
   * and with it the source address a TCP connection to addr would use. */
  int fd = socket(peer.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return sp_diag_set(d, SP_EIO, "socket: %s", strerror(errno));
  socklen_t plen = peer.ss_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                              : sizeof(struct sockaddr_in);
  struct sockaddr_storage self;
  socklen_t slen = sizeof self;
  if (connect(fd, (struct sockaddr *)&peer, plen) != 0 ||
      getsockname(fd, (struct sockaddr *)&self, &slen) != 0) {
    int e = errno;
    close(fd);
    return sp_diag_set(d, SP_EIO, "no route to %s: %s", addr, strerror(e));
  }
  close(fd);
  const void *ip =
      self.ss_family == AF_INET6
          ? (const void *)&((struct sockaddr_in6 *)&self)->sin6_addr
          : (const void *)&((struct sockaddr_in *)&self)->sin_addr;
  if (inet_ntop(self.ss_family, ip, out, (socklen_t)cap) == NULL)
    return sp_diag_set(d, SP_ETOOBIG, "address does not fit %zu bytes", cap);
  return 0;
}
