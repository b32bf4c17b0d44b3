/* The HTTP listener: libmicrohttpd in its "external select" mode, with
 * epoll, driven by the coordinator's loop. MHD hands out one epoll fd that
 * becomes readable whenever any of its sockets has work; a uv_poll on it
 * runs MHD_run, and a uv_timer fires when MHD_get_timeout says a
 * connection's timeout comes due. No thread of MHD's own ever touches the
 * coordinator's state. */
#include "coord_http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "auth/token.h"
#include "base/json.h"
#include "coord_auth.h"
#include "coord_base.h"
#include "coordinator.h"

/* The session cookie: 32 random bytes, hex. */
#define COOKIE_NAME "shardplane_session"
#define SESSION_BYTES 32u
/* The most a POST body (/login, /logout: none expected) may carry. */
#define MAX_POST_BODY 4096u
/* The TLS certificate and key files, read whole. */
#define MAX_PEM (1u << 20)

typedef struct http_session {
  unsigned char id[SESSION_BYTES];
  uint64_t expires_ms;
} http_session;

typedef struct sp_coord_http sp_coord_http;
struct sp_coord_http {
  sp_coord *c;
  struct MHD_Daemon *d;
  const sp_coord_http_route *routes;
  size_t n_routes;
  uv_poll_t poll;
  uv_timer_t timer;
  int open_handles;
  void (*closed)(void *);
  bool tls;
  char *cert_pem, *key_pem;
  sp_coord_http_stats st;
  /* response bodies queued and not yet sent, against the coordinator's
   * max_buffered (the gRPC port's budget, counted apart) */
  size_t buffered, max_buffered;
  http_session *sessions;
  size_t n_sessions;
};

/* What one request carries between MHD's calls of the handler. */
typedef struct http_req {
  size_t body; /* POST bytes seen */
} http_req;

/* A queued body, freed by MHD once sent or dropped. */
typedef struct http_body {
  sp_coord_http *h;
  size_t len;
  char bytes[];
} http_body;

const char *sp_coord_http_arg(const sp_coord_http_query *q, const char *key) {
  if (q == NULL) return NULL;
  for (size_t i = 0; i < q->n && i < SP_COORD_HTTP_ARGS; i++)
    if (q->key[i] != NULL && strcmp(q->key[i], key) == 0)
      return q->value[i] != NULL ? q->value[i] : "";
  return NULL;
}

void sp_coord_http_get_stats(const sp_coord *c, sp_coord_http_stats *s) {
  memset(s, 0, sizeof *s);
  if (c->http != NULL) *s = c->http->st;
}

/* ---- the loop's side ---- */

static void schedule(sp_coord_http *h);

static void run_mhd(sp_coord_http *h) {
  MHD_run(h->d);
  schedule(h);
}

static void on_poll(uv_poll_t *p, int status, int events) {
  (void)status;
  (void)events;
  run_mhd(p->data);
}

static void on_timer(uv_timer_t *t) { run_mhd(t->data); }

/* The next timeout MHD asks for; none: the timer stops. */
static void schedule(sp_coord_http *h) {
  MHD_UNSIGNED_LONG_LONG ms;
  if (MHD_get_timeout(h->d, &ms) == MHD_YES)
    uv_timer_start(&h->timer, on_timer, ms, 0);
  else
    uv_timer_stop(&h->timer);
}

/* ---- answers ---- */

static void body_free(void *cls) {
  http_body *b = cls;
  b->h->buffered -= b->len;
  free(b);
}

static void add_common_headers(struct MHD_Response *r) {
  MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
  MHD_add_response_header(r, "Referrer-Policy", "no-referrer");
  MHD_add_response_header(r, "X-Frame-Options", "DENY");
  /* the page, its script and style are the coordinator's own: nothing
   * from elsewhere runs, and nothing inline */
  MHD_add_response_header(r, "Content-Security-Policy",
                          "default-src 'self'; img-src 'self' data:; "
                          "frame-ancestors 'none'; form-action 'self'");
}

/* Queues status with bytes (copied unless static) and optional extra
 * header; counts them against the budget. */
