// kvt_embed: how a serving engine embeds kvt. The engine owns its KV memory (here: one buffer
// per layer's K and one per layer's V, from malloc on the host or plain cudaMalloc on a GPU;
// never kvt's pool), describes it the way the reference pool's get_contiguous_buf_infos() does
// (pointers, buffer bytes, page bytes; K of every layer, then V), and hands that to kvt as a
// TransferLayout. A prefill process and a decode process then move random requests:
//
//   decode   Receive(room, peer, dst_pages)          the pages it reserved, in token order
//   prefill  Send(room, src_pages)                   the request's pages, in token order
//            write layer l; LayersReady(room, l + 1)  layer by layer, as a forward pass would
//   decode   WaitRequest(room) -> Success            then reads the pages
//
// Every source page is filled with a pattern derived from (request, source page, layer, K or V);
// the decode side checks every byte of every requested page, and that every page no request
// wrote (page 0, the pages not yet requested) still holds what it held before.
//
//   kvt_embed [options]                              the two roles as child processes
//   kvt_embed --role prefill [--bind A] [--port P]   one role by hand (e.g. on two hosts: both
//   kvt_embed --role decode --connect HOST:P         need the same --seed and sizes, and the
//                                                    same KVT_CLUSTER_TOKEN off loopback)
//
// Exits 0 when every request arrived intact; otherwise prints what differed and exits 1.
#include <cuda_runtime_api.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/transfer/engine.h"
#include "kvt/transfer/layout.h"

extern char** environ;

