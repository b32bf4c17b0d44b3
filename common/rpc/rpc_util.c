#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/un.h>

#include "rpc_internal.h"
#include "rpc_wire.h"

int sp_rpc_resolve(const char *addr, struct sockaddr_storage *out,
                   sp_diag *diag) {
  char host[256];
  int port;
  if (addr != NULL && strncmp(addr, SP_RPC_UNIX_PREFIX, 5) == 0) {
    struct sockaddr_un *un = (struct sockaddr_un *)out;
    size_t n = strlen(addr + 5);
    if (n == 0 || n >= sizeof un->sun_path)
      return sp_diag_set(diag, SP_EINVAL,
                         "bad address \"%s\": a Unix socket path of 1 to "
                         "%zu bytes after unix:",
                         addr, sizeof un->sun_path - 1);
    memset(out, 0, sizeof *out);
    un->sun_family = AF_UNIX;
    memcpy(un->sun_path, addr + 5, n + 1);
    return 0;
  }
  if (sp_rpc_split_addr(addr, host, sizeof host, &port) != 0)
    return sp_diag_set(diag, SP_EINVAL,
                       "bad address \"%s\": expected host:port or [v6]:port",
                       addr ? addr : "(null)");
  memset(out, 0, sizeof *out);
  struct sockaddr_in *v4 = (struct sockaddr_in *)out;
  struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)out;
  if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons((uint16_t)port);
    return 0;
  }
  if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons((uint16_t)port);
    return 0;
  }
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
  int rc = getaddrinfo(host, NULL, &hints, &res);
  if (rc != 0 || res == NULL)
    return sp_diag_set(diag, SP_EINVAL, "cannot resolve \"%s\": %s", host,
                       gai_strerror(rc));
  memcpy(out, res->ai_addr, res->ai_addrlen);
  if (out->ss_family == AF_INET6)
    v6->sin6_port = htons((uint16_t)port);
  else
    v4->sin_port = htons((uint16_t)port);
  freeaddrinfo(res);
  return 0;
}

void sp_rpc_format_sockaddr(const struct sockaddr *sa, char *out, size_t cap) {
  char ip[INET6_ADDRSTRLEN] = "?";
  if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)sa;
    inet_ntop(AF_INET6, &v6->sin6_addr, ip, sizeof ip);
    snprintf(out, cap, "[%s]:%u", ip, ntohs(v6->sin6_port));
  } else {
    const struct sockaddr_in *v4 = (const struct sockaddr_in *)sa;
    inet_ntop(AF_INET, &v4->sin_addr, ip, sizeof ip);
    snprintf(out, cap, "%s:%u", ip, ntohs(v4->sin_port));
  }
}
