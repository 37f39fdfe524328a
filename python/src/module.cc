// kvt._kvt: the pybind11 layer under the `kvt` Python package.
//
// This module is deliberately thin: it converts Python values (ints, lists, numpy arrays) to the
// C++ API's types, releases the GIL around every call that can block or copy, and turns a
// non-OK kvt::Status into a Python exception through kvt._errors (which owns the exception
// classes and their mapping). Argument defaults, torch handling and documentation of the public
// API live in the pure-Python package (kvt/__init__.py and friends); names here are private.
//
// Thread safety: every function may be called from any Python thread; the engine and the
// registry client are thread-safe (kvt/transfer/engine.h, registry.h).
#include <cuda_runtime_api.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "kvt/common/dtype.h"
#include "kvt/common/status.h"
#include "kvt/transfer/backends.h"
#include "kvt/transfer/engine.h"
#include "kvt/transfer/layout.h"
#include "kvt/transfer/registry.h"

namespace py = pybind11;
using namespace std::chrono_literals;

namespace kvt::python {
namespace {

// Carries a non-OK Status (and the room it concerns) to the exception translator.
struct StatusError {
  Status status;
  std::string room;
};

// Whether the interpreter is shutting down (destructors then must not release the GIL).
bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Destroys what `owned` holds (engines and backends join their threads) without the GIL, except
// while the interpreter shuts down; `close` does it at once wherever it is called from.
template <typename Ptr>
void DestroyWithoutGil(Ptr& owned, bool close = false) {
  Ptr doomed = std::move(owned);
  if (doomed == nullptr) return;
  if (close || (PyGILState_Check() && !Finalizing())) {
    py::gil_scoped_release release;
    doomed.reset();
  } else {
    doomed.reset();
  }
}

// How long one slice of a wait without the GIL lasts: a close() on another thread ends the wait
// within it (waits that return at once when their request is final cost nothing more).
constexpr std::chrono::milliseconds kWaitSlice{100};

// Closes a native object that calls on other Python threads may be using without the GIL.
// Every such call holds a reference (taken with the GIL, before releasing it), so the object is
// never destroyed under a call in flight: `owned` is emptied at once (new calls see the object
// closed), `closing` tells waits in flight to give up at their next slice, and the object is
// destroyed, without the GIL, once the last call in flight has returned its reference. A
// close() that finds it closing already returns only once that one has finished (`close_mu`,
// taken with the GIL held by the first, which never needs the GIL while it holds it).
// `interrupt` (if any) runs first, on the object, without the GIL: it makes calls in flight that
// wait on a peer return now (TransferEngine::Interrupt).
template <typename T>
void CloseShared(std::shared_ptr<T>& owned, std::atomic<bool>& closing, std::mutex& close_mu,
                 void (*interrupt)(T&) = nullptr) {
  if (owned == nullptr) {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> wait_for_the_first(close_mu);
    return;
  }
  std::unique_lock<std::mutex> lock(close_mu);
  std::shared_ptr<T> doomed = std::move(owned);
  closing.store(true, std::memory_order_release);
  py::gil_scoped_release release;
  if (interrupt != nullptr) interrupt(*doomed);
  // No new reference can be taken (that needs the GIL and `owned`): the count only falls.
  while (doomed.use_count() > 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  doomed.reset();
}

void ThrowIfError(const Status& status, const std::string& room = {}) {
  if (!status.ok()) throw StatusError{status, room};
}

template <typename T>
T ValueOrThrow(StatusOr<T> result, const std::string& room = {}) {
  if (!result.ok()) throw StatusError{result.status(), room};
  return std::move(result).value();
}

// Python's repr of `obj`, at most 80 characters (for messages).
std::string Repr(py::handle obj) {
  std::string text;
  try {
    text = py::repr(obj).cast<std::string>();
  } catch (const py::error_already_set&) {
    text = "<" + std::string(py::str(py::type::handle_of(obj).attr("__name__"))) + ">";
  }
  return text.size() <= 80 ? text : text.substr(0, 77) + "...";
}

std::string TypeName(py::handle obj) {
  return py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>();
}

// Whether `obj` is a boolean: Python's bool, a numpy bool scalar or a torch bool tensor, all of
// which __index__ would turn into 0 or 1.
bool IsBool(py::handle obj) {
  if (PyBool_Check(obj.ptr())) return true;
  if (PyLong_CheckExact(obj.ptr()) || !py::hasattr(obj, "dtype")) return false;
  const std::string dtype = py::str(obj.attr("dtype")).cast<std::string>();
  return dtype == "bool" || dtype == "torch.bool";
}

// An integer from Python: an int or an int-like value (a numpy integer, a one-element integer
// tensor: anything with __index__) in [lo, hi]. A boolean (True would read as 1) or anything
// else raises TypeError naming `what` and the value; a value outside [lo, hi] (or beyond 64
// bits) raises ValueError naming `what`, the value and the range. Every integer argument of the
// module's functions comes through here (lists and arrays of them through ToInt64s), so that
// none reaches pybind11's own conversion, whose refusal names neither the argument nor the
// value; RegionWriter.write's rows, an array kvt.compat.mooncake builds, are the exception.
// `hint`, when given, follows the range in the ValueError's message.
template <typename T>
T IntArg(py::handle obj, const std::string& what, T lo = std::numeric_limits<T>::min(),
         T hi = std::numeric_limits<T>::max(), std::string_view hint = {}) {
  static_assert(std::is_integral_v<T> && sizeof(T) <= 8);
  auto refuse = [&] {
    return py::type_error(what + ": expected an int, got " + TypeName(obj) + " (" + Repr(obj) +
                          ")");
  };
  if (IsBool(obj)) throw refuse();
  auto index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) {
    PyErr_Clear();
    throw refuse();
  }
  int overflow = 0;
  const long long wide = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  bool in_range = false;
  T value{};
  if (overflow == 0 && !(wide == -1 && PyErr_Occurred())) {
    if constexpr (std::is_signed_v<T>) {
      in_range = wide >= static_cast<long long>(lo) && wide <= static_cast<long long>(hi);
    } else {
      in_range = wide >= 0 && static_cast<unsigned long long>(wide) >= lo &&
                 static_cast<unsigned long long>(wide) <= hi;
    }
    value = static_cast<T>(wide);
  } else if constexpr (std::is_unsigned_v<T>) {
    if (overflow > 0) {  // above 2^63: an unsigned 64-bit value may still hold it
      const unsigned long long u = PyLong_AsUnsignedLongLong(index.ptr());
      in_range = !PyErr_Occurred() && u >= lo && u <= hi;
      value = static_cast<T>(u);
    }
  }
  PyErr_Clear();
  if (!in_range) {
    throw py::value_error(what + " = " + py::str(index).cast<std::string>() + " is out of range [" +
                          std::to_string(lo) + ", " + std::to_string(hi) + "]" +
                          (hint.empty() ? "" : ": " + std::string(hint)));
  }
  return value;
}

// As IntArg, with None for "not given".
template <typename T>
std::optional<T> OptionalIntArg(py::handle obj, const std::string& what,
                                T lo = std::numeric_limits<T>::min(),
                                T hi = std::numeric_limits<T>::max()) {
  if (obj.is_none()) return std::nullopt;
  return IntArg<T>(obj, what, lo, hi);
}

// A one-dimensional array of integers from an int, a sequence or any buffer (numpy arrays; the
// Python layer hands torch tensors over as their numpy views). Converted in C++: no Python-level
// loop. Values outside [lo, hi] are refused naming the position, the value and the range
// (ValueError; `hint` follows), and so are booleans and elements that are no integers, and sets
// and mappings, whose order is no list's (TypeError).
std::vector<int64_t> ToInt64s(py::handle obj, const char* what, int64_t lo, int64_t hi,
                              std::string_view hint = {}) {
  if (obj.is_none()) return {};
  auto refuse_type = [&] {
    return py::type_error(std::string(what) + ": expected an int, a list of ints or a " +
                          "one-dimensional integer array, got " + TypeName(obj));
  };
  if (!py::isinstance<py::array>(obj)) {
    const std::string first = std::string(what) + "[0]";
    if (IsBool(obj)) IntArg<int64_t>(obj, first, lo, hi);  // refused, naming the value
    if (PyIndex_Check(obj.ptr()) && !PySequence_Check(obj.ptr())) {
      return {IntArg<int64_t>(obj, first, lo, hi, hint)};  // one id
    }
    if (PyUnicode_Check(obj.ptr()) || PyBytes_Check(obj.ptr()) || PyAnySet_Check(obj.ptr()) ||
        PyDict_Check(obj.ptr())) {
      throw refuse_type();
    }
    if (!PyObject_CheckBuffer(obj.ptr())) {
      // Lists, tuples, ranges and other iterables: each element on its own.
      auto items = py::reinterpret_steal<py::object>(PySequence_Fast(obj.ptr(), ""));
      if (!items) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
          PyErr_Clear();
          throw refuse_type();
        }
        throw py::error_already_set();  // what the sequence itself raised
      }
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(items.ptr());
      PyObject** elements = PySequence_Fast_ITEMS(items.ptr());
      std::vector<int64_t> out(static_cast<size_t>(n));
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* e = elements[i];
        int overflow = 0;
        const long long v = PyLong_CheckExact(e) ? PyLong_AsLongLongAndOverflow(e, &overflow) : 0;
        if (PyLong_CheckExact(e) && overflow == 0 && v >= lo && v <= hi) {
          out[static_cast<size_t>(i)] = v;  // the common case, without building a message
          continue;
        }
        out[static_cast<size_t>(i)] =
            IntArg<int64_t>(e, std::string(what) + "[" + std::to_string(i) + "]", lo, hi, hint);
      }
      return out;
    }
  }
  py::array any = py::array::ensure(obj);
  if (!any) {
    PyErr_Clear();
    throw refuse_type();
  }
  if (any.ndim() != 1) {
    throw py::value_error(std::string(what) + ": expected a one-dimensional array, got " +
                          std::to_string(any.ndim()) + " dimensions; flatten it first");
  }
  if (any.size() == 0) return {};
  const char kind = any.dtype().kind();
  if (kind != 'i' && kind != 'u') {
    throw py::value_error(std::string(what) + ": expected integers, got an array of dtype " +
                          std::string(py::str(any.dtype())) + "; convert it to int32 or int64");
  }
  std::vector<int64_t> out(static_cast<size_t>(any.size()));
  if (kind == 'u' && any.dtype().itemsize() == 8) {
    auto u = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(any);
    const uint64_t* p = u.data();
    for (size_t i = 0; i < out.size(); ++i) {
      if (p[i] > static_cast<uint64_t>(hi)) {
        throw py::value_error(std::string(what) + "[" + std::to_string(i) +
                              "] = " + std::to_string(p[i]) + " is out of range [" +
                              std::to_string(lo) + ", " + std::to_string(hi) + "]" +
                              (hint.empty() ? "" : ": " + std::string(hint)));
      }
      out[i] = static_cast<int64_t>(p[i]);
    }
    return out;
  }
  auto s = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(any);
  const int64_t* p = s.data();
  for (size_t i = 0; i < out.size(); ++i) {
    if (p[i] < lo || p[i] > hi) {
      throw py::value_error(std::string(what) + "[" + std::to_string(i) +
                            "] = " + std::to_string(p[i]) + " is out of range [" +
                            std::to_string(lo) + ", " + std::to_string(hi) + "]" +
                            (hint.empty() ? "" : ": " + std::string(hint)));
    }
    out[i] = p[i];
  }
  return out;
}