static enum MHD_Result answer(sp_coord_http *h, struct MHD_Connection *conn,
                              unsigned status, const char *ctype,
                              const char *bytes, size_t len, bool is_static,
                              const char *cache, const char *hname,
                              const char *hvalue) {
  struct MHD_Response *r;
  if (is_static) {
    r = MHD_create_response_from_buffer(len, (void *)bytes,
                                        MHD_RESPMEM_PERSISTENT);
  } else {
    if (h->max_buffered && h->buffered + len > h->max_buffered) {
      static const char busy[] = "over the listener's buffer budget\n";
      status = MHD_HTTP_SERVICE_UNAVAILABLE;
      ctype = "text/plain; charset=utf-8";
      bytes = busy;
      len = sizeof busy - 1;
      r = MHD_create_response_from_buffer(len, (void *)busy,
                                          MHD_RESPMEM_PERSISTENT);
    } else {
      http_body *b = malloc(sizeof *b + len);
      if (b == NULL) return MHD_NO; /* MHD closes the connection */
      b->h = h;
      b->len = len;
      memcpy(b->bytes, bytes, len);
      r = MHD_create_response_from_buffer_with_free_callback_cls(len, b->bytes,
                                                                 body_free, b);
      if (r == NULL) {
        free(b);
        return MHD_NO;
      }
      h->buffered += len;
    }
  }
  if (r == NULL) return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
  MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL,
                          cache ? cache : "no-store");
  add_common_headers(r);
  if (hname != NULL) MHD_add_response_header(r, hname, hvalue);
  if (status == MHD_HTTP_UNAUTHORIZED)
    MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE,
                            "Bearer realm=\"shardplane\"");
  if (status == MHD_HTTP_UNAUTHORIZED || status == MHD_HTTP_FORBIDDEN)
    h->st.unauthorized_total++;
  h->st.requests_total++;
  h->st.bytes_out += len;
  enum MHD_Result rc = MHD_queue_response(conn, status, r);
  MHD_destroy_response(r);
  return rc;
}

static enum MHD_Result answer_text(sp_coord_http *h,
                                   struct MHD_Connection *conn, unsigned status,
                                   const char *text) {
  return answer(h, conn, status, "text/plain; charset=utf-8", text,
                strlen(text), false, NULL, NULL, NULL);
}

/* ---- who is asking ---- */

/* The role of the request's bearer token; 0 without a valid one. */
static int header_role(sp_coord_http *h, struct MHD_Connection *conn) {
  const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                              MHD_HTTP_HEADER_AUTHORIZATION);
  if (v == NULL || strncasecmp(v, "Bearer ", 7) != 0) return 0;
  v += 7;
  while (*v == ' ') v++;
  const sp_rpc_principal *p =
      sp_coord_auth_lookup(h->c->auth, v, strnlen(v, 4096));
  return p ? p->role : 0;
}

static void hex(const unsigned char *b, size_t n, char *out) {
  static const char d[] = "0123456789abcdef";
  for (size_t i = 0; i < n; i++) {
    out[2 * i] = d[b[i] >> 4];
    out[2 * i + 1] = d[b[i] & 15];
  }
  out[2 * n] = '\0';
}

static int unhex(const char *s, unsigned char *out, size_t n) {
  if (strlen(s) != 2 * n) return -1;
  for (size_t i = 0; i < n; i++) {
    unsigned v = 0;
    for (int k = 0; k < 2; k++) {
      char ch = s[2 * i + k];
      v <<= 4;
      if (ch >= '0' && ch <= '9')
        v |= (unsigned)(ch - '0');
      else if (ch >= 'a' && ch <= 'f')
        v |= (unsigned)(ch - 'a' + 10);
      else
        return -1;
    }
    out[i] = (unsigned char)v;
  }
  return 0;
}

/* Drops the sessions that expired (the table stays small: at most
 * SP_COORD_HTTP_MAX_SESSIONS). */
static void sessions_sweep(sp_coord_http *h, uint64_t now) {
  size_t j = 0;
  for (size_t i = 0; i < h->n_sessions; i++)
    if (h->sessions[i].expires_ms > now) h->sessions[j++] = h->sessions[i];
  h->n_sessions = j;
}

/* The index of the request's live session, or -1. Every entry is
 * compared in constant time, so timing tells nothing of the ids. */
static long cookie_session(sp_coord_http *h, struct MHD_Connection *conn) {
  const char *v =
      MHD_lookup_connection_value(conn, MHD_COOKIE_KIND, COOKIE_NAME);
  unsigned char id[SESSION_BYTES];
  if (v == NULL || unhex(v, id, sizeof id) != 0) return -1;
  uint64_t now = sp_coord_base_now_ms(h->c);
  sessions_sweep(h, now);
  long found = -1;
  for (size_t i = 0; i < h->n_sessions; i++)
    if (CRYPTO_memcmp(h->sessions[i].id, id, sizeof id) == 0) found = (long)i;
  return found;
}

