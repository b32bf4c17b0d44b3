/* Two hosts for tests: two network namespaces joined by a veth pair,
 * addresses 10.213.X.1 and 10.213.X.2 (X from the pid, so concurrent test
 * programs differ). Needs root and iproute2; a test that cannot have them
 * says skipped with the reason sp_tnet_up gives. */
#ifndef SP_NETNS_FIXTURE_H
#define SP_NETNS_FIXTURE_H

#include <stddef.h>

typedef struct sp_tnet {
  char ip[64];      /* the ip program */
  char ns[2][32];   /* the two hosts */
  char veth[2][16]; /* each host's end of the link */
  char addr[2][32]; /* each host's address */
} sp_tnet;

/* Makes the two hosts: 0, or -1 with the reason in why (nothing left
 * behind). n must be zeroed. */
int sp_tnet_up(sp_tnet *n, char *why, size_t cap);
/* Removes them (and with them their links); a no-op for what is not
 * there. */
void sp_tnet_down(sp_tnet *n);
/* Runs a shell command (printf format): its exit status, 128 for a
 * signal, -1 when it could not run. */
int sp_tnet_sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