// Page ids: int32 as the engine takes them, from 1 (page 0 is the pool's dummy page). Ids past
// the pool's end are the engine's to refuse (it knows the pool); the others are refused here,
// naming the position, the value and the range.
std::vector<int32_t> ToPages(py::handle obj, const char* what) {
  std::vector<int64_t> wide =
      ToInt64s(obj, what, 1, std::numeric_limits<int32_t>::max(),
               "page ids start at 1 (page 0 is the pool's dummy page) and are int32");
  return {wide.begin(), wide.end()};
}

std::vector<uint64_t> ToPointers(py::handle obj, const char* what) {
  std::vector<int64_t> wide = ToInt64s(obj, what, 0, std::numeric_limits<int64_t>::max());
  return {wide.begin(), wide.end()};
}

// Seconds from Python as milliseconds: finite, in [0, 4294967] (49.7 days: the wire carries
// deadlines as 32-bit milliseconds). A positive value under a millisecond is one millisecond,
// not 0 (which means "the default" for deadlines).
std::chrono::milliseconds Millis(double seconds) {
  constexpr double kMaxSeconds = 4294967.0;
  if (!(seconds >= 0) || !(seconds <= kMaxSeconds)) {
    throw py::value_error("a duration of " + std::to_string(seconds) +
                          " seconds is out of range: pass a finite value in [0, 4294967]");
  }
  const auto ms = static_cast<int64_t>(seconds * 1000.0 + 0.5);
  return std::chrono::milliseconds(seconds > 0 && ms == 0 ? 1 : ms);
}

