// The engine's request table: rooms by id, their forward-only state machine, deadlines and
// retention, shared by the prefill and the decode side (each keeps its own role-specific room
// type deriving from RoomCore), and the context both sides and the poller share.
//
// Locking: one mutex per engine (EngineContext::mu) guards the table and each side's state.
// Nothing that can block (a backend's Disconnect or Release, a CUDA synchronisation, a socket
// connect) runs while it is held: such work is collected under the lock (AfterUnlock) and done
// after it is released. Clang's -Wthread-safety checks the annotations.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "control/spin.h"
#include "kvt/common/mutex.h"
#include "kvt/common/status.h"
#include "kvt/transfer/engine.h"
#include "kvt/v1/peer.pb.h"

namespace kvt::transfer::engine {

using Clock = std::chrono::steady_clock;

// Wakes the poller. Kick() never blocks for long (it takes a mutex of its own that nobody holds
// while blocking), so backends may call it from CUDA host functions and progress threads; a kick
// that comes before the poller waits is not lost.
class Wakeup {
 public:
  void Kick() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
  }
  // Kicks only when the poller must run before `when`: unless it sleeps (or spins) already until
  // no later than that (a kick costs a wake-up of the poller thread, and the pass it runs takes
  // the engine's lock from the caller's next call). Clock::time_point::max(): nothing to run for.
  void KickBefore(Clock::time_point when) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (sleeping_ && sleep_until_ <= when) return;  // it wakes in time anyway
      if (when == Clock::time_point::max()) return;
      pending_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
  }
  // Returns at `deadline` or once kicked (consuming the kick).
  void WaitUntil(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    sleeping_ = true;
    sleep_until_ = deadline;
    cv_.wait_until(lock, deadline, [this] { return pending_.load(std::memory_order_relaxed); });
    sleeping_ = false;
    pending_.store(false, std::memory_order_relaxed);
  }
  // WaitUntil without sleeping: polls for a kick (a load per pass, yielding the core now and
  // then: control::internal::SpinPacer) until `deadline`, so a kick is seen within a fraction of
  // a microsecond instead of after a thread wake-up. Kicks for later than `deadline` are not
  // needed meanwhile, as for a sleeping poller.
  void SpinUntil(Clock::time_point deadline) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      sleeping_ = true;
      sleep_until_ = deadline;
    }
    control::internal::SpinPacer pacer;
    while (!pending_.load(std::memory_order_acquire) && Clock::now() < deadline) pacer.Wait();
    std::lock_guard<std::mutex> lock(mu_);
    sleeping_ = false;
    pending_.store(false, std::memory_order_relaxed);
  }
  bool Consume() {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_.exchange(false, std::memory_order_relaxed);
  }
  // Read without consuming and without the mutex (a spinning poller stops when a kick comes).
  bool pending() const { return pending_.load(std::memory_order_acquire); }
  // Whether the poller waits now, asleep or spinning (tests, to act while it does).
  bool waiting() const {
    std::lock_guard<std::mutex> lock(mu_);
    return sleeping_;
  }

 private:
  // Guards the writes of pending_ and the sleep state; never held while blocking.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> pending_{false};
  bool sleeping_ = false;  // in WaitUntil or SpinUntil, until sleep_until_
  Clock::time_point sleep_until_;
};

class Worker;

// What the engine's parts share. Immutable after Init except where annotated.
// How long a prefill engine takes, at most, from noticing that it has not heard from a decode
// peer for its peer timeout to having that peer's endpoint closed and its copies stopped (the
// engine's worker closes the endpoint forcibly; copies stop between chunks). A prefill engine
// promises its peers (PeerInfo.fence_ms) that none of its writes lands later than
// peer_timeout + kFenceTeardown after the last frame it received from them.
inline constexpr auto kFenceTeardown = std::chrono::milliseconds(2000);

struct EngineContext {
  explicit EngineContext(const EngineOptions& o) : options(o) {}

