/* The coordinator's HTTP listener over real sockets: who may read what
 * (tokens by role, the dashboard's login cookie), TLS, methods and paths
 * it refuses, and hostile clients (malformed and oversized requests, slow
 * ones, thousands of idle connections) while the gRPC side keeps
 * answering and the loop does not pause. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "auth/token.h"
#include "base/clock.h"
#include "server/coord_http.h"
#include "support/auth_fixture.h"
#include "support/coord_fixture.h"
#include "support/test_certs.h"
#include "support/testutil.h"
#include "support/tmpdir.h"
#include "grpc/health/v1/health.pb-c.h"
#include "rpc/coord_service.h"
#include "rpc/rpc.h"

#define MODEL SP_EXAMPLES "/models/gpt2-tiny.json"

/* Sanitizers slow the loop several times over. */
#if defined(__SANITIZE_ADDRESS__)
#define PAUSE_BUDGET_MS 150u
#else
#define PAUSE_BUDGET_MS 50u
#endif

static const char *const k_flags[] = {"world-size", "2", NULL};

typedef struct http_fx {
  sp_tauth auth;
  sp_coord_fixture fx;
} http_fx;

static void start(http_fx *h, const sp_coord_config *extra) {
  sp_tauth_make(&h->auth);
  sp_coord_config cfg = {.model_path = MODEL,
                         .quiet = true,
                         .token_file = h->auth.token_file,
                         .http_listen = "127.0.0.1:0"};
  if (extra != NULL) {
    cfg.tls = extra->tls;
    cfg.request_timeout_ms = extra->request_timeout_ms;
    cfg.http_max_connections = extra->http_max_connections;
  }
  sp_coord_fixture_start_cfg(&h->fx, &cfg, k_flags);
  assert_true(h->fx.http_port > 0);
}

static void stop(http_fx *h) {
  sp_coord_fixture_stop(&h->fx);
  sp_tauth_free(&h->auth);
}

static int connect_to(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Reads until the peer closes or timeout_ms passes; bytes read. */
static size_t read_all(int fd, char *buf, size_t cap, int timeout_ms) {
  size_t n = 0;
  double end = sp_clock_s() + timeout_ms / 1000.0;
  while (n + 1 < cap) {
    int left = (int)((end - sp_clock_s()) * 1000);
    if (left <= 0) break;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, left) <= 0) break;
    ssize_t r = recv(fd, buf + n, cap - 1 - n, 0);
    if (r <= 0) break;
    n += (size_t)r;
  }
  buf[n] = '\0';
  return n;
}

typedef struct http_resp {
  int status; /* 0: no answer */
  char raw[1 << 20];
  const char *body;
} http_resp;

static void parse(http_resp *r) {
  r->status = 0;
  sscanf(r->raw, "HTTP/1.%*d %d", &r->status);
  const char *b = strstr(r->raw, "\r\n\r\n");
  r->body = b ? b + 4 : "";
}

/* One request (raw bytes, sent as given) on a fresh connection. */
static void raw_request(int port, const char *req, size_t len, http_resp *r) {
  int fd = connect_to(port);
  assert_true(fd >= 0);
  assert_int_equal(send(fd, req, len, MSG_NOSIGNAL), (ssize_t)len);
  read_all(fd, r->raw, sizeof r->raw, 10000);
  close(fd);
  parse(r);
}

/* method path with optional "Authorization: Bearer token" and cookie. */
static void request(int port, const char *method, const char *path,
                    const char *token, const char *cookie, http_resp *r) {
  char req[2048];
  int n = snprintf(req, sizeof req,
                   "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   "Connection: close\r\n%s%s%s%s%s%s%s\r\n",
                   method, path, token ? "Authorization: Bearer " : "",
                   token ? token : "", token ? "\r\n" : "",
                   cookie ? "Cookie: " : "", cookie ? cookie : "",
                   cookie ? "\r\n" : "",
                   strcmp(method, "POST") == 0 ? "Content-Length: 0\r\n" : "");
  raw_request(port, req, (size_t)n, r);
}

/* The value of header name (case-insensitive) into out; false if none. */
static bool header(const http_resp *r, const char *name, char *out,
                   size_t cap) {
  size_t nl = strlen(name);
  for (const char *p = strstr(r->raw, "\r\n"); p && p < r->body;
       p = strstr(p + 2, "\r\n")) {
    if (strncasecmp(p + 2, name, nl) == 0 && p[2 + nl] == ':') {
      const char *v = p + 3 + nl;
      while (*v == ' ') v++;
      size_t k = strcspn(v, "\r\n");
      snprintf(out, cap, "%.*s", (int)(k < cap ? k : cap - 1), v);
      return true;
    }
  }
  return false;
}