namespace {

namespace xfer = kvt::transfer;
using namespace std::chrono_literals;

struct Options {
  std::string role;                // "", "prefill" or "decode"
  std::string connect;             // decode: HOST:PORT of the prefill process
  std::string bind = "127.0.0.1";  // prefill: address to listen on
  uint16_t port = 0;               // prefill: control port (0: the kernel picks)
  int report_fd = -1;              // prefill: writes its port here (set by the launcher)
  int linger_ms = 5000;            // prefill by hand: how long it stays up after its last request
  int wait_fd = -1;        // prefill: waits for EOF here before it exits (set by the launcher)
  int device = -1;         // CUDA device of the KV buffers; -1: host memory
  std::string backend;     // "ucx" or "cuda_ipc"; empty: ucx on the host, cuda_ipc on a GPU
  std::string transports;  // ucx: UCX transports (UCX_TLS syntax); empty: UCX's choice
  int requests = 64;
  int window = 4;  // requests in flight at once
  int max_request_pages = 12;
  uint32_t pages = 128;  // pages a buffer holds, the dummy page 0 included
  uint32_t layers = 4;
  uint32_t page_size = 16;
  uint32_t head_num = 2;
  uint32_t head_dim = 64;
  uint64_t seed = 1;
};

void Usage() {
  std::fprintf(stderr,
               "usage: kvt_embed [--device N] [--backend ucx|cuda_ipc] [--transports TLS]\n"
               "                 [--requests N] [--window N] [--max-request-pages N] [--pages N]\n"
               "                 [--layers N] [--page-size N] [--heads N] [--head-dim N] "
               "[--seed N]\n"
               "                 [--role prefill [--bind ADDR] [--port P] [--linger-ms MS] |\n"
               "                  --role decode --connect HOST:P]\n"
               "Moves random requests between a prefill and a decode process through kvt and\n"
               "verifies every byte. Host memory (malloc) unless --device names a CUDA device\n"
               "(cudaMalloc). Without --role it runs both roles as child processes.\n"
               "Peers authenticate with KVT_CLUSTER_TOKEN when it is set (required to listen\n"
               "on an address other than loopback).\n");
}

// Parses argv into `o`; prints what is wrong and returns false on a bad flag or value.
bool ParseArgs(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      Usage();
      std::exit(0);
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "kvt_embed: %s needs a value (see --help)\n", flag.c_str());
      return false;
    }
    const std::string value = argv[++i];
    auto number = [&](uint64_t min, uint64_t max) -> std::optional<uint64_t> {
      char* end = nullptr;
      errno = 0;
      const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
      if (value.empty() || value[0] == '-' || *end != '\0' || errno != 0 || v < min || v > max) {
        std::fprintf(stderr, "kvt_embed: %s '%s' is not a whole number in [%llu, %llu]\n",
                     flag.c_str(), value.c_str(), static_cast<unsigned long long>(min),
                     static_cast<unsigned long long>(max));
        return std::nullopt;
      }
      return v;
    };
    std::optional<uint64_t> v;
    if (flag == "--role") {
      if (value != "prefill" && value != "decode") {
        std::fprintf(stderr, "kvt_embed: --role '%s' is neither prefill nor decode\n",
                     value.c_str());
        return false;
      }
      o.role = value;
    } else if (flag == "--bind") {
      o.bind = value;
    } else if (flag == "--connect") {
      o.connect = value;
    } else if (flag == "--backend") {
      if (value != "ucx" && value != "cuda_ipc") {
        std::fprintf(stderr, "kvt_embed: --backend '%s' is neither ucx nor cuda_ipc\n",
                     value.c_str());
        return false;
      }
      o.backend = value;
    } else if (flag == "--transports") {
      o.transports = value;
    } else if (flag == "--port") {
      if (!(v = number(0, 65535))) return false;
      o.port = static_cast<uint16_t>(*v);
    } else if (flag == "--report-fd") {
      if (!(v = number(0, 1 << 20))) return false;
      o.report_fd = static_cast<int>(*v);
    } else if (flag == "--wait-fd") {
      if (!(v = number(0, 1 << 20))) return false;
      o.wait_fd = static_cast<int>(*v);
    } else if (flag == "--linger-ms") {
      if (!(v = number(0, 3600000))) return false;
      o.linger_ms = static_cast<int>(*v);
    } else if (flag == "--device") {
      if (!(v = number(0, 1023))) return false;
      o.device = static_cast<int>(*v);
    } else if (flag == "--requests") {
      if (!(v = number(1, 1000000))) return false;
      o.requests = static_cast<int>(*v);
    } else if (flag == "--window") {
      if (!(v = number(1, 256))) return false;
      o.window = static_cast<int>(*v);
    } else if (flag == "--max-request-pages") {
      if (!(v = number(1, 1 << 20))) return false;
      o.max_request_pages = static_cast<int>(*v);
    } else if (flag == "--pages") {
      if (!(v = number(2, 1 << 24))) return false;
      o.pages = static_cast<uint32_t>(*v);
    } else if (flag == "--layers") {
      if (!(v = number(1, 1024))) return false;
      o.layers = static_cast<uint32_t>(*v);
    } else if (flag == "--page-size") {
      if (!(v = number(1, 4096))) return false;
      o.page_size = static_cast<uint32_t>(*v);
    } else if (flag == "--heads") {
      if (!(v = number(1, 1024))) return false;
      o.head_num = static_cast<uint32_t>(*v);
    } else if (flag == "--head-dim") {
      if (!(v = number(1, 4096))) return false;
      o.head_dim = static_cast<uint32_t>(*v);
    } else if (flag == "--seed") {
      if (!(v = number(0, UINT64_MAX))) return false;
      o.seed = *v;
    } else {
      std::fprintf(stderr, "kvt_embed: unknown flag %s (see --help)\n", flag.c_str());
      return false;
    }
  }
  // Every request of a window has pages of its own on each side (page 0 is the dummy page).
  const uint64_t needed = static_cast<uint64_t>(o.window) * o.max_request_pages;
  if (needed > o.pages - 1) {
    std::fprintf(stderr,
                 "kvt_embed: --window %d x --max-request-pages %d = %llu pages in flight, but "
                 "--pages %u leaves %u usable pages (page 0 is the dummy page); raise --pages "
                 "to at least %llu or lower the other two\n",
                 o.window, o.max_request_pages, static_cast<unsigned long long>(needed), o.pages,
                 o.pages - 1, static_cast<unsigned long long>(needed + 1));
    return false;
  }
  if (o.role == "decode" && o.connect.empty()) {
    std::fprintf(stderr, "kvt_embed: --role decode needs --connect HOST:PORT of the prefill\n");
    return false;
  }
  if (o.backend.empty()) o.backend = o.device >= 0 ? "cuda_ipc" : "ucx";
  if (o.backend == "cuda_ipc" && o.device < 0) {
    std::fprintf(stderr,
                 "kvt_embed: --backend cuda_ipc moves CUDA memory; give --device N, or use "
                 "--backend ucx for host memory\n");
    return false;
  }
  return true;
}

