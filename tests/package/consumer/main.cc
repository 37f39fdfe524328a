// Uses kvt as a user of the installed package does: a prefill and a decode engine in one process
// (the loopback backend), two host pools, one request moved and every byte of it compared.
// Exits 0 when the request arrived intact; otherwise prints what went wrong and exits 1.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvt/common/status.h"
#include "kvt/pool/kv_pool.h"
#include "kvt/transfer/engine.h"

namespace {

namespace xfer = kvt::transfer;
using namespace std::chrono_literals;

int Fail(const std::string& what, const kvt::Status& status) {
  std::fprintf(stderr, "kvt_consumer: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

kvt::pool::PoolOptions HostPool() {
  kvt::pool::PoolOptions o;
  o.page_size = 16;
  o.size = 16 * 32;  // 32 pages besides the dummy page 0
  o.layer_num = 4;
  o.head_num = 2;
  o.head_dim = 64;
  o.dtype = kvt::DType::kBF16;
  o.memory = kvt::pool::MemoryKind::kHost;
  o.pin_host_memory = false;
  o.pd_disaggregation_enabled = true;
  return o;
}

unsigned char* PageAt(const kvt::pool::ContiguousBufInfos& infos, size_t buffer, int32_t page) {
  return reinterpret_cast<unsigned char*>(infos.data_ptrs[buffer]) +
         static_cast<size_t>(page) * static_cast<size_t>(infos.item_lens[buffer]);
}

}  // namespace

int main() {
  auto src_pool = kvt::pool::KvPool::Create(HostPool());
  if (!src_pool.ok()) return Fail("prefill pool", src_pool.status());
  auto dst_pool = kvt::pool::KvPool::Create(HostPool());
  if (!dst_pool.ok()) return Fail("decode pool", dst_pool.status());
  auto src = (*src_pool)->GetContiguousBufInfos();
  if (!src.ok()) return Fail("prefill buffer infos", src.status());
  auto dst = (*dst_pool)->GetContiguousBufInfos();
  if (!dst.ok()) return Fail("decode buffer infos", dst.status());

  // The request's pages on each side, in token order; the source pages get a pattern that
  // differs in every byte position, page and buffer.
  const std::vector<int32_t> src_pages = {3, 9, 4};
  const std::vector<int32_t> dst_pages = {20, 7, 31};
  for (size_t b = 0; b < src->data_ptrs.size(); ++b) {
    for (int32_t page : src_pages) {
      unsigned char* p = PageAt(*src, b, page);
      for (int64_t i = 0; i < src->item_lens[b]; ++i) {
        p[i] = static_cast<unsigned char>(i * 31 + page * 7 + b * 13 + 1);
      }
    }
  }

  xfer::EngineOptions p;
  p.name = "consumer-prefill";
  p.prefill = true;
  p.backend = xfer::LoopbackOptions{};
  auto prefill = xfer::TransferEngine::Create(p, src_pool->get());
  if (!prefill.ok()) return Fail("prefill engine", prefill.status());

  xfer::EngineOptions d;
  d.name = "consumer-decode";
  d.prefill = false;
  d.backend = xfer::LoopbackOptions{};
  auto decode = xfer::TransferEngine::Create(d, dst_pool->get());
  if (!decode.ok()) return Fail("decode engine", decode.status());

  auto peer = (*decode)->ConnectPeer("127.0.0.1", (*prefill)->port());
  if (!peer.ok()) return Fail("ConnectPeer", peer.status());
  const std::string room = "consumer-room";
  if (kvt::Status s = (*decode)->Receive(room, *peer, dst_pages, 20s); !s.ok()) {
    return Fail("Receive", s);
  }
  if (kvt::Status s = (*prefill)->Send(room, src_pages, 20s); !s.ok()) return Fail("Send", s);
  const int32_t layers = static_cast<int32_t>(HostPool().layer_num);
  if (kvt::Status s = (*prefill)->LayersReady(room, layers); !s.ok()) {
    return Fail("LayersReady", s);
  }
  auto info = (*decode)->WaitRequest(room, 20s);
  if (!info.ok()) return Fail("WaitRequest", info.status());
  if (info->state != xfer::RequestState::kSuccess) {
    return Fail(std::string("the request ended ") + xfer::RequestStateName(info->state),
                info->status);
  }

  uint64_t compared = 0;
  for (size_t b = 0; b < src->data_ptrs.size(); ++b) {
    for (size_t j = 0; j < src_pages.size(); ++j) {
      const size_t bytes = static_cast<size_t>(src->item_lens[b]);
      if (std::memcmp(PageAt(*src, b, src_pages[j]), PageAt(*dst, b, dst_pages[j]), bytes) != 0) {
        std::fprintf(stderr,
                     "kvt_consumer: buffer %zu: decode page %d differs from prefill page %d\n", b,
                     dst_pages[j], src_pages[j]);
        return 1;
      }
      compared += bytes;
    }
  }
  std::printf("kvt_consumer: %llu bytes moved through kvt::transfer (%s) and verified\n",
              static_cast<unsigned long long>(compared),
              std::string((*decode)->backend_name()).c_str());
  return 0;
}
