// What the fuzz targets share: the local side a peer's messages are checked against, and a
// check that stops the run when a decoder broke its own contract.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "control/validate.h"
#include "kvt/v1/control.pb.h"

namespace kvt::fuzz {

// This side's layout in every target: 4 layers, 65 pages (the dummy page included), bf16, 8
// heads of 128, page_size 16, TP 1; the same pool tests/transfer/control/test_messages.h
// describes, so the seeds generated from those messages pass the checks.
inline v1::Layout LocalLayout() {
  v1::Layout layout;
  layout.set_num_layers(4);
  layout.set_page_size(16);
  layout.set_dtype(v1::DTYPE_BF16);
  layout.set_head_num(8);
  layout.set_head_dim(128);
  layout.set_tp_rank(0);
  layout.set_tp_size(1);
  layout.set_num_pages(65);
  layout.set_num_tokens(64 * 16);
  layout.set_total_kv_heads(8);
  return layout;
}

inline constexpr uint64_t kLocalItemLen = 16 * 8 * 128 * 2;

inline control::PeerContext LocalPeerContext() {
  return control::PeerContext{.num_layers = 4, .num_pages = 65, .min_item_len = kLocalItemLen};
}

// A decoder accepted something its contract says it refuses: abort so libFuzzer keeps the input.
#define KVT_FUZZ_CHECK(condition)                                                           \
  do {                                                                                      \
    if (!(condition)) {                                                                     \
      std::fprintf(stderr, "%s:%d: contract broken: %s\n", __FILE__, __LINE__, #condition); \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)

}  // namespace kvt::fuzz