// ---- the requests -----------------------------------------------------------------------------

struct Request {
  std::string room;
  std::vector<int32_t> src_pages;  // prefill side, token order
  std::vector<int32_t> dst_pages;  // decode side, token order
};

// The same list in both processes: it depends on the options alone. The requests of one window
// use distinct pages on each side; later windows reuse pages.
std::vector<Request> MakeRequests(const Options& o) {
  std::mt19937_64 rng(o.seed);
  std::vector<int32_t> all(o.pages - 1);
  std::iota(all.begin(), all.end(), 1);
  std::vector<Request> requests(o.requests);
  std::vector<int32_t> src_free, dst_free;
  for (int r = 0; r < o.requests; ++r) {
    if (r % o.window == 0) {
      src_free = all;
      dst_free = all;
      std::shuffle(src_free.begin(), src_free.end(), rng);
      std::shuffle(dst_free.begin(), dst_free.end(), rng);
    }
    const int n = 1 + static_cast<int>(rng() % static_cast<uint64_t>(o.max_request_pages));
    Request& q = requests[r];
    q.room = "embed-" + std::to_string(o.seed) + "-" + std::to_string(r);
    q.src_pages.assign(src_free.end() - n, src_free.end());
    q.dst_pages.assign(dst_free.end() - n, dst_free.end());
    src_free.resize(src_free.size() - n);
    dst_free.resize(dst_free.size() - n);
  }
  return requests;
}

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Word w of request r's source page `page`, buffer `buffer` (K of layer l is buffer l, V of
// layer l is buffer layers + l).
uint64_t SourceWord(int r, int32_t page, uint32_t buffer, size_t w) {
  return Mix((uint64_t{1} << 63) ^ (static_cast<uint64_t>(r) << 40) ^
             (static_cast<uint64_t>(page) << 16) ^ buffer) +
         w * 0xD1B54A32D192ED03ull;
}

// What a decode page holds before any request writes it (never a source pattern: bit 63 clear).
uint64_t UntouchedWord(int32_t page, uint32_t buffer, size_t w) {
  return (Mix((static_cast<uint64_t>(page) << 16) ^ buffer) + w * 0xD1B54A32D192ED03ull) &
         ~(uint64_t{1} << 63);
}

// ---- the engine's own KV memory ---------------------------------------------------------------

// 2 * layers buffers (K of layers 0..L-1, then V), `pages` pages of item_len bytes each, from
// malloc or cudaMalloc. Owned here, registered with kvt by pointer.
class KvBuffers {
 public:
  explicit KvBuffers(const Options& o)
      : device_(o.device),
        layers_(o.layers),
        pages_(o.pages),
        item_len_(static_cast<uint64_t>(o.page_size) * o.head_num * o.head_dim * 2) {}  // bf16
  ~KvBuffers() {
    for (void* p : ptrs_) {
      if (device_ >= 0) {
        cudaFree(p);
      } else {
        std::free(p);
      }
    }
  }
  KvBuffers(const KvBuffers&) = delete;
  KvBuffers& operator=(const KvBuffers&) = delete;