static bool may_read(int role) {
  return role == SP_ROLE_READER || role == SP_ROLE_ADMIN;
}

/* Whether the request may read a route of access a; *status the refusal
 * (401 without credentials, 403 with a token of another role). */
static bool allowed(sp_coord_http *h, struct MHD_Connection *conn,
                    sp_coord_http_access a, unsigned *status) {
  *status = MHD_HTTP_UNAUTHORIZED;
  if (a == SP_COORD_HTTP_OPEN || h->c->auth == NULL) return true;
  int role = header_role(h, conn);
  if (may_read(role)) return true;
  if (role != 0) {
    *status = MHD_HTTP_FORBIDDEN;
    return false;
  }
  return a != SP_COORD_HTTP_HEADER && cookie_session(h, conn) >= 0;
}

/* POST /login: a reader (or admin) token in the Authorization header buys
 * a session cookie for the dashboard. The header, not a form field: a
 * page elsewhere cannot make a browser send it (CORS), so no cross-site
 * login. */
static enum MHD_Result do_login(sp_coord_http *h, struct MHD_Connection *conn) {
  if (h->c->auth == NULL)
    return answer(h, conn, MHD_HTTP_NO_CONTENT, "text/plain", "", 0, true, NULL,
                  NULL, NULL);
  int role = header_role(h, conn);
  if (!may_read(role))
    return answer_text(h, conn,
                       role ? MHD_HTTP_FORBIDDEN : MHD_HTTP_UNAUTHORIZED,
                       role ? "this token's role may not read the job (a "
                              "reader or admin token is needed)\n"
                            : "a valid reader token is needed "
                              "(Authorization: Bearer TOKEN)\n");
  uint64_t now = sp_coord_base_now_ms(h->c);
  sessions_sweep(h, now);
  if (h->n_sessions == SP_COORD_HTTP_MAX_SESSIONS) {
    /* the oldest login goes: a flood of logins cannot grow the table */
    memmove(h->sessions, h->sessions + 1,
            (h->n_sessions - 1) * sizeof *h->sessions);
    h->n_sessions--;
  }
  http_session *s = &h->sessions[h->n_sessions];
  if (RAND_bytes(s->id, sizeof s->id) != 1)
    return answer_text(h, conn, MHD_HTTP_INTERNAL_SERVER_ERROR,
                       "no random bytes for a session\n");
  s->expires_ms = now + SP_COORD_HTTP_SESSION_S * 1000ull;
  h->n_sessions++;
  char idhex[2 * SESSION_BYTES + 1], cookie[256];
  hex(s->id, sizeof s->id, idhex);
  snprintf(cookie, sizeof cookie,
           COOKIE_NAME "=%s; Path=/; Max-Age=%u; HttpOnly; SameSite=Strict%s",
           idhex, SP_COORD_HTTP_SESSION_S, h->tls ? "; Secure" : "");
  return answer(h, conn, MHD_HTTP_NO_CONTENT, "text/plain", "", 0, true, NULL,
                MHD_HTTP_HEADER_SET_COOKIE, cookie);
}

static enum MHD_Result do_logout(sp_coord_http *h,
                                 struct MHD_Connection *conn) {
  long i = cookie_session(h, conn);
  if (i >= 0) {
    memmove(h->sessions + i, h->sessions + i + 1,
            (h->n_sessions - (size_t)i - 1) * sizeof *h->sessions);
    h->n_sessions--;
  }
  return answer(h, conn, MHD_HTTP_NO_CONTENT, "text/plain", "", 0, true, NULL,
                MHD_HTTP_HEADER_SET_COOKIE,
                COOKIE_NAME "=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict");
}

static enum MHD_Result collect_arg(void *cls, enum MHD_ValueKind kind,
                                   const char *key, const char *value) {
  (void)kind;
  sp_coord_http_query *q = cls;
  if (q->n == SP_COORD_HTTP_ARGS) return MHD_NO;
  q->key[q->n] = key;
  q->value[q->n] = value ? value : "";
  q->n++;
  return MHD_YES;
}

static const sp_coord_http_route *find_route(const sp_coord_http *h,
                                             const char *path) {
  for (size_t i = 0; i < h->n_routes; i++) {
    const sp_coord_http_route *r = &h->routes[i];
    if (r->prefix ? strncmp(path, r->path, strlen(r->path)) == 0
                  : strcmp(path, r->path) == 0)
      return r;
  }
  return NULL;
}