static http_resp g_r;

static void test_access_by_role(void **state) {
  (void)state;
  http_fx h;
  start(&h, NULL);
  int port = h.fx.http_port;
  const char *worker = h.auth.token[SP_ROLE_WORKER],
             *reader = h.auth.token[SP_ROLE_READER],
             *admin = h.auth.token[SP_ROLE_ADMIN];
  request(port, "GET", "/healthz", NULL, NULL, &g_r);
  assert_int_equal(g_r.status, 200);
  assert_string_equal(g_r.body, "ok\n");
  char v[256];
  request(port, "GET", "/metrics", NULL, NULL, &g_r);
  assert_int_equal(g_r.status, 401);
  assert_true(header(&g_r, "WWW-Authenticate", v, sizeof v));
  assert_non_null(strstr(v, "Bearer"));
  request(port, "GET", "/metrics", "not-a-token", NULL, &g_r);
  assert_int_equal(g_r.status, 401);
  request(port, "GET", "/metrics", worker, NULL, &g_r);
  assert_int_equal(g_r.status, 403);
  request(port, "GET", "/metrics", reader, NULL, &g_r);
  assert_int_equal(g_r.status, 200);
  assert_true(header(&g_r, "Content-Type", v, sizeof v));
  assert_non_null(strstr(v, "text/plain"));
  assert_non_null(strstr(g_r.body, "shardplane_job_world_size 2"));
  request(port, "GET", "/metrics", admin, NULL, &g_r);
  assert_int_equal(g_r.status, 200);
  request(port, "GET", "/api/v1/job", NULL, NULL, &g_r);
  assert_int_equal(g_r.status, 401);
  request(port, "GET", "/api/v1/job", reader, NULL, &g_r);
  assert_int_equal(g_r.status, 200);
  assert_non_null(strstr(g_r.body, "gpt2-tiny"));
  /* the page itself asks for a login, and holds none of the job's data */
  request(port, "GET", "/", NULL, NULL, &g_r);
  assert_int_equal(g_r.status, 401);
  assert_non_null(strstr(g_r.body, "id=\"login\""));
  assert_null(strstr(g_r.body, "gpt2-tiny"));
  /* its script and style are code, open like the page's form */
  request(port, "GET", "/app.js", NULL, NULL, &g_r);
  assert_int_equal(g_r.status, 200);
  assert_true(header(&g_r, "Content-Security-Policy", v, sizeof v));
  stop(&h);
}

/* "shardplane_session=HEX" out of a Set-Cookie header. */
static void cookie_of(const http_resp *r, char *out, size_t cap) {
  char v[512];
  assert_true(header(r, "Set-Cookie", v, sizeof v));
  assert_non_null(strstr(v, "HttpOnly"));
  assert_non_null(strstr(v, "SameSite=Strict"));
  snprintf(out, cap, "%.*s", (int)strcspn(v, ";"), v);
}

static void test_login_cookie(void **state) {
  (void)state;
  http_fx h;
  start(&h, NULL);
  int port = h.fx.http_port;
  const char *reader = h.auth.token[SP_ROLE_READER];
  request(port, "POST", "/login", NULL, NULL, &g_r);
  assert_int_equal(g_r.status, 401);
  request(port, "POST", "/login", h.auth.token[SP_ROLE_WORKER], NULL, &g_r);
  assert_int_equal(g_r.status, 403);
  request(port, "POST", "/login", reader, NULL, &g_r);
  assert_int_equal(g_r.status, 204);
  char cookie[256], v[512];
  cookie_of(&g_r, cookie, sizeof cookie);
  assert_true(header(&g_r, "Set-Cookie", v, sizeof v));
  assert_null(strstr(v, "Secure")); /* cleartext: a Secure cookie is lost */
  request(port, "GET", "/api/v1/job", NULL, cookie, &g_r);
  assert_int_equal(g_r.status, 200);
  request(port, "GET", "/", NULL, cookie, &g_r);
  assert_int_equal(g_r.status, 200);
  /* the cookie is the dashboard's: /metrics wants the header */
  request(port, "GET", "/metrics", NULL, cookie, &g_r);
  assert_int_equal(g_r.status, 401);
  /* a forged or altered session is nobody's */
  char forged[256];
  snprintf(forged, sizeof forged, "%s", cookie);
  char *last = forged + strlen(forged) - 1;
  *last = *last == '0' ? '1' : '0';
  request(port, "GET", "/api/v1/job", NULL, forged, &g_r);
  assert_int_equal(g_r.status, 401);
  request(port, "GET", "/api/v1/job", NULL, "shardplane_session=zz", &g_r);
  assert_int_equal(g_r.status, 401);
  request(port, "POST", "/logout", NULL, cookie, &g_r);
  assert_int_equal(g_r.status, 204);
  request(port, "GET", "/api/v1/job", NULL, cookie, &g_r);
  assert_int_equal(g_r.status, 401);
  stop(&h);
}

