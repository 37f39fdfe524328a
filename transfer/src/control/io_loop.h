// The io threads' loop of ControlServer and ControlClient (private to the control plane).
#pragma once

#include <boost/asio/io_context.hpp>
#include <thread>

#include "control/spin.h"
#include "kvt/common/status.h"
#include "kvt/transfer/control_options.h"

namespace kvt::control::internal {

// InvalidArgument for a negative window (checked by ControlServer::Create and
// ControlClient::Connect).
Status CheckBusyPoll(const BusyPollOptions& busy);

// Runs `io` until it is stopped, waiting as `busy` says (blocking in the reactor, or polling;
// see BusyPollOptions). A handler that throws is logged and the loop goes on: one bad callback
// must not take the control plane down. `who` names the endpoint in those logs.
void RunIoLoop(boost::asio::io_context& io, const BusyPollOptions& busy, const char* who);

}  // namespace kvt::control::internal