  const EngineOptions options;
  std::shared_ptr<Backend> backend;
  TransferLayout layout;                            // what this engine registered
  std::vector<TransferLayout::FlatBuffer> buffers;  // its KV buffers, in buffer order
  v1::Layout local_layout;
  v1::PeerInfo local_info;
  bool page_writes = false;      // the backend takes page lists (PostPages)
  bool notified = false;         // the backend calls the completion notifier
  bool hinted = false;           // the backend's CompletedHint tells completion without a lock
  bool waits_on_events = false;  // the backend waits for a producer's event on the GPU
  int32_t num_layers() const { return static_cast<int32_t>(local_layout.num_layers()); }

  Wakeup wakeup;                   // the poller's
  std::unique_ptr<Worker> worker;  // blocking work (AfterUnlock::may_block)
  mutable Mutex mu;
  // A room became final, or became reusable: WaitRequest's waiters. Use NotifyFinal().
  mutable CondVar final_cv;
  // How many times NotifyFinal ran: a WaitRequest that polls (control_busy_poll > 0) watches it
  // without taking the mutex, and looks at its room only when it moved.
  std::atomic<uint64_t> final_events{0};
  // EngineStats::poller_hot_spins (the poller's; read without the mutex).
  std::atomic<uint64_t> poller_hot_spins{0};
  void NotifyFinal() {
    final_events.fetch_add(1, std::memory_order_release);
    final_cv.NotifyAll();
  }
  bool stop KVT_GUARDED_BY(mu) = false;
  // TransferEngine::Interrupt ran: waits return at once, new connects are refused.
  bool interrupted KVT_GUARDED_BY(mu) = false;
  EngineStats stats KVT_GUARDED_BY(mu);
  // For the request tables, which are themselves guarded by `mu` where they are declared.
  EngineStats& stats_storage() KVT_NO_THREAD_SAFETY_ANALYSIS { return stats; }
};

// Work that must not run under the engine's mutex, collected while it is held and done, in this
// order, right after it is released: endpoints of lost or fenced peers closed, writes still in
// flight released (cancelled and waited for), then messages sent (so a "quiesced" message never
// overtakes the quiescing), then handles of completed writes freed (a TransferDone does not wait
// for that), then backend peers disconnected, then anything else.
struct AfterUnlock {
  // Peers lost or fenced: their endpoints close first (forcibly), so that their writes below end
  // at once instead of waiting on a network or a process that may not answer.
  std::vector<PeerId> dead_peers;
  std::vector<WriteId> frees;     // completed writes: freeing them never blocks
  std::vector<WriteId> releases;  // writes that may be in flight: releasing may block
  std::vector<std::function<void()>> messages;
  std::vector<PeerId> disconnects;
  std::vector<std::function<void()>> tasks;
  // Whether running it may block (then it goes to the engine's worker thread, never a control
  // io thread, the poller or a caller's thread).
  bool may_block() const {
    return !dead_peers.empty() || !releases.empty() || !disconnects.empty() || !tasks.empty();
  }
  bool empty() const { return frees.empty() && !may_block() && messages.empty(); }
  // Runs everything (the caller does not hold the engine's mutex). Writes that may be in flight
  // are released before the messages (an abort's ack or a failed room's done promises they are
  // quiesced); completed writes are freed after them, so a TransferDone does not wait for that.
  void Run(Backend& backend) {
    for (PeerId p : dead_peers) (void)backend.Disconnect(p, Backend::DisconnectMode::kPeerDead);
    for (WriteId w : releases) backend.Release(w);
    for (auto& m : messages) m();
    for (WriteId w : frees) backend.Release(w);
    for (PeerId p : disconnects) (void)backend.Disconnect(p, Backend::DisconnectMode::kPeerDead);
    for (auto& t : tasks) t();
    dead_peers.clear();
    frees.clear();
    releases.clear();
    messages.clear();
    disconnects.clear();
    tasks.clear();
  }
};