// A busy-poll window given in seconds: at most a second, as the engine takes (checked here too,
// before the conversion to microseconds, and named in seconds as Python callers give it).
std::chrono::microseconds BusyPollMicros(double seconds) {
  static_assert(transfer::kMaxControlBusyPoll == std::chrono::seconds(1),
                "the message below names the engine's limit in seconds");
  if (!(seconds >= 0 && seconds <= 1.0)) {
    throw py::value_error(
        "control_busy_poll = " + py::str(py::float_(seconds)).cast<std::string>() +
        " s: must be in [0, 1] seconds (e.g. 0.001 for 1 ms; 0: the control "
        "threads sleep between messages)");
  }
  return std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6 + 0.5));
}

// Seconds on time.monotonic()'s clock (steady_clock is CLOCK_MONOTONIC on Linux, as is
// Python's monotonic clock); None for a point not reached.
py::object Seconds(std::chrono::steady_clock::time_point t) {
  if (t.time_since_epoch().count() == 0) return py::none();
  return py::float_(std::chrono::duration<double>(t.time_since_epoch()).count());
}

py::dict InfoDict(const transfer::RequestInfo& info) {
  py::dict d;
  d["room"] = info.room;
  d["state"] = static_cast<int>(info.state);
  d["state_name"] = transfer::RequestStateName(info.state);
  d["code"] = std::string(StatusCodeName(info.status.code()));
  d["reason"] = info.status.message();
  d["bytes"] = info.bytes;
  d["layers_posted"] = info.layers_posted;
  d["pages_reusable"] = info.pages_reusable;
  d["created"] = Seconds(info.created);
  d["finished"] = Seconds(info.finished);
  d["request_sent"] = Seconds(info.request_sent);
  d["request_seen"] = Seconds(info.request_seen);
  d["source_ready"] = Seconds(info.source_ready);
  d["first_post"] = Seconds(info.first_post);
  d["last_post"] = Seconds(info.last_post);
  return d;
}

py::dict LayoutDict(const transfer::TransferLayout& layout) {
  py::dict d;
  d["page_size"] = layout.page_size;
  d["num_layers"] = layout.num_layers();
  d["num_buffers"] = layout.num_buffers();
  d["num_pages"] = layout.num_pages();
  d["num_aux_slots"] = layout.num_aux_slots();
  d["device"] = layout.device;
  d["tp_rank"] = layout.tp_rank;
  d["tp_size"] = layout.tp_size;
  py::list groups;
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    const auto& group = layout.groups[g];
    py::dict gd;
    gd["shape"] = transfer::KvShapeName(group.shape);
    gd["num_layers"] = group.num_layers;
    gd["head_num"] = group.head_num;
    gd["head_dim"] = group.head_dim;
    gd["dtype"] = std::string(DTypeName(group.dtype));
    gd["page_bytes"] = layout.page_bytes(g);
    gd["num_buffers"] = group.buffers.size();
    groups.append(gd);
  }
  d["groups"] = groups;
  return d;
}

struct Layout {
  transfer::TransferLayout layout;
};

