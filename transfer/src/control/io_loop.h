// The io threads' loop of ControlServer and ControlClient (private to the control plane).
#pragma once

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "control/spin.h"
#include "kvt/common/status.h"
#include "kvt/transfer/control_options.h"

namespace kvt::control::internal {

// InvalidArgument for a negative window or a bad lane size (checked by ControlServer::Create and
// ControlClient::Connect).
Status CheckBusyPoll(const BusyPollOptions& busy);

// The lanes (lane.h) of the connections an io thread serves: the loop reads them on each
// polling pass, and marks them asleep before it blocks in the reactor (their writers then ring
// a doorbell on the socket). Add/Remove from any thread; Poll/Sleep/Wake from the loop's thread,
// which is also the connections' only thread (lanes need one io thread per io_context).
class LanePollSet {
 public:
  struct Entry {
    std::function<bool()> poll;   // reads and handles what waits; whether there was anything
    std::function<bool()> sleep;  // marks the lane asleep; whether bytes arrived meanwhile
    std::function<void()> wake;
  };
  uint64_t Add(Entry entry);
  void Remove(uint64_t id);
  bool Poll();
  // True when a lane has bytes: then the loop must not block (Wake() either way after).
  bool Sleep();
  void Wake();

 private:
  void Snapshot();
  // Calls `call` of every entry of the snapshot; whether any returned true.
  bool Any(const std::function<bool()> Entry::*call);
  std::mutex mu_;
  uint64_t next_id_ = 1;
  std::vector<std::pair<uint64_t, std::shared_ptr<Entry>>> entries_;  // guarded by mu_
  std::atomic<uint64_t> version_{0};                                  // bumped by Add/Remove
  // The loop thread's copy (callbacks run without mu_: they may Remove themselves).
  uint64_t seen_version_ = 0;
  std::vector<std::shared_ptr<Entry>> snapshot_;
};

// The set for an endpoint whose io thread polls with lanes allowed; null otherwise.
std::unique_ptr<LanePollSet> MakeLanePollSet(const BusyPollOptions& busy);

// Runs `io` until it is stopped, waiting as `busy` says (blocking in the reactor, or polling;
// see BusyPollOptions), reading `lanes` (may be null) on each polling pass. A handler that throws
// is logged and the loop goes on: one bad callback must not take the control plane down. `who`
// names the endpoint in those logs.
void RunIoLoop(boost::asio::io_context& io, const BusyPollOptions& busy, const char* who,
               LanePollSet* lanes = nullptr);

}  // namespace kvt::control::internal
