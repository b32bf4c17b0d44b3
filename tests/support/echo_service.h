/* The Echo test service (tests/proto/echo.proto) on the gRPC engine, used
 * in-process by the C tests and by tests/echo_server for the interop and
 * hostile-input tests. A Unary request with text "__stats__" answers with
 * "cancelled=N active=M": handlers cancelled so far and delayed handlers
 * still holding work, so tests can see that cancellation stops the work;
 * one with text "__authorization__" answers with the authorization
 * metadata its handler sees ("" when none). */
#ifndef SP_ECHO_SERVICE_H
#define SP_ECHO_SERVICE_H

#include "rpc/rpc.h"

int sp_echo_register(sp_rpc_server *srv);

#endif