Layout LayoutFromBufInfos(py::handle ptrs, py::handle lens, py::handle item_lens,
                          py::handle page_size, const std::string& dtype, py::handle head_num,
                          py::handle head_dim, bool latent, py::handle device, py::handle unit_lens,
                          py::handle target_buffers, py::handle draft_head_num,
                          py::handle draft_head_dim, py::handle tp_rank, py::handle tp_size,
                          py::handle total_kv_heads, py::handle aux_ptrs, py::handle aux_lens,
                          py::handle aux_item_lens) {
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  std::vector<uint64_t> p = ToPointers(ptrs, "kv_data_ptrs");
  std::vector<int64_t> l = ToInt64s(lens, "kv_data_lens", 0, kMax);
  std::vector<int64_t> il = ToInt64s(item_lens, "kv_item_lens", 0, kMax);
  std::vector<int64_t> ul = ToInt64s(unit_lens, "unit_lens", 0, kMax);
  std::vector<uint64_t> ap = ToPointers(aux_ptrs, "aux_data_ptrs");
  std::vector<int64_t> al = ToInt64s(aux_lens, "aux_data_lens", 0, kMax);
  std::vector<int64_t> ail = ToInt64s(aux_item_lens, "aux_item_lens", 0, kMax);
  transfer::TransferLayout::BufInfoOptions o;
  o.page_size = IntArg<uint32_t>(page_size, "page_size");
  o.dtype = ValueOrThrow(ParseDType(dtype));
  o.head_num = IntArg<uint32_t>(head_num, "head_num");
  o.head_dim = IntArg<uint32_t>(head_dim, "head_dim");
  o.shape = latent ? transfer::KvShape::kLatent : transfer::KvShape::kKeyValue;
  o.device = IntArg<int32_t>(device, "device", -1, std::numeric_limits<int32_t>::max(),
                             "a CUDA ordinal, or -1 for host memory");
  o.tp_rank = IntArg<uint32_t>(tp_rank, "tp_rank");
  o.tp_size = IntArg<uint32_t>(tp_size, "tp_size");
  o.total_kv_heads = IntArg<uint32_t>(total_kv_heads, "total_kv_heads");
  o.target_buffers = IntArg<size_t>(target_buffers, "target_buffers");
  o.draft_head_num = IntArg<uint32_t>(draft_head_num, "draft_head_num");
  o.draft_head_dim = IntArg<uint32_t>(draft_head_dim, "draft_head_dim");
  o.unit_lens = ul;
  StatusOr<transfer::TransferLayout> layout = [&] {  // Validate walks the memory's mappings
    py::gil_scoped_release release;
    return transfer::TransferLayout::FromBufInfos(p, l, il, o, ap, al, ail);
  }();
  return Layout{ValueOrThrow(std::move(layout))};
}

// The named backend's default options, with UCX's transports when ucx_tls is given.
transfer::BackendConfig BackendConfigFor(const std::string& backend, const std::string& ucx_tls) {
  transfer::BackendConfig config = ValueOrThrow(transfer::DefaultBackendConfig(backend));
  if (!ucx_tls.empty()) {
    auto* ucx = std::get_if<transfer::UcxOptions>(&config);
    if (ucx == nullptr) {
      throw py::value_error("ucx_tls='" + ucx_tls + "' applies to backend='ucx' only, not '" +
                            backend + "'; drop ucx_tls or use backend='ucx'");
    }
    ucx->transports = ucx_tls;
  }
  return config;
}

// The engine, closable before the Python object goes away (destruction waits for threads and
// quiesces writes, so it runs without the GIL).
class Engine {
 public:
  Engine(const Layout& layout, bool prefill, const std::string& backend, const std::string& ucx_tls,
         const std::string& name, const std::string& bind, py::handle port,
         const std::string& cluster_token, double deadline, double hello_timeout,
         double peer_timeout, double heartbeat_interval, double retention, double control_busy_poll,
         bool control_lanes, py::object keepalive)
      : keepalive_(std::move(keepalive)) {
    transfer::EngineOptions o;
    o.name = name;
    o.prefill = prefill;
    o.backend = BackendConfigFor(backend, ucx_tls);
    o.server.bind_address = bind;
    o.server.port = IntArg<uint16_t>(port, "port");
    o.server.cluster_token = cluster_token;
    o.cluster_token = cluster_token;
    o.default_deadline = Millis(deadline);
    o.hello_timeout = Millis(hello_timeout);
    o.peer_timeout = Millis(peer_timeout);
    o.heartbeat_interval = Millis(heartbeat_interval);
    o.retention = Millis(retention);
    o.control_busy_poll = BusyPollMicros(control_busy_poll);
    o.control_lanes = control_lanes;
    // Each slice of a wait may spin for the busy-poll window first: slices of at least 50
    // windows keep that under 2% of a waiting thread's time.
    wait_slice_ =
        std::max(kWaitSlice,
                 std::chrono::duration_cast<std::chrono::milliseconds>(50 * o.control_busy_poll));
    StatusOr<std::unique_ptr<transfer::TransferEngine>> engine = [&] {
      py::gil_scoped_release release;
      return transfer::TransferEngine::Create(o, layout.layout);
    }();
    engine_ = ValueOrThrow(std::move(engine));
  }
  ~Engine() { DestroyWithoutGil(engine_); }

  void Close() {
    CloseShared<transfer::TransferEngine>(engine_, closing_, close_mu_,
                                          [](transfer::TransferEngine& e) { e.Interrupt(); });
    keepalive_ = py::none();  // the engine is gone: the layout and events may go too
  }
  bool closed() const { return engine_ == nullptr; }

  // For calls that keep the GIL.
  transfer::TransferEngine& get() const { return *hold(); }
  // For calls that release the GIL: the reference keeps the engine alive through a close() on
  // another thread.
  std::shared_ptr<transfer::TransferEngine> hold() const {
    if (engine_ == nullptr) {
      throw py::value_error("the engine is closed; create a new TransferEngine");
    }
    return engine_;
  }

  uint16_t port() const { return get().port(); }
  std::string backend_name() const { return std::string(get().backend_name()); }
  // No reference to the engine is held while Python objects are made (converting arguments,
  // building the dicts returned): making them may run Python code (a collection's finalisers)
  // that closes the engine on this very thread, and that close waits for every reference.
  py::dict layout() const {
    const transfer::TransferLayout copy = [&] { return hold()->layout(); }();
    return LayoutDict(copy);
  }

  uint64_t Connect(const std::string& host, py::handle port_arg) {
    const uint16_t port =
        IntArg<uint16_t>(port_arg, "port", 1, 65535, "the prefill engine's engine.port");
    const auto held = hold();
    auto& e = *held;
    StatusOr<transfer::PeerHandle> peer = [&] {
      py::gil_scoped_release release;
      return e.ConnectPeer(host, port);
    }();
    if (!peer.ok() && closing_.load(std::memory_order_acquire)) {
      throw py::value_error("the engine was closed while connecting to " + host + ":" +
                            std::to_string(port));
    }
    return ValueOrThrow(std::move(peer));
  }