static void test_methods_and_paths(void **state) {
  (void)state;
  http_fx h;
  start(&h, NULL);
  int port = h.fx.http_port;
  const char *reader = h.auth.token[SP_ROLE_READER];
  request(port, "PUT", "/metrics", reader, NULL, &g_r);
  assert_int_equal(g_r.status, 405);
  request(port, "DELETE", "/", reader, NULL, &g_r);
  assert_int_equal(g_r.status, 405);
  request(port, "POST", "/metrics", reader, NULL, &g_r);
  assert_int_equal(g_r.status, 405);
  /* nothing is served from the file system: no path reaches a file */
  static const char *const paths[] = {"/../../../../etc/passwd",
                                      "/%2e%2e/%2e%2e/etc/passwd",
                                      "/api/v1/../../../etc/passwd",
                                      "/app.js/../../etc/passwd",
                                      "//etc/passwd",
                                      "/static/..%2f..%2fetc%2fpasswd",
                                      "/%00/etc/passwd"};
  for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
    request(port, "GET", paths[i], reader, NULL, &g_r);
    if (g_r.status != 404 && g_r.status != 400)
      fail_msg("%s: status %d", paths[i], g_r.status);
    assert_null(strstr(g_r.body, "root:"));
  }
  request(port, "HEAD", "/metrics", reader, NULL, &g_r);
  assert_int_equal(g_r.status, 200);
  assert_string_equal(g_r.body, "");
  stop(&h);
}

/* The loop's pauses as a timer every PROBE_MS sees them: how late it
 * fires. Finer than the coordinator's own measure (its heartbeat check
 * sees only the pauses that span its due time). */
#define PROBE_MS 5u
typedef struct probe {
  uv_timer_t t;
  uint64_t last_ms, max_late_ms;
  uint64_t seen; /* max_late_ms as copied on the loop thread */
} probe;

static void on_probe(uv_timer_t *t) {
  probe *p = t->data;
  uint64_t now = uv_now(t->loop);
  if (p->last_ms && now > p->last_ms + PROBE_MS &&
      now - p->last_ms - PROBE_MS > p->max_late_ms)
    p->max_late_ms = now - p->last_ms - PROBE_MS;
  p->last_ms = now;
}

static void probe_start(sp_coord *c, void *arg) {
  probe *p = arg;
  uv_timer_init(c->loop, &p->t);
  p->t.data = p;
  uv_timer_start(&p->t, on_probe, PROBE_MS, PROBE_MS);
}

static void probe_stop(sp_coord *c, void *arg) {
  (void)c;
  uv_close((uv_handle_t *)&((probe *)arg)->t, NULL);
}

static void probe_read(sp_coord *c, void *arg) {
  (void)c;
  probe *p = arg;
  p->seen = p->max_late_ms;
}

/* The longest pause the probe saw so far, ms. */
static uint64_t loop_pause(http_fx *h, probe *p) {
  sp_coord_fixture_run(&h->fx, probe_read, p);
  return p->seen;
}

static void http_stats(sp_coord *c, void *arg) {
  sp_coord_http_get_stats(c, arg);
}

/* The gRPC side answers (Health, open to the fixture's tokenless
 * client) within a second. */