  // Allocates every buffer; on failure prints why and returns false.
  bool Allocate() {
    if (device_ >= 0) {
      int count = 0;
      cudaError_t e = cudaGetDeviceCount(&count);
      if (e != cudaSuccess || device_ >= count) {
        std::fprintf(stderr,
                     "kvt_embed: --device %d: %s (cudaGetDeviceCount: %d devices, %s); run "
                     "without --device for host memory\n",
                     device_, e == cudaSuccess ? "no such CUDA device" : "no CUDA device",
                     e == cudaSuccess ? count : 0, cudaGetErrorString(e));
        return false;
      }
      if ((e = cudaSetDevice(device_)) != cudaSuccess) {
        std::fprintf(stderr, "kvt_embed: cudaSetDevice(%d): %s\n", device_, cudaGetErrorString(e));
        return false;
      }
    }
    for (uint32_t b = 0; b < 2 * layers_; ++b) {
      void* p = nullptr;
      if (device_ >= 0) {
        // Whole 2 MiB granules, as caching allocators hand out: a CUDA IPC peer writes into
        // allocations of other sizes several times slower (kvt warns about them).
        constexpr uint64_t kGranule = uint64_t{2} << 20;
        const uint64_t allocated = (bytes() + kGranule - 1) / kGranule * kGranule;
        if (cudaError_t e = cudaMalloc(&p, allocated); e != cudaSuccess) {
          std::fprintf(stderr, "kvt_embed: cudaMalloc of %llu bytes on device %d: %s\n",
                       static_cast<unsigned long long>(allocated), device_, cudaGetErrorString(e));
          return false;
        }
      } else {
        p = std::aligned_alloc(64, bytes());
        if (p == nullptr) {
          std::fprintf(stderr, "kvt_embed: malloc of %llu bytes failed\n",
                       static_cast<unsigned long long>(bytes()));
          return false;
        }
      }
      ptrs_.push_back(p);
    }
    return true;
  }

  uint32_t num_buffers() const { return 2 * layers_; }
  uint64_t item_len() const { return item_len_; }
  uint64_t bytes() const { return item_len_ * pages_; }
  uint32_t pages() const { return pages_; }
  void* buffer(uint32_t b) const { return ptrs_[b]; }
  char* page(uint32_t b, int32_t p) const {
    return static_cast<char*>(ptrs_[b]) + static_cast<uint64_t>(p) * item_len_;
  }

  // get_contiguous_buf_infos() of this memory.
  void BufInfos(std::vector<uint64_t>& ptrs, std::vector<int64_t>& lens,
                std::vector<int64_t>& item_lens) const {
    for (void* p : ptrs_) {
      ptrs.push_back(reinterpret_cast<uint64_t>(p));
      lens.push_back(static_cast<int64_t>(bytes()));
      item_lens.push_back(static_cast<int64_t>(item_len_));
    }
  }

  // Copies host bytes into page `p` of buffer `b` (on `stream` for CUDA memory).
  bool Write(uint32_t b, int32_t p, const std::vector<uint64_t>& words, cudaStream_t stream) {
    if (device_ < 0) {
      std::memcpy(page(b, p), words.data(), item_len_);
      return true;
    }
    cudaError_t e =
        cudaMemcpyAsync(page(b, p), words.data(), item_len_, cudaMemcpyHostToDevice, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);  // `words` is reused by the caller
    if (e != cudaSuccess) {
      std::fprintf(stderr, "kvt_embed: cudaMemcpyAsync to buffer %u page %d: %s\n", b, p,
                   cudaGetErrorString(e));
      return false;
    }
    return true;
  }

  // Copies buffer `b` whole into `out` (host words).
  bool Read(uint32_t b, std::vector<uint64_t>& out) const {
    out.resize(bytes() / 8);
    if (device_ < 0) {
      std::memcpy(out.data(), ptrs_[b], bytes());
      return true;
    }
    if (cudaError_t e = cudaMemcpy(out.data(), ptrs_[b], bytes(), cudaMemcpyDeviceToHost);
        e != cudaSuccess) {
      std::fprintf(stderr, "kvt_embed: cudaMemcpy of buffer %u to the host: %s\n", b,
                   cudaGetErrorString(e));
      return false;
    }
    return true;
  }