  void Receive(const std::string& room, py::handle peer_arg, py::handle pages, double deadline,
               py::handle layer_begin, py::handle layer_end, py::handle aux_slot) {
    const auto peer = IntArg<uint64_t>(peer_arg, "peer", 0, std::numeric_limits<uint64_t>::max(),
                                       "pass what connect() returned");
    transfer::ReceiveOptions o;
    o.deadline = Millis(deadline);
    o.layer_begin =
        IntArg<int32_t>(layer_begin, "layers (begin)", 0, std::numeric_limits<int32_t>::max());
    o.layer_end = IntArg<int32_t>(layer_end, "layers (end)", -1,
                                  std::numeric_limits<int32_t>::max(), "-1: every layer");
    o.aux_slot = IntArg<int64_t>(aux_slot, "aux_slot", -1, std::numeric_limits<int64_t>::max(),
                                 "-1: no aux data");
    std::vector<int32_t> dst = ToPages(pages, "dst_pages");
    const auto held = hold();
    auto& e = *held;
    py::gil_scoped_release release;
    ThrowIfError(e.Receive(room, peer, std::move(dst), o), room);
  }

  void Send(const std::string& room, py::handle pages, double deadline, bool last,
            py::handle aux_slot) {
    transfer::SendOptions o;
    o.deadline = Millis(deadline);
    o.last = last;
    o.aux_slot = IntArg<int64_t>(aux_slot, "aux_slot", -1, std::numeric_limits<int64_t>::max(),
                                 "-1: no aux data");
    std::vector<int32_t> src = ToPages(pages, "src_pages");
    const auto held = hold();
    auto& e = *held;
    py::gil_scoped_release release;
    ThrowIfError(e.Send(room, std::move(src), o), room);
  }

  void LayersReady(const std::string& room, py::handle layers_arg, py::handle event_arg) {
    const auto layers_done =
        IntArg<int32_t>(layers_arg, "n", 0, std::numeric_limits<int32_t>::max(),
                        "layers [0, n) of the room are written");
    const auto event =
        IntArg<uintptr_t>(event_arg, "event", 0, std::numeric_limits<uintptr_t>::max(),
                          "a cudaEvent_t handle, 0 for none");
    const auto held = hold();
    auto& e = *held;
    py::gil_scoped_release release;
    ThrowIfError(e.LayersReady(room, layers_done, reinterpret_cast<cudaEvent_t>(event)), room);
  }

  py::dict Get(const std::string& room) const {
    StatusOr<transfer::RequestInfo> info = [&] {
      const auto held = hold();
      py::gil_scoped_release release;
      return held->GetRequest(room);
    }();
    return InfoDict(ValueOrThrow(std::move(info), room));
  }

  // The info once final; None when `timeout` passed first. Between slices, with the GIL and
  // without a reference to the engine, the wait runs Python's signal handlers (on the main
  // thread: Ctrl-C, a SIGTERM handler, which may close the engine) and raises their exception.
  py::object Wait(const std::string& room, double timeout) const {
    const std::chrono::milliseconds limit = Millis(timeout);
    const auto until = std::chrono::steady_clock::now() + limit;
    auto closed = [&] {
      return py::value_error("the engine was closed while waiting for room '" + room + "'");
    };
    while (true) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - std::chrono::steady_clock::now());
      StatusOr<transfer::RequestInfo> r = [&] {
        const auto held = hold();
        py::gil_scoped_release release;
        return held->WaitRequest(room, std::clamp(left, std::chrono::milliseconds(0), wait_slice_));
      }();
      const bool timed_out = !r.ok() && r.status().code() == StatusCode::kDeadlineExceeded;
      // A close() interrupts the engine's waits (TransferEngine::Interrupt) or, between two
      // slices, ends this one.
      if (!r.ok() && closing_.load(std::memory_order_acquire)) throw closed();
      if (!timed_out) return InfoDict(ValueOrThrow(std::move(r), room));
      if (left <= wait_slice_) return py::none();
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      if (closing_.load(std::memory_order_acquire)) throw closed();
    }
  }

  void Abort(const std::string& room, const std::string& reason) {
    const auto held = hold();
    auto& e = *held;
    py::gil_scoped_release release;
    ThrowIfError(e.Abort(room, reason), room);
  }

  void Forget(const std::string& room) {
    const auto held = hold();
    auto& e = *held;
    py::gil_scoped_release release;
    ThrowIfError(e.Forget(room), room);
  }

  py::dict Stats() const {
    transfer::EngineStats s = get().stats();
    py::dict d;
    d["requests_succeeded"] = s.requests_succeeded;
    d["requests_failed"] = s.requests_failed;
    d["bytes"] = s.bytes;
    d["writes_posted"] = s.writes_posted;
    d["runs_posted"] = s.runs_posted;
    d["control_lanes"] = s.control_lanes;
    d["poller_hot_spins"] = s.poller_hot_spins;
    return d;
  }

 private:
  // What the engine uses that Python owns (the layout's tensors, the events kept for rooms):
  // declared before the engine, so it is released after the engine is destroyed.
  py::object keepalive_;
  std::shared_ptr<transfer::TransferEngine> engine_;
  std::atomic<bool> closing_{false};
  std::mutex close_mu_;  // held by the close() that destroys the engine; a second one waits
  std::chrono::milliseconds wait_slice_ = kWaitSlice;
};

transfer::AgentRole ParseRole(const std::string& role) {
  if (role == "any") return transfer::AgentRole::kAny;
  if (role == "prefill") return transfer::AgentRole::kPrefill;
  if (role == "decode") return transfer::AgentRole::kDecode;
  if (role == "tool") return transfer::AgentRole::kTool;
  throw py::value_error("role='" + role + "' is not a role; use 'prefill', 'decode' or 'any'");
}