// One thread that runs the engine's blocking work (AfterUnlock bundles that may block) in the
// order it was handed over, so that one slow peer's teardown never holds a control io thread,
// the poller or a caller. Bounded: one thread per engine, whatever happens to peers.
class Worker {
 public:
  explicit Worker(Backend& backend) : backend_(backend), thread_([this] { Loop(); }) {}
  ~Worker() { Stop(); }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void Post(AfterUnlock work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(work));
    }
    cv_.notify_all();
  }
  // Returns once everything posted before the call has run.
  void Drain() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = posted_ + queue_.size();
    drained_.wait(lock, [&] { return done_ >= target || stopping_; });
  }
  // Runs what is queued, then joins the thread.
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left
      AfterUnlock work = std::move(queue_.front());
      queue_.erase(queue_.begin());
      ++posted_;
      lock.unlock();
      work.Run(backend_);
      lock.lock();
      ++done_;
      drained_.notify_all();
    }
  }

  Backend& backend_;
  std::mutex mu_;  // guards the queue and counters; never held while work runs
  std::condition_variable cv_;
  std::condition_variable drained_;
  std::vector<AfterUnlock> queue_;
  uint64_t posted_ = 0;  // taken off the queue
  uint64_t done_ = 0;    // finished
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the rest is constructed
};

// Runs `after` now when nothing in it can block, else hands it to the worker.
inline void Dispatch(EngineContext& ctx, AfterUnlock& after) {
  if (after.empty()) return;
  if (after.may_block() && ctx.worker) {
    ctx.worker->Post(std::move(after));
    after = AfterUnlock();
    return;
  }
  after.Run(*ctx.backend);
}

// The role-independent part of a room.
struct RoomCore {
  std::string id;
  RequestState state = RequestState::kBootstrapping;
  Status status;
  Clock::time_point created;
  Clock::time_point deadline;
  Clock::time_point finished;
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  uint64_t bytes = 0;
  bool pages_reusable = false;  // decode: no write into the pages can land any more
  // RequestInfo's timeline.
  Clock::time_point request_sent;
  Clock::time_point request_seen;
  Clock::time_point source_ready;
  Clock::time_point first_post;
  Clock::time_point last_post;
  int32_t layers_posted = 0;
};

// Rooms of one role (`Room` derives from RoomCore). Not synchronised itself: the side that owns
// it declares it KVT_GUARDED_BY the context's mutex, so every use needs that lock held.
template <typename Room>
class RequestTable {
 public:
  explicit RequestTable(EngineContext& ctx)
      : num_layers_(ctx.num_layers()), stats_(ctx.stats_storage()), ctx_(ctx) {}

  Room* Find(const std::string& id) {
    auto it = rooms_.find(id);
    return it == rooms_.end() ? nullptr : &it->second;
  }
  const Room* Find(const std::string& id) const {
    auto it = rooms_.find(id);
    return it == rooms_.end() ? nullptr : &it->second;
  }

  // A new room in Bootstrapping with the given deadline (the caller checked it is new).
  Room& Open(const std::string& id, std::chrono::milliseconds deadline) {
    Room& room = rooms_[id];
    room.id = id;
    room.created = Clock::now();
    room.deadline = room.created + deadline;
    room.layer_end = num_layers_;
    active_.insert(id);
    active_count_.store(active_.size(), std::memory_order_relaxed);
    return room;
  }

  // Removes a room as if it never existed (no statistics).
  void Erase(const std::string& id) {
    active_.erase(id);
    active_count_.store(active_.size(), std::memory_order_relaxed);
    rooms_.erase(id);
  }

