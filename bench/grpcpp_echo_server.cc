// The reference server for bench/rpc: gRPC C++ serving the same
// tests/proto/echo.proto as our engine's Echo service. Only Echo.Unary does
// work (the other methods answer UNIMPLEMENTED); it echoes text and payload
// back like tests/support/echo_service.c does.
//
//   grpcpp_echo_server [--listen host:port] [--threads N]
//
// It uses the async API the way gRPC's own QPS benchmark server does: N
// threads, each draining its own completion queue, with a few requests
// posted per queue (default N: one per online CPU). Prints "PORT <n>" once
// listening and serves until SIGINT/SIGTERM or until its stdin reaches EOF,
// so it never outlives the benchmark that started it.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "echo.grpc.pb.h"

namespace {

using shardplane::testing::Echo;
using shardplane::testing::EchoReply;
using shardplane::testing::EchoRequest;

// One posted Echo.Unary: waits for a request, answers it, posts itself again.
class UnaryCall {
 public:
  UnaryCall(Echo::AsyncService *svc, grpc::ServerCompletionQueue *cq)
      : svc_(svc), cq_(cq), responder_(&ctx_) {
    svc_->RequestUnary(&ctx_, &req_, &responder_, cq_, cq_, this);
  }

  // Called with the completion-queue result of the pending operation.
  void Proceed(bool ok) {
    if (!answered_) {
      if (!ok) {  // the queue is shutting down
        delete this;
        return;
      }
      new UnaryCall(svc_, cq_);  // keep one request posted in this slot
      answered_ = true;
      if (req_.fail_code() != 0) {
        responder_.FinishWithError(
            grpc::Status(static_cast<grpc::StatusCode>(req_.fail_code()),
                         req_.fail_message()),
            this);
        return;
      }
      reply_.set_text(req_.text());
      reply_.set_payload(req_.payload());
      reply_.set_index(0);
      responder_.Finish(reply_, grpc::Status::OK, this);
      return;
    }
    delete this;  // the reply went out (or the call died)
  }

 private:
  Echo::AsyncService *svc_;
  grpc::ServerCompletionQueue *cq_;
  grpc::ServerContext ctx_;
  EchoRequest req_;
  EchoReply reply_;
  grpc::ServerAsyncResponseWriter<EchoReply> responder_;
  bool answered_ = false;
};

std::atomic<bool> g_stop{false};

void on_signal(int) { g_stop = true; }

void usage(std::FILE *f) {
  std::fprintf(f,
               "usage: grpcpp_echo_server [--listen host:port] "
               "[--threads N]\n");
}

void serve(Echo::AsyncService *svc, grpc::ServerCompletionQueue *cq) {
  // several requests posted per queue, so a burst of calls does not wait
  // for a slot to be re-posted
  for (int i = 0; i < 16; i++) new UnaryCall(svc, cq);
  void *tag;
  bool ok;
  while (cq->Next(&tag, &ok)) static_cast<UnaryCall *>(tag)->Proceed(ok);
}

}  // namespace

int main(int argc, char **argv) {
  std::string addr = "127.0.0.1:0";
  long threads = sysconf(_SC_NPROCESSORS_ONLN);
  for (int i = 1; i < argc; i++) {
    if (std::strcmp(argv[i], "--listen") == 0 && i + 1 < argc) {
      addr = argv[++i];
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = std::atol(argv[++i]);
    } else if (std::strcmp(argv[i], "--help") == 0) {
      usage(stdout);
      return 0;
    } else {
      usage(stderr);
      return 2;
    }
  }
  if (threads < 1) threads = 1;
  Echo::AsyncService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(addr, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> cqs;
  for (long i = 0; i < threads; i++)
    cqs.push_back(builder.AddCompletionQueue());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "grpcpp_echo_server: cannot listen on %s\n",
                 addr.c_str());
    return 1;
  }
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::vector<std::thread> workers;
  for (auto &cq : cqs) workers.emplace_back(serve, &service, cq.get());
  std::printf("PORT %d\n", port);
  std::fflush(stdout);
  // stdin EOF (the parent went away) also stops the server
  std::thread watch([] {
    char b[64];
    while (read(0, b, sizeof b) > 0) {
    }
    g_stop = true;
  });
  watch.detach();
  while (!g_stop) usleep(20 * 1000);
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(500));
  for (auto &cq : cqs) cq->Shutdown();
  for (auto &w : workers) w.join();
  return 0;
}