py::dict EntryDict(const transfer::AgentEntry& entry) {
  py::dict d;
  d["name"] = entry.name;
  d["role"] = transfer::AgentRoleName(entry.role);
  d["tp_rank"] = entry.tp_rank;
  d["tp_size"] = entry.tp_size;
  d["control_address"] = entry.control_address;
  d["host_id"] = entry.host_id;
  if (entry.layout) {
    py::dict l;
    l["num_layers"] = entry.layout->num_layers;
    l["page_size"] = entry.layout->page_size;
    l["dtype"] = std::string(DTypeName(entry.layout->dtype));
    l["head_num"] = entry.layout->head_num;
    l["head_dim"] = entry.layout->head_dim;
    l["num_pages"] = entry.layout->num_pages;
    l["aux_slots"] = entry.layout->aux_slots;
    d["layout"] = l;
  } else {
    d["layout"] = py::none();
  }
  return d;
}

transfer::RegistryClientOptions ClientOptions(const std::string& host, uint16_t port,
                                              const std::string& client_id,
                                              const std::string& cluster_token, double timeout,
                                              transfer::AgentRole role) {
  transfer::RegistryClientOptions o;
  o.host = host;
  o.port = port;
  o.client_id = client_id;
  o.cluster_token = cluster_token;
  o.timeout = Millis(timeout);
  o.role = role;
  return o;
}

py::list RegistryLookup(const std::string& host, py::handle port, const std::string& client_id,
                        const std::string& cluster_token, double timeout, const std::string& name,
                        const std::string& role, py::handle tp_rank_arg) {
  auto o = ClientOptions(host, IntArg<uint16_t>(port, "port", 1, 65535), client_id, cluster_token,
                         timeout, transfer::AgentRole::kTool);
  const std::optional<uint32_t> tp_rank = OptionalIntArg<uint32_t>(tp_rank_arg, "tp_rank");
  transfer::AgentRole filter = ParseRole(role);
  StatusOr<std::vector<transfer::AgentEntry>> entries = [&] {
    py::gil_scoped_release release;
    return transfer::RegistryClient::Lookup(o, name, filter, tp_rank);
  }();
  py::list out;
  for (const auto& e : ValueOrThrow(std::move(entries))) out.append(EntryDict(e));
  return out;
}

// A registration kept fresh by a background thread until closed; closing (or collecting) it
// unregisters (RegistryClient's destructor).
class Announcement {
 public:
  Announcement(const std::string& host, py::handle port, const std::string& cluster_token,
               double timeout, const std::string& name, const std::string& role,
               const std::string& control_address, py::handle tp_rank, py::handle tp_size,
               const std::string& host_id) {
    transfer::AgentEntry self;
    self.name = name;
    self.role = ParseRole(role);
    self.tp_rank = IntArg<uint32_t>(tp_rank, "tp_rank");
    self.tp_size = IntArg<uint32_t>(tp_size, "tp_size", 1);
    self.control_address = control_address;
    self.host_id = host_id;
    auto o = ClientOptions(host, IntArg<uint16_t>(port, "port", 1, 65535), name, cluster_token,
                           timeout, self.role);
    o.unregister_timeout = o.timeout;  // close() waits for the registry as long as any call
    StatusOr<std::unique_ptr<transfer::RegistryClient>> client = [&] {
      py::gil_scoped_release release;
      return transfer::RegistryClient::Start(o, self);
    }();
    client_ = ValueOrThrow(std::move(client));
  }
  ~Announcement() {
    if (client_ != nullptr && PyGILState_Check() && !Finalizing()) {
      py::gil_scoped_release release;
      client_.reset();
    }
  }
  void Close() {
    auto client = std::move(client_);
    py::gil_scoped_release release;
    client.reset();
  }
  uint64_t refreshes() const { return client_ ? client_->refreshes() : 0; }

 private:
  std::unique_ptr<transfer::RegistryClient> client_;
};

// Raw memory regions written by copy runs: the native half of kvt.compat.mooncake. One
// instance is one backend with one registration (regions are never re-registered: a new set
// of regions gets a new instance, so the descriptors peers hold stay valid).
class RegionWriter {
 public:
  RegionWriter(const std::string& backend, const std::string& ucx_tls) {
    const transfer::BackendConfig config = BackendConfigFor(backend, ucx_tls);
    StatusOr<std::unique_ptr<transfer::Backend>> created = [&] {
      py::gil_scoped_release release;
      return transfer::CreateBackend(config);
    }();
    backend_ = ValueOrThrow(std::move(created));
    if (backend_->Capabilities().two_sided) {
      throw py::value_error("backend '" + backend +
                            "' needs the receiver to take part in every transfer; raw region "
                            "writes need a one-sided backend (ucx, cuda_ipc or loopback)");
    }
    std::shared_ptr<State> state = state_;
    backend_->SetCompletionNotifier([state] {
      std::lock_guard<std::mutex> lock(state->mu);
      ++state->epoch;
      state->cv.notify_all();
    });
  }
  ~RegionWriter() { DestroyWithoutGil(backend_); }

  void Close() { CloseShared(backend_, closing_, close_mu_); }

  std::string name() const { return std::string(hold()->Name()); }