  // Moves the state forward (never backward, never out of a final state). True when the room
  // became final now.
  bool Advance(Room& room, RequestState to) {
    if (IsFinal(room.state) || static_cast<int>(to) <= static_cast<int>(room.state)) return false;
    room.state = to;
    if (!IsFinal(to)) return false;
    room.finished = Clock::now();
    active_.erase(room.id);
    active_count_.store(active_.size(), std::memory_order_relaxed);
    if (to == RequestState::kSuccess) {
      ++stats_.requests_succeeded;
      stats_.bytes += room.bytes;
    } else {
      ++stats_.requests_failed;
    }
    ctx_.NotifyFinal();
    return true;
  }

  // Fails a room that is not final yet; true when it did.
  bool Fail(Room& room, Status why) {
    if (IsFinal(room.state)) return false;
    room.status = std::move(why);
    return Advance(room, RequestState::kFailed);
  }

  StatusOr<RequestInfo> Get(const std::string& id) const {
    const Room* room = Find(id);
    if (room == nullptr) return NotFound("no room '" + id + "' on this engine");
    return InfoOf(*room);
  }

  Status Forget(const std::string& id) {
    Room* room = Find(id);
    if (room == nullptr) return NotFound("no room '" + id + "' on this engine");
    if (!IsFinal(room->state)) {
      return FailedPrecondition("room '" + id + "' is still " + RequestStateName(room->state) +
                                "; abort it first");
    }
    rooms_.erase(id);
    return OkStatus();
  }

  // Forgets final rooms past `retention` for which `may_forget` holds.
  template <typename Pred>
  void Sweep(Clock::time_point now, std::chrono::milliseconds retention, Pred may_forget) {
    for (auto it = rooms_.begin(); it != rooms_.end();) {
      const Room& room = it->second;
      const bool expired =
          IsFinal(room.state) && now - room.finished > retention && may_forget(room);
      it = expired ? rooms_.erase(it) : std::next(it);
    }
  }

  // Ids of the rooms that are not final / of every room (copies: callers may finish or remove
  // rooms while iterating).
  std::vector<std::string> ActiveIds() const { return {active_.begin(), active_.end()}; }
  std::vector<std::string> AllIds() const {
    std::vector<std::string> ids;
    ids.reserve(rooms_.size());
    for (const auto& [id, room] : rooms_) ids.push_back(id);
    return ids;
  }
  size_t active_size() const { return active_.size(); }
  // Non-final rooms; an atomic, so it may be read without the lock (busy-poll hints).
  const std::atomic<size_t>& active_counter() const { return active_count_; }

  static RequestInfo InfoOf(const RoomCore& room) {
    RequestInfo info;
    info.room = room.id;
    info.state = room.state;
    info.status = room.status;
    info.bytes = room.bytes;
    info.layers_posted = room.layers_posted;
    info.pages_reusable = room.pages_reusable;
    info.created = room.created;
    info.finished = room.finished;
    info.request_sent = room.request_sent;
    info.request_seen = room.request_seen;
    info.source_ready = room.source_ready;
    info.first_post = room.first_post;
    info.last_post = room.last_post;
    return info;
  }

 private:
  const int32_t num_layers_;
  EngineStats& stats_;  // the context's, under its mutex like the table
  EngineContext& ctx_;  // for NotifyFinal
  std::unordered_map<std::string, Room> rooms_;
  std::set<std::string> active_;         // non-final rooms
  std::atomic<size_t> active_count_{0};  // active_.size()
};

// Waits until the room is final (its info), or `until` (DeadlineExceeded, naming `timeout`).
template <typename Room>
StatusOr<RequestInfo> WaitForFinal(EngineContext& ctx, const RequestTable<Room>& table,
                                   const std::string& id, Clock::time_point until,
                                   std::chrono::milliseconds timeout) KVT_REQUIRES(ctx.mu) {
  while (true) {
    const Room* room = table.Find(id);
    if (room == nullptr) return NotFound("no room '" + id + "' on this engine");
    if (IsFinal(room->state)) return table.InfoOf(*room);
    if (ctx.interrupted) {
      return Aborted("the wait for room '" + id + "' was interrupted (TransferEngine::Interrupt: " +
                     "the engine is closing); the room is still " +
                     std::string(RequestStateName(room->state)));
    }
    if (Clock::now() >= until) {
      return DeadlineExceeded("room '" + id + "' is still " + RequestStateName(room->state) +
                              " after " + std::to_string(timeout.count()) + " ms");
    }
    ctx.final_cv.WaitUntil(ctx.mu, until);
  }
}

