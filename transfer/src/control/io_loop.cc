#include "io_loop.h"

#include <fmt/format.h>

#include <chrono>
#include <exception>
#include <thread>

#include "control/lane.h"
#include "kvt/common/log.h"

namespace kvt::control::internal {
namespace {

using Clock = std::chrono::steady_clock;

// Returns when `io` is stopped (or out of work).
void Loop(boost::asio::io_context& io, const BusyPollOptions& busy, LanePollSet* lanes) {
  if (busy.window.count() <= 0) {
    io.run();
    return;
  }
  auto expecting = [&busy] { return busy.hint && busy.hint(); };
  while (!io.stopped()) {
    // Sleep in the reactor until something happens, unless frames are expected (or wait in a
    // lane: its writer saw no sleeper, so rang no doorbell)...
    if (!expecting()) {
      if (lanes != nullptr && lanes->Sleep()) {
        lanes->Wake();
      } else {
        const size_t ran = io.run_one();
        if (lanes != nullptr) lanes->Wake();
        if (ran == 0) return;
      }
    }
    // ...then poll without sleeping while handlers keep coming or frames are expected, and for
    // `window` after the last of either.
    auto last = Clock::now();
    SpinPacer pacer;
    while (true) {
      const bool handled = io.poll() > 0;
      if ((lanes != nullptr && lanes->Poll()) || handled) {
        last = Clock::now();
        continue;
      }
      if (io.stopped()) return;
      if (expecting()) {
        last = Clock::now();
      } else if (Clock::now() - last >= busy.window) {
        break;
      }
      pacer.Wait();
    }
  }
}

}  // namespace

Status CheckBusyPoll(const BusyPollOptions& busy) {
  if (busy.window.count() < 0) {
    return InvalidArgument(
        fmt::format("busy_poll.window = {} us: must be >= 0 (0: no polling)", busy.window.count()));
  }
  const uint32_t n = busy.lane_ring_bytes;
  if (busy.lanes && !ValidLaneRingBytes(n)) {
    return InvalidArgument(fmt::format(
        "busy_poll.lane_ring_bytes = {}: must be a power of two in [{}, {}] (or lanes = false)", n,
        kMinLaneRingBytes, kMaxLaneRingBytes));
  }
  return OkStatus();
}

std::unique_ptr<LanePollSet> MakeLanePollSet(const BusyPollOptions& busy) {
  if (busy.window.count() <= 0 || !busy.lanes) return nullptr;
  return std::make_unique<LanePollSet>();
}

uint64_t LanePollSet::Add(Entry entry) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  entries_.emplace_back(id, std::make_shared<Entry>(std::move(entry)));
  version_.fetch_add(1, std::memory_order_release);
  return id;
}

void LanePollSet::Remove(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(entries_, [id](const auto& e) { return e.first == id; });
  version_.fetch_add(1, std::memory_order_release);
}

void LanePollSet::Snapshot() {
  const uint64_t version = version_.load(std::memory_order_acquire);
  if (version == seen_version_) return;
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_.clear();
  for (const auto& e : entries_) snapshot_.push_back(e.second);
  seen_version_ = version;
}

bool LanePollSet::Any(const std::function<bool()> Entry::*call) {
  // Over a copy that only this thread replaces (in Snapshot): a callback that removes its entry
  // changes entries_, not the snapshot, until the next pass. Every entry is called.
  bool any = false;
  for (const std::shared_ptr<Entry>& entry : snapshot_) any = ((*entry).*call)() || any;
  return any;
}

bool LanePollSet::Poll() {
  Snapshot();
  return Any(&Entry::poll);
}

bool LanePollSet::Sleep() {
  Snapshot();
  return Any(&Entry::sleep);
}

void LanePollSet::Wake() {
  for (const std::shared_ptr<Entry>& entry : snapshot_) entry->wake();
}

void RunIoLoop(boost::asio::io_context& io, const BusyPollOptions& busy, const char* who,
               LanePollSet* lanes) {
  while (true) {
    try {
      Loop(io, busy, lanes);
      return;
    } catch (const std::exception& e) {
      KVT_LOG_ERROR("ctl", "exception escaped a {} io handler: {}", who, e.what());
    } catch (...) {
      KVT_LOG_ERROR("ctl", "non-standard exception escaped a {} io handler", who);
    }
  }
}

}  // namespace kvt::control::internal