 private:
  const int device_;
  const uint32_t layers_;
  const uint32_t pages_;
  const uint64_t item_len_;
  std::vector<void*> ptrs_;
};

int Fail(const char* role, const std::string& what, const kvt::Status& status) {
  std::fprintf(stderr, "kvt_embed: %s: %s: %s\n", role, what.c_str(), status.ToString().c_str());
  return 1;
}

// The layout kvt registers: the buffer infos plus the model facts both sides must agree on.
kvt::StatusOr<xfer::TransferLayout> Layout(const Options& o, const KvBuffers& kv) {
  std::vector<uint64_t> ptrs;
  std::vector<int64_t> lens, item_lens;
  kv.BufInfos(ptrs, lens, item_lens);
  // get_contiguous_buf_unit_lens(): one head of one token.
  const std::vector<int64_t> unit_lens(kv.num_buffers(), static_cast<int64_t>(o.head_dim) * 2);
  xfer::TransferLayout::BufInfoOptions options;
  options.page_size = o.page_size;
  options.dtype = kvt::DType::kBF16;
  options.head_num = o.head_num;
  options.head_dim = o.head_dim;
  options.shape = xfer::KvShape::kKeyValue;
  options.device = o.device;
  options.unit_lens = unit_lens;
  return xfer::TransferLayout::FromBufInfos(ptrs, lens, item_lens, options);
}

xfer::EngineOptions EngineOptionsFor(const Options& o, bool prefill) {
  xfer::EngineOptions e;
  e.name = prefill ? "embed-prefill" : "embed-decode";
  e.prefill = prefill;
  if (o.backend == "cuda_ipc") {
    e.backend = xfer::CudaIpcOptions{};
  } else {
    xfer::UcxOptions ucx;
    ucx.transports = o.transports;
    e.backend = ucx;
  }
  e.server.bind_address = o.bind;
  e.server.port = o.port;
  // Without a token the prefill engine listens on loopback only.
  e.server.cluster_token = kvt::control::ClusterTokenFromEnv();
  e.cluster_token = e.server.cluster_token;
  e.default_deadline = 60s;
  return e;
}

// ---- prefill ----------------------------------------------------------------------------------