static void grpc_answers(http_fx *h) {
  double t0 = sp_clock_s();
  Grpc__Health__V1__HealthCheckRequest hq =
      GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  hq.service = (char *)SP_COORD_SERVICE;
  sp_rpc_status st;
  Grpc__Health__V1__HealthCheckResponse *r = (void *)sp_test_unary(
      h->fx.cli, "/grpc.health.v1.Health/Check", &hq.base,
      &grpc__health__v1__health_check_response__descriptor, 5000, &st);
  sp_test_expect_status(&st, SP_RPC_OK, NULL);
  assert_int_equal(
      r->status,
      GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
  sp_test_free_msg(r);
  assert_true(sp_clock_s() - t0 < 1.0);
}

static void test_hostile_requests(void **state) {
  (void)state;
  http_fx h;
  sp_coord_config extra = {.request_timeout_ms = 2000};
  start(&h, &extra);
  int port = h.fx.http_port;
  probe pr = {0};
  sp_coord_fixture_run(&h.fx, probe_start, &pr);
  /* malformed request lines and headers: an error status or a closed
   * connection, never a crash */
  static const char *const bad[] = {
      "GARBAGE\r\n\r\n",
      "GET\r\n\r\n",
      "GET / HTTP/9.9\r\nHost: x\r\n\r\n",
      "GET / HTTP/1.1\r\nno colon here\r\n\r\n",
      "GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
      "GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
      "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 binary TLS hello",
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    raw_request(port, bad[i], strlen(bad[i]), &g_r);
    assert_true(g_r.status == 0 || g_r.status >= 400);
  }
  /* a 1 MiB header line: refused, the connection's memory stays bounded */
  size_t big = 1u << 20;
  char *req = malloc(big + 128);
  assert_non_null(req);
  int n = snprintf(req, 128, "GET /metrics HTTP/1.1\r\nX-Big: ");
  memset(req + n, 'a', big);
  memcpy(req + n + big, "\r\n\r\n", 5);
  int fd = connect_to(port);
  assert_true(fd >= 0);
  /* the server may close before taking it all */
  (void)send(fd, req, (size_t)n + big + 4, MSG_NOSIGNAL);
  read_all(fd, g_r.raw, sizeof g_r.raw, 5000);
  close(fd);
  parse(&g_r);
  assert_true(g_r.status == 0 || g_r.status == 413 || g_r.status == 431 ||
              g_r.status == 400);
  free(req);
  /* a slow client, one byte at a time: closed once it goes quiet for the
   * request timeout, whatever it sent */
  fd = connect_to(port);
  assert_true(fd >= 0);
  const char *slow = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
  for (size_t i = 0; slow[i]; i++) {
    if (send(fd, slow + i, 1, MSG_NOSIGNAL) != 1)
      fail_msg("slow client: byte %zu: %s", i, strerror(errno));
    usleep(20 * 1000);
  }
  double t0 = sp_clock_s();
  read_all(fd, g_r.raw, sizeof g_r.raw, 8000);
  double waited = sp_clock_s() - t0;
  close(fd);
  assert_true(waited < 5.0);
  grpc_answers(&h);
  request(port, "GET", "/healthz", NULL, NULL, &g_r);
  assert_int_equal(g_r.status, 200);
  uint64_t pause = loop_pause(&h, &pr);
  printf("hostile requests: loop pause max %llu ms\n",
         (unsigned long long)pause);
  assert_true(pause < PAUSE_BUDGET_MS);
  sp_coord_fixture_run(&h.fx, probe_stop, &pr);
  stop(&h);
}

/* From a loopback address of its own, so that the per-address limit
 * counts it apart. */
static int connect_from(int port, uint32_t src) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  struct sockaddr_in s = {.sin_family = AF_INET};
  s.sin_addr.s_addr = htonl(src);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, (struct sockaddr *)&s, sizeof s) != 0 ||
      (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 &&
       errno != EINPROGRESS)) {
    close(fd);
    return -1;
  }
  return fd;
}