static enum MHD_Result do_get(sp_coord_http *h, struct MHD_Connection *conn,
                              const char *path) {
  /* open, for load balancers and probes: whether the loop answers */
  if (strcmp(path, "/healthz") == 0)
    return answer_text(
        h, conn,
        h->c->shutting_down ? MHD_HTTP_SERVICE_UNAVAILABLE : MHD_HTTP_OK,
        h->c->shutting_down ? "shutting down\n" : "ok\n");
  const sp_coord_http_route *rt = find_route(h, path);
  if (rt == NULL)
    return answer_text(h, conn, MHD_HTTP_NOT_FOUND, "not found\n");
  unsigned refusal;
  bool ok = allowed(h, conn, rt->access, &refusal);
  if (!ok && rt->access != SP_COORD_HTTP_PAGE)
    return answer_text(h, conn, refusal,
                       refusal == MHD_HTTP_FORBIDDEN
                           ? "this token's role may not read the job (a "
                             "reader or admin token is needed)\n"
                           : "a reader token is needed: Authorization: "
                             "Bearer TOKEN, or log in on the dashboard\n");
  sp_coord_http_query q = {.n = 0};
  MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, collect_arg, &q);
  sp_coord_http_resp r = {0};
  int rc = rt->fn(h->c, path, &q, &r);
  if (rc != 0) {
    if (!r.body_static) free(r.body);
    return answer_text(h, conn,
                       rc == SP_ENOMEM ? MHD_HTTP_SERVICE_UNAVAILABLE
                                       : MHD_HTTP_INTERNAL_SERVER_ERROR,
                       rc == SP_ENOMEM ? "out of memory\n"
                                       : "the coordinator could not answer\n");
  }
  unsigned status = r.status ? r.status : MHD_HTTP_OK;
  if (!ok) status = refusal; /* the page, asking for a login */
  enum MHD_Result res =
      answer(h, conn, status,
             r.content_type ? r.content_type : "application/octet-stream",
             r.body, r.len, r.body_static, r.cache_control, NULL, NULL);
  if (!r.body_static) free(r.body);
  return res;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn,
                                  const char *url, const char *method,
                                  const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls) {
  (void)version;
  (void)upload;
  sp_coord_http *h = cls;
  bool post = strcmp(method, MHD_HTTP_METHOD_POST) == 0;
  if (*con_cls == NULL) {
    /* headers in; for a POST, the body (if any) follows in later calls */
    http_req *rq = calloc(1, sizeof *rq);
    if (rq == NULL) return MHD_NO;
    *con_cls = rq;
    if (post) return MHD_YES;
  }
  http_req *rq = *con_cls;
  if (post && *upload_size > 0) {
    rq->body += *upload_size;
    *upload_size = 0; /* read and dropped: the token is in the header */
    if (rq->body > MAX_POST_BODY) return MHD_NO;
    return MHD_YES;
  }
  if (post) {
    if (strcmp(url, "/login") == 0) return do_login(h, conn);
    if (strcmp(url, "/logout") == 0) return do_logout(h, conn);
  }
  if (!post && (strcmp(method, MHD_HTTP_METHOD_GET) == 0 ||
                strcmp(method, MHD_HTTP_METHOD_HEAD) == 0))
    return do_get(h, conn, url);
  return answer(h, conn, MHD_HTTP_METHOD_NOT_ALLOWED,
                "text/plain; charset=utf-8",
                "method not allowed: GET or HEAD, and POST for /login and "
                "/logout\n",
                strlen("method not allowed: GET or HEAD, and POST for /login "
                       "and /logout\n"),
                true, NULL, MHD_HTTP_HEADER_ALLOW, "GET, HEAD, POST");
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
  (void)cls;
  (void)conn;
  (void)toe;
  free(*con_cls);
  *con_cls = NULL;
}

static void on_connection(void *cls, struct MHD_Connection *conn,
                          void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
  (void)conn;
  (void)socket_context;
  sp_coord_http *h = cls;
  if (toe == MHD_CONNECTION_NOTIFY_STARTED)
    h->st.connections_open++;
  else if (h->st.connections_open > 0)
    h->st.connections_open--;
}

static int hexval(char ch) {
  return ch >= '0' && ch <= '9'   ? ch - '0'
         : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
         : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10
                                  : -1;
}