int RunPrefill(const Options& o) {
  KvBuffers kv(o);
  if (!kv.Allocate()) return 1;
  auto layout = Layout(o, kv);
  if (!layout.ok()) return Fail("prefill", "TransferLayout::FromBufInfos", layout.status());
  auto engine = xfer::TransferEngine::Create(EngineOptionsFor(o, true), *layout);
  if (!engine.ok()) return Fail("prefill", "TransferEngine::Create", engine.status());
  const uint16_t port = (*engine)->port();
  if (o.report_fd >= 0) {
    const std::string line = std::to_string(port) + "\n";
    if (write(o.report_fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      std::fprintf(stderr, "kvt_embed: prefill: writing the port to fd %d: %s\n", o.report_fd,
                   std::strerror(errno));
      return 1;
    }
    close(o.report_fd);
  } else {
    std::printf("kvt_embed: prefill listening on %s:%u (%s, %s memory)\n", o.bind.c_str(), port,
                std::string((*engine)->backend_name()).c_str(), o.device >= 0 ? "CUDA" : "host");
    std::fflush(stdout);
  }

  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> events;  // one per (request of the window, layer)
  if (o.device >= 0) {
    cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    for (int i = 0; e == cudaSuccess && i < o.window * static_cast<int>(o.layers); ++i) {
      cudaEvent_t ev = nullptr;
      e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      if (e == cudaSuccess) events.push_back(ev);
    }
    if (e != cudaSuccess) {
      std::fprintf(stderr, "kvt_embed: prefill: creating the stream and events: %s\n",
                   cudaGetErrorString(e));
      return 1;
    }
  }

  const std::vector<Request> requests = MakeRequests(o);
  std::vector<uint64_t> words(kv.item_len() / 8);
  int status = 0;
  for (int first = 0; first < o.requests && status == 0; first += o.window) {
    const int last = std::min(o.requests, first + o.window);
    for (int r = first; r < last; ++r) {
      if (kvt::Status s = (*engine)->Send(requests[r].room, requests[r].src_pages); !s.ok()) {
        return Fail("prefill", "Send " + requests[r].room, s);
      }
    }
    // A forward pass: layer by layer, every request of the batch; a layer's pages may go out
    // as soon as it is written.
    for (uint32_t l = 0; l < o.layers; ++l) {
      for (int r = first; r < last; ++r) {
        for (uint32_t b : {l, o.layers + l}) {
          for (int32_t page : requests[r].src_pages) {
            for (size_t w = 0; w < words.size(); ++w) words[w] = SourceWord(r, page, b, w);
            if (!kv.Write(b, page, words, stream)) return 1;
          }
        }
        cudaEvent_t ready = nullptr;
        if (o.device >= 0) {
          ready = events[(r - first) * o.layers + l];
          if (cudaError_t e = cudaEventRecord(ready, stream); e != cudaSuccess) {
            std::fprintf(stderr, "kvt_embed: prefill: cudaEventRecord: %s\n",
                         cudaGetErrorString(e));
            return 1;
          }
        }
        if (kvt::Status s = (*engine)->LayersReady(requests[r].room, l + 1, ready); !s.ok()) {
          return Fail("prefill", "LayersReady " + requests[r].room, s);
        }
      }
    }
    // The window's pages (and events) are reused only once its requests are done.
    for (int r = first; r < last; ++r) {
      auto info = (*engine)->WaitRequest(requests[r].room, 60s);
      if (!info.ok()) return Fail("prefill", "WaitRequest " + requests[r].room, info.status());
      if (info->state != xfer::RequestState::kSuccess) {
        status = Fail("prefill", requests[r].room + " ended " + xfer::RequestStateName(info->state),
                      info->status);
      }
      (void)(*engine)->Forget(requests[r].room);
    }
  }
  // A prefill room is done once its TransferDone is sent; the decode engine may still be
  // handling it, and a prefill engine that shuts down ends the session (its peer fails the rooms
  // it has not finished). So stay up until the decode process is done: the launcher closes
  // wait_fd then; by hand, --linger-ms.
  if (o.wait_fd >= 0) {
    char c;
    while (read(o.wait_fd, &c, 1) > 0) {
    }
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(o.linger_ms));
  }
  engine->reset();
  for (cudaEvent_t ev : events) cudaEventDestroy(ev);
  if (stream != nullptr) cudaStreamDestroy(stream);
  return status;
}

// ---- decode -----------------------------------------------------------------------------------

// Checks every page of every buffer against what it should hold: `writer[page]` is the request
// whose data it holds (with `source[page]`, that request's source page), or -1 for untouched.
// Adds the bytes compared to `bytes_compared`.
bool Verify(const Options& o, const KvBuffers& kv, const std::vector<int>& writer,
            const std::vector<int32_t>& source, const std::vector<Request>& requests,
            uint64_t& bytes_compared) {
  std::vector<uint64_t> words;
  const size_t page_words = kv.item_len() / 8;
  for (uint32_t b = 0; b < kv.num_buffers(); ++b) {
    if (!kv.Read(b, words)) return false;
    bytes_compared += kv.bytes();
    for (int32_t page = 0; page < static_cast<int32_t>(kv.pages()); ++page) {
      const uint64_t* got = words.data() + static_cast<size_t>(page) * page_words;
      const int r = writer[page];
      for (size_t w = 0; w < page_words; ++w) {
        const uint64_t want = r < 0 ? UntouchedWord(page, b, w) : SourceWord(r, source[page], b, w);
        if (got[w] == want) continue;
        const char* kind = b < o.layers ? "K" : "V";
        const uint32_t layer = b % o.layers;
        if (r < 0) {
          std::fprintf(
              stderr,
              "kvt_embed: decode: %s of layer %u, page %d, bytes [%zu, %zu): 0x%016llx, but no "
              "request wrote this page (expected it untouched: 0x%016llx)\n",
              kind, layer, page, w * 8, w * 8 + 8, static_cast<unsigned long long>(got[w]),
              static_cast<unsigned long long>(want));
        } else {
          const auto& q = requests[r];
          const size_t pos =
              std::find(q.dst_pages.begin(), q.dst_pages.end(), page) - q.dst_pages.begin();
          std::fprintf(stderr,
                       "kvt_embed: decode: room %s, %s of layer %u, page %d (its page %zu of %zu, "
                       "source page %d), bytes [%zu, %zu): 0x%016llx, expected 0x%016llx\n",
                       q.room.c_str(), kind, layer, page, pos, q.dst_pages.size(), source[page],
                       w * 8, w * 8 + 8, static_cast<unsigned long long>(got[w]),
                       static_cast<unsigned long long>(want));
        }
        return false;
      }
    }
  }
  return true;
}