  // Registers the regions (base, length, device: -1 host, else the CUDA ordinal) once; returns
  // what a peer needs to connect: (backend, address, [(base, length, key)]).
  py::tuple Register(py::handle bases, py::handle lengths, py::handle devices) {
    std::vector<uint64_t> b = ToPointers(bases, "region bases");
    std::vector<int64_t> l =
        ToInt64s(lengths, "region lengths", 1, std::numeric_limits<int64_t>::max());
    std::vector<int64_t> d = ToInt64s(devices, "region devices", -1, 1 << 20);
    if (l.size() != b.size() || d.size() != b.size()) {
      throw py::value_error(std::to_string(b.size()) + " region bases but " +
                            std::to_string(l.size()) + " lengths and " + std::to_string(d.size()) +
                            " devices; pass one of each per region");
    }
    std::vector<transfer::LocalRegion> regions(b.size());
    for (size_t i = 0; i < b.size(); ++i) {
      regions[i].base = b[i];
      regions[i].length = static_cast<uint64_t>(l[i]);
      regions[i].item_len = static_cast<uint64_t>(l[i]);  // runs address it, not pages
      regions[i].kind = d[i] < 0 ? transfer::MemoryKind::kHost : transfer::MemoryKind::kCuda;
      regions[i].device = static_cast<int32_t>(d[i]);
    }
    // No reference to the backend is held while the tuples are made (as in the engine's calls).
    StatusOr<transfer::PeerDescriptor> registered = [&] {
      const auto backend = hold();
      py::gil_scoped_release release;
      return backend->Register(regions);
    }();
    transfer::PeerDescriptor descriptor = ValueOrThrow(std::move(registered));
    py::list out;
    for (const transfer::RemoteRegion& r : descriptor.regions) {
      out.append(py::make_tuple(r.base, r.length, py::bytes(r.key)));
    }
    return py::make_tuple(descriptor.backend, py::bytes(descriptor.address), out);
  }

  // Connects a peer's registration (what its Register returned); returns the peer id. The
  // backend checks the address and keys before using them (a peer may lie).
  uint64_t Connect(const std::string& backend, const std::string& address,
                   const py::list& regions) {
    const auto field = [](size_t i, const char* name) {
      return "peer region " + std::to_string(i) + " " + name;
    };
    transfer::PeerDescriptor peer;
    peer.backend = backend;
    peer.address = address;
    for (size_t i = 0; i < regions.size(); ++i) {
      auto t = regions[i].cast<py::tuple>();
      if (t.size() != 3) {
        throw py::value_error("peer region " + std::to_string(i) + " has " +
                              std::to_string(t.size()) + " fields; expected (base, length, key)");
      }
      transfer::RemoteRegion r;
      r.base = IntArg<uint64_t>(t[0], field(i, "base"));
      r.length = IntArg<uint64_t>(t[1], field(i, "length"));
      r.item_len = r.length;
      r.key = t[2].cast<std::string>();
      peer.regions.push_back(std::move(r));
    }
    const auto own = hold();
    py::gil_scoped_release release;
    return ValueOrThrow(own->Connect(peer));
  }

  void Disconnect(py::handle peer_arg) {
    const auto peer = IntArg<uint64_t>(peer_arg, "peer");
    const auto backend = hold();
    py::gil_scoped_release release;
    ThrowIfError(backend->Disconnect(peer));
  }

  // Writes the runs (rows of [local region, peer region, src offset, dst offset, bytes]) and
  // returns once every byte is visible at the peer; DeadlineExceeded after `timeout` seconds.
  void Write(py::handle peer_arg,
             const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& rows,
             double timeout) {
    const auto peer = IntArg<uint64_t>(peer_arg, "peer");
    if (rows.ndim() != 2 || rows.shape(1) != 5) {
      throw py::value_error(
          "runs must be an N x 5 array of [local region, peer region, src offset, dst offset, "
          "bytes], got " +
          std::to_string(rows.ndim()) + " dimensions" +
          (rows.ndim() == 2 ? " of " + std::to_string(rows.shape(1)) + " columns" : std::string()));
    }
    const auto n = static_cast<size_t>(rows.shape(0));
    std::vector<transfer::CopyRun> runs(n);
    const uint64_t* r = rows.data();
    for (size_t i = 0; i < n; ++i, r += 5) {
      if (r[0] >= transfer::kSameBuffer || r[1] >= transfer::kSameBuffer) {
        throw py::value_error("run " + std::to_string(i) + " names region " +
                              std::to_string(std::max(r[0], r[1])) + ", past any registration");
      }
      runs[i] = transfer::CopyRun{static_cast<uint32_t>(r[0]), r[2], r[3], r[4],
                                  static_cast<uint32_t>(r[1])};
    }
    const std::chrono::milliseconds limit = Millis(timeout);
    const auto held = hold();
    transfer::Backend& backend = *held;
    py::gil_scoped_release release;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    const transfer::WriteId id = ValueOrThrow(backend.PostWrite(peer, runs));
    std::chrono::microseconds pause = 20us;
    Status status;
    while (true) {
      std::unique_lock<std::mutex> lock(state_->mu);
      const uint64_t epoch = state_->epoch;  // read before Check: a completion after it wakes us
      lock.unlock();
      status = backend.Check(id);
      if (status.code() != StatusCode::kInProgress) break;
      if (closing_.load(std::memory_order_acquire)) {
        backend.Release(id);  // waits for what cannot be cancelled
        ThrowIfError(Aborted("the region writer was closed during the write of " +
                             std::to_string(n) + " runs; the write was released"));
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        backend.Release(id);  // waits for what cannot be cancelled
        ThrowIfError(DeadlineExceeded("the write of " + std::to_string(n) +
                                      " runs did not complete in " + std::to_string(timeout) +
                                      " s; check the peer, or raise the timeout"));
      }
      lock.lock();
      // Backends that notify wake the wait; the bounded pause covers those that do not.
      state_->cv.wait_for(lock, pause, [&] { return state_->epoch != epoch; });
      pause = std::min<std::chrono::microseconds>(pause * 2, 1ms);
    }
    backend.Release(id);
    ThrowIfError(status);
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t epoch = 0;
  };