/* Percent-decoding of paths and query values, in place, as MHD's own
 * except that %00 stays as it is: a NUL would cut the path short
 * ("/%00/etc/passwd" would be "/") and a value a route reads. */
static size_t unescape(void *cls, struct MHD_Connection *conn, char *s) {
  (void)cls;
  (void)conn;
  char *w = s;
  for (const char *r = s; *r;) {
    int hi, lo;
    if (r[0] == '%' && (hi = hexval(r[1])) >= 0 && (lo = hexval(r[2])) >= 0 &&
        (hi | lo) != 0) {
      *w++ = (char)(hi << 4 | lo);
      r += 3;
    } else {
      *w++ = *r++;
    }
  }
  *w = '\0';
  return (size_t)(w - s);
}

/* MHD's own complaints (malformed requests, limits) are the clients'
 * doing: kept out of the coordinator's log. */
static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
  (void)cls;
  (void)fmt;
  (void)ap;
}

/* ---- start and stop ---- */

/* A listening socket on addr; the bound port in *port. */
static int listen_socket(const char *addr, int *port, sp_diag *diag) {
  char host[256];
  int want;
  if (sp_rpc_split_addr(addr, host, sizeof host, &want) != 0)
    return sp_diag_set(diag, SP_EINVAL, "--http-listen %s: expected HOST:PORT",
                       addr);
  char pbuf[16];
  snprintf(pbuf, sizeof pbuf, "%d", want);
  struct addrinfo hints = {.ai_family = AF_UNSPEC,
                           .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
                  *ai;
  int g = getaddrinfo(host[0] ? host : NULL, pbuf, &hints, &ai);
  if (g != 0)
    return sp_diag_set(diag, SP_EIO, "--http-listen %s: %s", addr,
                       gai_strerror(g));
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1, err = 0;
  if (fd < 0 ||
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 512) != 0)
    err = errno;
  freeaddrinfo(ai);
  if (err != 0) {
    if (fd >= 0) close(fd);
    return sp_diag_set(diag, SP_EIO, "--http-listen %s: %s", addr,
                       strerror(err));
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(fd, (struct sockaddr *)&ss, &sl);
  *port =
      ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                     : ((struct sockaddr_in *)&ss)->sin_port);
  return fd;
}

static int read_pem(const char *path, char **out, sp_diag *diag) {
  size_t len;
  int rc = sp_json_read_file(path, MAX_PEM, out, &len, diag);
  if (rc != 0) return rc;
  char *p = realloc(*out, len + 1); /* MHD wants a C string */
  if (p == NULL) {
    free(*out);
    *out = NULL;
    return sp_diag_set(diag, SP_ENOMEM, "out of memory");
  }
  p[len] = '\0';
  *out = p;
  return 0;
}