int RunDecode(const Options& o) {
  const auto colon = o.connect.rfind(':');
  const std::string host = o.connect.substr(0, colon);
  const int port = colon == std::string::npos ? 0 : std::atoi(o.connect.c_str() + colon + 1);
  if (colon == std::string::npos || host.empty() || port <= 0 || port > 65535) {
    std::fprintf(stderr, "kvt_embed: decode: --connect '%s' is not HOST:PORT\n", o.connect.c_str());
    return 1;
  }
  KvBuffers kv(o);
  if (!kv.Allocate()) return 1;
  // Every page starts with a pattern of its own, so that a write to a page nobody asked for
  // shows.
  {
    std::vector<uint64_t> words(kv.item_len() / 8);
    for (uint32_t b = 0; b < kv.num_buffers(); ++b) {
      for (int32_t page = 0; page < static_cast<int32_t>(kv.pages()); ++page) {
        for (size_t w = 0; w < words.size(); ++w) words[w] = UntouchedWord(page, b, w);
        if (!kv.Write(b, page, words, nullptr)) return 1;
      }
    }
  }
  auto layout = Layout(o, kv);
  if (!layout.ok()) return Fail("decode", "TransferLayout::FromBufInfos", layout.status());
  auto engine = xfer::TransferEngine::Create(EngineOptionsFor(o, false), *layout);
  if (!engine.ok()) return Fail("decode", "TransferEngine::Create", engine.status());
  auto peer = (*engine)->ConnectPeer(host, static_cast<uint16_t>(port));
  if (!peer.ok()) return Fail("decode", "ConnectPeer " + o.connect, peer.status());

  const std::vector<Request> requests = MakeRequests(o);
  std::vector<int> writer(kv.pages(), -1);
  std::vector<int32_t> source(kv.pages(), 0);
  uint64_t moved = 0, compared = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int first = 0; first < o.requests; first += o.window) {
    const int last = std::min(o.requests, first + o.window);
    for (int r = first; r < last; ++r) {
      if (kvt::Status s = (*engine)->Receive(requests[r].room, *peer, requests[r].dst_pages);
          !s.ok()) {
        return Fail("decode", "Receive " + requests[r].room, s);
      }
    }
    for (int r = first; r < last; ++r) {
      const Request& q = requests[r];
      auto info = (*engine)->WaitRequest(q.room, 60s);
      if (!info.ok()) return Fail("decode", "WaitRequest " + q.room, info.status());
      if (info->state != xfer::RequestState::kSuccess) {
        return Fail("decode", q.room + " ended " + xfer::RequestStateName(info->state),
                    info->status);
      }
      for (size_t j = 0; j < q.dst_pages.size(); ++j) {
        writer[q.dst_pages[j]] = r;
        source[q.dst_pages[j]] = q.src_pages[j];
      }
      moved += q.dst_pages.size() * kv.item_len() * kv.num_buffers();
      (void)(*engine)->Forget(q.room);
    }
    if (!Verify(o, kv, writer, source, requests, compared)) return 1;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "kvt_embed: %d requests moved layer by layer and verified (%s memory, %s; %u layers, %u "
      "buffers of %llu-byte pages): %.2f MiB moved in %.2f s (checks included); after each window "
      "of %d, every "
      "page of every buffer compared (%.2f MiB): each requested page holds its source's bytes, "
      "every other page is untouched\n",
      o.requests, o.device >= 0 ? "CUDA" : "host", std::string((*engine)->backend_name()).c_str(),
      o.layers, kv.num_buffers(), static_cast<unsigned long long>(kv.item_len()),
      static_cast<double>(moved) / (1 << 20), seconds, o.window,
      static_cast<double>(compared) / (1 << 20));
  return 0;
}

