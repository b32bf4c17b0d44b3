/* Two hosts for tests: network namespaces joined by a veth pair
 * (netns_fixture.h). */
#include "netns_fixture.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

int sp_tnet_sh(const char *fmt, ...) {
  char cmd[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  int st = system(cmd);
  return st == -1 ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

void sp_tnet_down(sp_tnet *n) {
  for (int i = 0; i < 2; i++)
    if (n->ns[i][0]) sp_tnet_sh("%s netns del %s 2>/dev/null", n->ip, n->ns[i]);
}

int sp_tnet_up(sp_tnet *n, char *why, size_t cap) {
  const char *ips[] = {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"};
  for (size_t i = 0; i < 4 && !n->ip[0]; i++)
    if (access(ips[i], X_OK) == 0) snprintf(n->ip, sizeof n->ip, "%s", ips[i]);
  if (!n->ip[0]) return snprintf(why, cap, "no ip program (iproute2)"), -1;
  if (geteuid() != 0)
    return snprintf(why, cap, "network namespaces need root"), -1;
  unsigned id = (unsigned)getpid() % 200 + 20;
  for (int i = 0; i < 2; i++) {
    snprintf(n->ns[i], sizeof n->ns[i], "sp2h-%u-%c", (unsigned)getpid(),
             'a' + i);
    snprintf(n->veth[i], sizeof n->veth[i], "sp2h%u%c",
             (unsigned)getpid() % 100000, 'a' + i);
    snprintf(n->addr[i], sizeof n->addr[i], "10.213.%u.%d", id, i + 1);
  }
  if (sp_tnet_sh("%s netns add %s 2>/dev/null", n->ip, n->ns[0]) != 0) {
    n->ns[0][0] = n->ns[1][0] = '\0';
    return snprintf(why, cap,
                    "cannot make a network namespace (%s netns "
                    "add: not permitted in this container?)",
                    n->ip),
           -1;
  }
  int rc = sp_tnet_sh("%s netns add %s", n->ip, n->ns[1]);
  if (rc == 0)
    rc = sp_tnet_sh("%s link add %s netns %s type veth peer name %s netns %s",
                    n->ip, n->veth[0], n->ns[0], n->veth[1], n->ns[1]);
  for (int i = 0; rc == 0 && i < 2; i++)
    rc = sp_tnet_sh(
        "%s -n %s addr add %s/24 dev %s && %s -n %s link set %s "
        "up && %s -n %s link set lo up",
        n->ip, n->ns[i], n->addr[i], n->veth[i], n->ip, n->ns[i], n->veth[i],
        n->ip, n->ns[i]);
  if (rc != 0) {
    sp_tnet_down(n);
    return snprintf(why, cap, "cannot join the namespaces with a veth pair"),
           -1;
  }
  return 0;
}
