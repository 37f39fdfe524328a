#include "backends/ucx/ucx_util.h"

#include <cstdlib>

#include "kvt/common/log.h"

namespace kvt::transfer {

Status UcsStatus(ucs_status_t status, const std::string& what) {
  if (status == UCS_OK) return OkStatus();
  std::string message = what + ": " + ucs_status_string(status);
  switch (status) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return ResourceExhausted(message);
    case UCS_ERR_CANCELED:
      return Aborted(message);
    case UCS_ERR_TIMED_OUT:
      return DeadlineExceeded(message);
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
      return Unavailable(message);
    case UCS_ERR_INVALID_PARAM:
      return InvalidArgument(message);
    case UCS_ERR_UNSUPPORTED:
      return Unimplemented(message);
    default:
      return Internal(message);
  }
}

namespace {

// UCX's tcp transport defaults (8 KiB send segments, socket buffers left to the kernel) are made
// for small messages; KV runs of 32-128 KiB move several times faster with 64 KiB send and
// 256 KiB receive segments and 4 MiB socket buffers (docs/performance.md). Applied unless the
// environment sets the variable (a ucx.conf setting is overridden). ucp_config_modify keeps a
// name it does not know at the UCP level and applies it to every transport whose table has it
// without its prefix (TCP_TX_SEG_SIZE is the tcp table's TX_SEG_SIZE); in UCX 1.13.1
// (`ucx_info -c -f`) only tcp and its connection manager (socket buffers, where 4 MiB is as
// right) have these names. Measured effect, not the return code, shows it took: current UCX
// returns UCS_OK for any name.
void ApplyTcpTuning(ucp_config_t* config) {
  struct Setting {
    const char* env;  // what a user would set
    const char* key;  // the transport table's name
    const char* value;
  };
  static constexpr Setting kTuning[] = {
      {"UCX_TCP_TX_SEG_SIZE", "TX_SEG_SIZE", "64K"},
      {"UCX_TCP_RX_SEG_SIZE", "RX_SEG_SIZE", "256K"},
      {"UCX_TCP_SNDBUF", "SNDBUF", "4M"},
      {"UCX_TCP_RCVBUF", "RCVBUF", "4M"},
  };
  for (const Setting& s : kTuning) {
    if (std::getenv(s.env) != nullptr) continue;
    const ucs_status_t st = ucp_config_modify(config, s.key, s.value);
    if (st != UCS_OK) {
      KVT_LOG_DEBUG("ucx", "UCX does not take {}={} ({}); left at its default", s.env, s.value,
                    ucs_status_string(st));
    }
  }
}

// Whether a UCX_TLS-style list lets UCX pick tcp: empty (UCX's choice or the UCX_TLS
// environment variable), "all", an exclusion list ("^..."), or a list naming tcp.
bool TransportsMayIncludeTcp(const std::string& transports) {
  std::string list = transports;
  if (list.empty()) {
    const char* env = std::getenv("UCX_TLS");
    if (env == nullptr) return true;
    list = env;
  }
  return list.empty() || list[0] == '^' || list.find("all") != std::string::npos ||
         list.find("tcp") != std::string::npos;
}

}  // namespace

StatusOr<ucp_config_t*> ReadUcpConfig(const std::string& transports) {
  ucp_config_t* config = nullptr;
  KVT_RETURN_IF_ERROR(UcsStatus(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read"));
  if (!transports.empty()) {
    const ucs_status_t st = ucp_config_modify(config, "TLS", transports.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return InvalidArgument("UCX transports '" + transports +
                             "' rejected: " + ucs_status_string(st) +
                             "; use UCX_TLS syntax such as 'shm,self' or 'tcp'");
    }
  }
  // Only where tcp may be chosen: UCX 1.16 warns about "invalid configurations" when the
  // tuned transport is not among those allowed (e.g. "shm,self").
  if (TransportsMayIncludeTcp(transports)) ApplyTcpTuning(config);
  return config;
}

ucs_status_t RkeyPtrRange(ucp_rkey_h rkey, uint64_t base, uint64_t length, uint8_t** local) {
  void* first = nullptr;
  void* last = nullptr;
  const ucs_status_t st = ucp_rkey_ptr(rkey, base, &first);
  if (st != UCS_OK) return st;
  if (ucp_rkey_ptr(rkey, base + length - 1, &last) != UCS_OK ||
      reinterpret_cast<uintptr_t>(last) - reinterpret_cast<uintptr_t>(first) != length - 1) {
    return UCS_ERR_OUT_OF_RANGE;
  }
  *local = static_cast<uint8_t*>(first);
  return UCS_OK;
}

void DrainWorker(ucp_worker_h worker, std::chrono::milliseconds quiet,
                 std::chrono::milliseconds bound) {
  using Clock = std::chrono::steady_clock;
  const auto give_up = Clock::now() + bound;
  auto last_work = Clock::now();
  for (auto now = last_work; now < give_up && now - last_work < quiet; now = Clock::now()) {
    if (ucp_worker_progress(worker) != 0) last_work = Clock::now();
  }
}

}  // namespace kvt::transfer