int sp_coord_http_start(sp_coord *c, const char *addr,
                        const sp_coord_http_route *routes, size_t n_routes,
                        int *port, sp_diag *diag) {
  if (c->http != NULL)
    return sp_diag_set(diag, SP_ESTATE, "the HTTP listener is running");
  sp_coord_http *h = calloc(1, sizeof *h);
  if (h == NULL) return sp_diag_set(diag, SP_ENOMEM, "out of memory");
  h->c = c;
  h->routes = routes;
  h->n_routes = n_routes;
  h->max_buffered = c->cfg.max_buffered ? c->cfg.max_buffered : (256u << 20);
  h->sessions = calloc(SP_COORD_HTTP_MAX_SESSIONS, sizeof *h->sessions);
  c->http = h;
  if (h->sessions == NULL) return sp_diag_set(diag, SP_ENOMEM, "out of memory");
  unsigned flags = MHD_USE_EPOLL;
  if (c->cfg.tls != NULL) {
    if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES)
      return sp_diag_set(diag, SP_EIO,
                         "--http-listen: this libmicrohttpd has no TLS");
    int rc;
    if ((rc = read_pem(c->cfg.tls->cert_file, &h->cert_pem, diag)) != 0 ||
        (rc = read_pem(c->cfg.tls->key_file, &h->key_pem, diag)) != 0)
      return rc;
    flags |= MHD_USE_TLS;
    h->tls = true;
  }
  int fd = listen_socket(addr, port, diag);
  if (fd < 0) return fd;
  uint32_t max_conn = c->cfg.http_max_connections
                          ? c->cfg.http_max_connections
                          : SP_COORD_HTTP_MAX_CONNECTIONS;
  /* one timeout for both: MHD closes a connection idle (no bytes) this
   * long, whether between requests or in the middle of one */
  uint64_t to_ms = c->cfg.request_timeout_ms ? c->cfg.request_timeout_ms
                                             : SP_COORD_HTTP_TIMEOUT_S * 1000u;
  if (c->cfg.idle_timeout_ms && c->cfg.idle_timeout_ms < to_ms)
    to_ms = c->cfg.idle_timeout_ms;
  unsigned to_s = (unsigned)((to_ms + 999) / 1000);
  struct MHD_OptionItem opts[13];
  size_t n = 0;
  opts[n++] = (struct MHD_OptionItem){MHD_OPTION_LISTEN_SOCKET, fd, NULL};
  opts[n++] =
      (struct MHD_OptionItem){MHD_OPTION_CONNECTION_LIMIT, max_conn, NULL};
  /* one client address cannot take every slot (0: no per-address
   * limit when the whole limit is that small anyway) */
  opts[n++] =
      (struct MHD_OptionItem){MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                              max_conn > SP_COORD_HTTP_PER_IP_CONNECTIONS
                                  ? SP_COORD_HTTP_PER_IP_CONNECTIONS
                                  : 0,
                              NULL};
  opts[n++] =
      (struct MHD_OptionItem){MHD_OPTION_CONNECTION_TIMEOUT, to_s, NULL};
  opts[n++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_MEMORY_LIMIT,
                                      SP_COORD_HTTP_CONN_MEMORY, NULL};
  opts[n++] = (struct MHD_OptionItem){MHD_OPTION_NOTIFY_COMPLETED,
                                      (intptr_t)on_completed, NULL};
  opts[n++] = (struct MHD_OptionItem){MHD_OPTION_NOTIFY_CONNECTION,
                                      (intptr_t)on_connection, h};
  opts[n++] = (struct MHD_OptionItem){MHD_OPTION_UNESCAPE_CALLBACK,
                                      (intptr_t)unescape, NULL};
  opts[n++] = (struct MHD_OptionItem){MHD_OPTION_EXTERNAL_LOGGER,
                                      (intptr_t)on_mhd_log, NULL};
  if (h->tls) {
    opts[n++] =
        (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, h->cert_pem};
    opts[n++] =
        (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, h->key_pem};
  }
  opts[n++] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
  h->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, h, MHD_OPTION_ARRAY,
                          opts, MHD_OPTION_END);
  if (h->d == NULL) {
    close(fd);
    return sp_diag_set(
        diag, SP_EIO, "--http-listen %s: the HTTP server did not start%s", addr,
        h->tls ? " (is the TLS key or certificate valid?)" : "");
  }
  const union MHD_DaemonInfo *ep =
      MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_EPOLL_FD);
  if (ep == NULL || uv_poll_init(c->loop, &h->poll, ep->epoll_fd) != 0)
    return sp_diag_set(diag, SP_EIO, "--http-listen: no epoll descriptor");
  h->poll.data = h;
  h->open_handles++;
  uv_timer_init(c->loop, &h->timer);
  h->timer.data = h;
  h->open_handles++;
  uv_poll_start(&h->poll, UV_READABLE, on_poll);
  schedule(h);
  return 0;
}

static void handle_closed(uv_handle_t *hd) {
  sp_coord_http *h = hd->data;
  if (--h->open_handles == 0 && h->closed) h->closed(h->c);
}

void sp_coord_http_shutdown(sp_coord *c, void (*closed)(void *)) {
  sp_coord_http *h = c->http;
  if (h == NULL || h->open_handles == 0) {
    if (closed) closed(c);
    return;
  }
  h->closed = closed;
  /* MHD closes its sockets (listening and open) itself */
  if (h->d != NULL) {
    MHD_stop_daemon(h->d);
    h->d = NULL;
  }
  uv_close((uv_handle_t *)&h->poll, handle_closed);
  uv_close((uv_handle_t *)&h->timer, handle_closed);
}

void sp_coord_http_free(sp_coord *c) {
  sp_coord_http *h = c->http;
  if (h == NULL) return;
  if (h->d != NULL) MHD_stop_daemon(h->d);
  free(h->sessions);
  if (h->key_pem) OPENSSL_cleanse(h->key_pem, strlen(h->key_pem));
  free(h->key_pem);
  free(h->cert_pem);
  free(h);
  c->http = NULL;
}