// ---- launcher ---------------------------------------------------------------------------------

// Starts this program again with `args`; the child inherits this process's descriptors except
// `close_fds`. Returns the child's pid, or -1 after printing why.
pid_t Spawn(const std::vector<std::string>& args, const std::vector<int>& close_fds) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  for (int fd : close_fds) posix_spawn_file_actions_addclose(&actions, fd);
  pid_t pid = -1;
  const int e = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (e != 0) {
    std::fprintf(stderr, "kvt_embed: starting %s %s: %s\n", args[0].c_str(), args[2].c_str(),
                 std::strerror(e));
    return -1;
  }
  return pid;
}

// Exit status of `pid` (1 when it did not exit normally, with a message).
int Reap(pid_t pid, const char* role) {
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  std::fprintf(stderr, "kvt_embed: the %s process ended by signal %d\n", role,
               WIFSIGNALED(wstatus) ? WTERMSIG(wstatus) : 0);
  return 1;
}

int RunBoth(int argc, char** argv) {
  int report[2], wait[2];
  if (pipe(report) != 0 || pipe(wait) != 0) {
    std::fprintf(stderr, "kvt_embed: pipe: %s\n", std::strerror(errno));
    return 1;
  }
  std::vector<std::string> common(argv, argv + argc);
  std::vector<std::string> prefill_args = {argv[0],
                                           "--role",
                                           "prefill",
                                           "--report-fd",
                                           std::to_string(report[1]),
                                           "--wait-fd",
                                           std::to_string(wait[0])};
  prefill_args.insert(prefill_args.end(), common.begin() + 1, common.end());
  const pid_t prefill = Spawn(prefill_args, {report[0], wait[1]});
  close(report[1]);
  close(wait[0]);
  if (prefill < 0) return 1;

  std::string line;
  char c;
  while (read(report[0], &c, 1) == 1 && c != '\n') line += c;
  close(report[0]);
  if (line.empty()) {
    close(wait[1]);
    const int rc = Reap(prefill, "prefill");
    std::fprintf(stderr, "kvt_embed: the prefill process exited (%d) before it listened\n", rc);
    return 1;
  }
  std::vector<std::string> decode_args = {argv[0], "--role", "decode", "--connect",
                                          "127.0.0.1:" + line};
  decode_args.insert(decode_args.end(), common.begin() + 1, common.end());
  const pid_t decode = Spawn(decode_args, {wait[1]});
  const int decode_rc = decode < 0 ? 1 : Reap(decode, "decode");
  // The prefill process may exit now; after a failed decode it is stopped rather than left
  // waiting for its rooms' deadlines.
  if (decode_rc != 0) kill(prefill, SIGTERM);
  close(wait[1]);
  const int prefill_rc = Reap(prefill, "prefill");
  if (decode_rc != 0 || prefill_rc != 0) {
    std::fprintf(stderr, "kvt_embed: FAILED (decode exit %d, prefill exit %d)\n", decode_rc,
                 prefill_rc);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!ParseArgs(argc, argv, o)) return 2;
  if (o.role == "prefill") return RunPrefill(o);
  if (o.role == "decode") return RunDecode(o);
  return RunBoth(argc, argv);
}
