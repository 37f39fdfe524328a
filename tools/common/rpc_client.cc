#include "rpc_client.h"

#include "control/auth.h"
#include "control/protocol.h"

namespace kvt::tools {

StatusOr<RpcClient> RpcClient::Connect(const std::string& host, uint16_t port,
                                       const std::string& client_id,
                                       std::chrono::milliseconds timeout) {
  control::ControlClientOptions options;
  options.host = host;
  options.port = port;
  options.client_id = client_id;
  options.role = v1::ROLE_TOOL;
  options.cluster_token = control::ClusterTokenFromEnv();
  options.connect_timeout = timeout;
  RpcClient rpc;
  KVT_ASSIGN_OR_RETURN(rpc.client_, control::ControlClient::Connect(options));
  return rpc;
}

StatusOr<v1::Envelope> RpcClient::Call(v1::Envelope request, std::chrono::milliseconds timeout) {
  const uint64_t id = ++next_id_;
  request.set_id(id);
  KVT_RETURN_IF_ERROR(client_->Send(request));
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return DeadlineExceeded("no reply to " + std::string(control::BodyName(request)) +
                              " within " + std::to_string(timeout.count()) + " ms");
    }
    KVT_ASSIGN_OR_RETURN(v1::Envelope reply, client_->Receive(left));
    if (reply.reply_to() != id && !(reply.has_error() && reply.reply_to() == 0)) continue;
    if (reply.has_error()) return control::StatusFromError(reply.error());
    return reply;
  }
}

}  // namespace kvt::tools
