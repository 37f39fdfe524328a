// RpcClient: a driver's blocking request/reply calls to kvt agents and the bootstrap over one
// control connection (ids matched to reply_to). Thread safety: one caller at a time.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "control/control_client.h"
#include "kvt/common/status.h"

namespace kvt::tools {

class RpcClient {
 public:
  static StatusOr<RpcClient> Connect(const std::string& host, uint16_t port,
                                     const std::string& client_id,
                                     std::chrono::milliseconds timeout);
  // Sends `request` and returns its reply; an Error reply becomes its Status.
  StatusOr<v1::Envelope> Call(v1::Envelope request, std::chrono::milliseconds timeout);

 private:
  std::unique_ptr<control::ControlClient> client_;
  uint64_t next_id_ = 0;
};

}  // namespace kvt::tools