  // The backend, held through a close() on another thread (calls release the GIL).
  std::shared_ptr<transfer::Backend> hold() const {
    if (backend_ == nullptr) {
      throw py::value_error("the region writer is closed; create a new one");
    }
    return backend_;
  }

  std::shared_ptr<State> state_ = std::make_shared<State>();
  std::shared_ptr<transfer::Backend> backend_;
  std::atomic<bool> closing_{false};
  std::mutex close_mu_;  // held by the close() that destroys the backend; a second one waits
};

// Where a pointer lives: -1 for host memory (pageable or pinned), else its CUDA device ordinal.
// Managed memory is refused (no backend moves it), naming the pointer.
int32_t PointerDevice(py::handle pointer_arg) {
  const auto pointer = IntArg<uint64_t>(pointer_arg, "pointer");
  cudaPointerAttributes attributes{};
  const cudaError_t err =
      cudaPointerGetAttributes(&attributes, reinterpret_cast<const void*>(pointer));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // no CUDA here: host memory
    return -1;
  }
  if (attributes.type == cudaMemoryTypeManaged) {
    throw py::value_error("pointer " + std::to_string(pointer) +
                          " is CUDA managed memory, which no backend moves; allocate the "
                          "buffer with cudaMalloc (a torch CUDA tensor) or on the host");
  }
  return attributes.type == cudaMemoryTypeDevice ? attributes.device : -1;
}

}  // namespace
}  // namespace kvt::python

using namespace kvt::python;  // NOLINT: the module body below binds this file's classes
namespace transfer = kvt::transfer;
using kvt::DTypeName;
using kvt::ItemSize;
using kvt::ParseDType;
using kvt::StatusCodeName;

PYBIND11_MODULE(_kvt, m) {
  m.doc() = "kvt's C++ layer; use the kvt package, not this module.";

  // Status -> exception through kvt._errors (imported lazily: it imports nothing from here).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object errors = py::module_::import("kvt._errors");
      py::object exc = errors.attr("from_status")(std::string(StatusCodeName(e.status.code())),
                                                  e.status.message(), e.room);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::class_<Layout>(m, "Layout")
      .def_static("from_buf_infos", &LayoutFromBufInfos, py::arg("ptrs"), py::arg("lens"),
                  py::arg("item_lens"), py::arg("page_size"), py::arg("dtype"), py::arg("head_num"),
                  py::arg("head_dim"), py::arg("latent"), py::arg("device"), py::arg("unit_lens"),
                  py::arg("target_buffers"), py::arg("draft_head_num"), py::arg("draft_head_dim"),
                  py::arg("tp_rank"), py::arg("tp_size"), py::arg("total_kv_heads"),
                  py::arg("aux_ptrs"), py::arg("aux_lens"), py::arg("aux_item_lens"))
      .def("describe", [](const Layout& l) { return l.layout.Describe(); })
      .def("summary", [](const Layout& l) { return LayoutDict(l.layout); });

  py::class_<Engine>(m, "Engine")
      .def(py::init<const Layout&, bool, const std::string&, const std::string&, const std::string&,
                    const std::string&, py::handle, const std::string&, double, double, double,
                    double, double, double, bool, py::object>(),
           py::arg("layout"), py::arg("prefill"), py::arg("backend"), py::arg("ucx_tls"),
           py::arg("name"), py::arg("bind"), py::arg("port"), py::arg("cluster_token"),
           py::arg("deadline"), py::arg("hello_timeout"), py::arg("peer_timeout"),
           py::arg("heartbeat_interval"), py::arg("retention"), py::arg("control_busy_poll"),
           py::arg("control_lanes"), py::arg("keepalive") = py::none())
      .def("close", &Engine::Close)
      .def_property_readonly("closed", &Engine::closed)
      .def_property_readonly("port", &Engine::port)
      .def_property_readonly("backend_name", &Engine::backend_name)
      .def("layout", &Engine::layout)
      .def("connect", &Engine::Connect)
      .def("receive", &Engine::Receive)
      .def("send", &Engine::Send)
      .def("layers_ready", &Engine::LayersReady)
      .def("get", &Engine::Get)
      .def("wait", &Engine::Wait)
      .def("abort", &Engine::Abort)
      .def("forget", &Engine::Forget)
      .def("stats", &Engine::Stats);

  m.def("registry_lookup", &RegistryLookup);
  py::class_<Announcement>(m, "Announcement")
      .def(py::init<const std::string&, py::handle, const std::string&, double, const std::string&,
                    const std::string&, const std::string&, py::handle, py::handle,
                    const std::string&>())
      .def("close", &Announcement::Close)
      .def_property_readonly("refreshes", &Announcement::refreshes);

  py::class_<RegionWriter>(m, "RegionWriter")
      .def(py::init<const std::string&, const std::string&>(), py::arg("backend"),
           py::arg("ucx_tls"))
      .def("close", &RegionWriter::Close)
      .def_property_readonly("name", &RegionWriter::name)
      .def("register", &RegionWriter::Register, py::arg("bases"), py::arg("lengths"),
           py::arg("devices"))
      .def("connect", &RegionWriter::Connect, py::arg("backend"), py::arg("address"),
           py::arg("regions"))
      .def("disconnect", &RegionWriter::Disconnect, py::arg("peer"))
      .def("write", &RegionWriter::Write, py::arg("peer"), py::arg("runs"), py::arg("timeout"));
  m.def("pointer_device", &PointerDevice, py::arg("pointer"));

  m.def("backend_names", [] { return transfer::BackendNames(); });
  m.def("dtype_itemsize",
        [](const std::string& name) { return ItemSize(ValueOrThrow(ParseDType(name))); });
  m.def("dtype_name", [](const std::string& name) {
    return std::string(DTypeName(ValueOrThrow(ParseDType(name))));
  });
}