static void test_ten_thousand_idle(void **state) {
  (void)state;
  enum { N = 10000 };
  struct rlimit rl;
  getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_max < N + 512) {
    printf("skipped: the fd limit (%llu) is under the %d connections\n",
           (unsigned long long)rl.rlim_max, N);
    skip();
  }
  if (rl.rlim_cur < N + 512) {
    rl.rlim_cur = N + 512;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &rl), 0);
  }
  http_fx h;
  start(&h, NULL);
  int port = h.fx.http_port;
  probe pr = {0};
  sp_coord_fixture_run(&h.fx, probe_start, &pr);
  long rss0 = (long)sp_test_proc_status_kib("VmRSS");
  int *fds = malloc(N * sizeof *fds);
  assert_non_null(fds);
  int opened = 0;
  for (int i = 0; i < N; i++) {
    /* 127.0.0.1 .. 127.0.39.x: 256 clients an address */
    fds[i] = connect_from(port, 0x7f000001u + (uint32_t)(i / 256) * 256u +
                                    (uint32_t)(i % 256 == 0 ? 1 : 0));
    if (fds[i] >= 0) opened++;
    if (i % 1000 == 999) grpc_answers(&h);
  }
  assert_true(opened > N / 2);
  sleep(1);
  sp_coord_http_stats st;
  sp_coord_fixture_run(&h.fx, http_stats, &st);
  assert_true(st.connections_open <= SP_COORD_HTTP_MAX_CONNECTIONS);
  grpc_answers(&h);
  uint64_t pause = loop_pause(&h, &pr);
  long grown = (long)sp_test_proc_status_kib("VmRSS") - rss0;
  printf(
      "10,000 idle connections: %d opened, %llu held by the listener, "
      "loop pause max %llu ms, RSS %+ld KiB\n",
      opened, (unsigned long long)st.connections_open,
      (unsigned long long)pause, grown);
  assert_true(pause < PAUSE_BUDGET_MS);
  /* the client's own sockets are most of it; the listener keeps at most
   * its connection limit x its per-connection memory */
  assert_true(grown < 64 * 1024);
  for (int i = 0; i < N; i++)
    if (fds[i] >= 0) close(fds[i]);
  free(fds);
  /* served again once they are gone */
  double t0 = sp_clock_s();
  do {
    request(port, "GET", "/healthz", NULL, NULL, &g_r);
  } while (g_r.status != 200 && sp_clock_s() - t0 < 10);
  assert_int_equal(g_r.status, 200);
  sp_coord_fixture_run(&h.fx, probe_stop, &pr);
  stop(&h);
}

/* ---- TLS ---- */

static void tls_get(int port, const char *ca, const char *path,
                    const char *token, http_resp *r) {
  SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
  assert_non_null(ctx);
  assert_int_equal(SSL_CTX_load_verify_locations(ctx, ca, NULL), 1);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
  SSL *s = SSL_new(ctx);
  int fd = connect_to(port);
  assert_true(fd >= 0);
  SSL_set_fd(s, fd);
  SSL_set_tlsext_host_name(s, "localhost");
  SSL_set1_host(s, "localhost");
  if (SSL_connect(s) != 1) {
    char e[256];
    ERR_error_string_n(ERR_get_error(), e, sizeof e);
    fail_msg("TLS handshake: %s", e);
  }
  char req[1024];
  int n = snprintf(req, sizeof req,
                   "GET %s HTTP/1.1\r\nHost: localhost\r\nConnection: "
                   "close\r\n%s%s%s\r\n",
                   path, token ? "Authorization: Bearer " : "",
                   token ? token : "", token ? "\r\n" : "");
  assert_int_equal(SSL_write(s, req, n), n);
  size_t got = 0;
  int k;
  while ((k = SSL_read(s, r->raw + got, (int)(sizeof r->raw - 1 - got))) > 0)
    got += (size_t)k;
  r->raw[got] = '\0';
  SSL_free(s);
  SSL_CTX_free(ctx);
  close(fd);
  parse(r);
}

static void test_tls(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  sp_test_certs certs;
  int rc = sp_test_certs_make(dir, &certs);
  if (rc == SP_EUNSUPPORTED) {
    printf("skipped: no openssl command to make test certificates\n");
    sp_test_rmtree(dir);
    free(dir);
    skip();
  }
  assert_int_equal(rc, 0);
  sp_rpc_tls_server_opts tls = {.cert_file = certs.server_cert,
                                .key_file = certs.server_key};
  sp_coord_config extra = {.tls = &tls};
  http_fx h;
  start(&h, &extra);
  int port = h.fx.http_port;
  tls_get(port, certs.ca, "/healthz", NULL, &g_r);
  assert_int_equal(g_r.status, 200);
  tls_get(port, certs.ca, "/metrics", NULL, &g_r);
  assert_int_equal(g_r.status, 401);
  tls_get(port, certs.ca, "/metrics", h.auth.token[SP_ROLE_READER], &g_r);
  assert_int_equal(g_r.status, 200);
  assert_non_null(strstr(g_r.body, "shardplane_job_world_size 2"));
  /* cleartext on the TLS port gets no HTTP answer */
  request(port, "GET", "/healthz", NULL, NULL, &g_r);
  assert_int_equal(g_r.status, 0);
  stop(&h);
  sp_test_certs_free(&certs);
  sp_test_rmtree(dir);
  free(dir);
}

int main(void) {
  SSL_library_init();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_access_by_role),
      cmocka_unit_test(test_login_cookie),
      cmocka_unit_test(test_methods_and_paths),
      cmocka_unit_test(test_hostile_requests),
      cmocka_unit_test(test_ten_thousand_idle),
      cmocka_unit_test(test_tls),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