// The part of an engine that plays one role; the TransferEngine forwards to it.
class EngineSide {
 public:
  virtual ~EngineSide() = default;
  virtual StatusOr<RequestInfo> GetRequest(const std::string& room) const = 0;
  virtual StatusOr<RequestInfo> WaitRequest(const std::string& room,
                                            std::chrono::milliseconds timeout) const = 0;
  virtual Status Abort(const std::string& room, const std::string& reason) = 0;
  virtual Status Forget(const std::string& room) = 0;

  // One pass of the poller: deadlines, completions, retention. Returns when the poller should
  // run again at the latest; `spin_write` is set to a write worth watching without sleeping
  // (a device write whose source is ready, so its copy runs now), else 0.
  struct PollResult {
    Clock::time_point next;
    WriteId spin_write = 0;
  };
  virtual PollResult PollPass(Clock::time_point now) = 0;

  // Stops the side: every room not final fails, writes are quiesced, peers are told, sessions
  // close. Called once, after the poller stopped.
  virtual void Shutdown() = 0;

  // Control connections whose frames go through a lane now (EngineStats::control_lanes). Called
  // without the engine's mutex held.
  virtual uint64_t ControlLanes() const = 0;
};

// What both sides share: the context and their table, and the calls that only read or drop
// rooms.
template <typename Room>
class SideWithTable : public EngineSide {
 public:
  explicit SideWithTable(EngineContext& ctx) : ctx_(ctx), table_(ctx) {}

  StatusOr<RequestInfo> GetRequest(const std::string& room) const override KVT_EXCLUDES(ctx_.mu) {
    MutexLock lock(ctx_.mu);
    return table_.Get(room);
  }
  StatusOr<RequestInfo> WaitRequest(const std::string& room,
                                    std::chrono::milliseconds timeout) const override
      KVT_EXCLUDES(ctx_.mu) {
    const auto until = Clock::now() + timeout;
    // An engine that busy-polls its control plane is one whose owner spends cores on latency:
    // its waiters poll as well, for up to that window, instead of sleeping on the condition
    // variable, whose wake-up (a futex, then a time slice) costs a one-page request tens of
    // microseconds on a loaded machine. The room is looked at (under the mutex) only when a room
    // became final since the last look.
    const auto spin = std::chrono::duration_cast<Clock::duration>(ctx_.options.control_busy_poll);
    if (spin.count() > 0) {
      const auto spin_until = std::min(until, Clock::now() + spin);
      uint64_t seen = ctx_.final_events.load(std::memory_order_acquire);
      while (true) {
        {
          MutexLock lock(ctx_.mu);
          const Room* r = table_.Find(room);
          if (r == nullptr || IsFinal(r->state) || ctx_.interrupted) {
            return WaitForFinal(ctx_, table_, room, until, timeout);
          }
        }
        uint64_t now_seen;
        while ((now_seen = ctx_.final_events.load(std::memory_order_acquire)) == seen &&
               Clock::now() < spin_until) {
          std::this_thread::yield();
        }
        if (now_seen == seen) break;  // the window passed: sleep below
        seen = now_seen;
      }
    }
    MutexLock lock(ctx_.mu);
    return WaitForFinal(ctx_, table_, room, until, timeout);
  }
  Status Forget(const std::string& room) override KVT_EXCLUDES(ctx_.mu) {
    MutexLock lock(ctx_.mu);
    return table_.Forget(room);
  }

 protected:
  EngineContext& ctx_;
  RequestTable<Room> table_ KVT_GUARDED_BY(ctx_.mu);
};

}  // namespace kvt::transfer::engine
