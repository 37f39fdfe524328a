// TransferLayout's accessors: what a layout holds and how it reads, with no dependency on the
// memory it names (the wire codecs and their fuzz targets use these without CUDA or the pool).
#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "kvt/transfer/layout.h"

namespace kvt::transfer {

const char* KvShapeName(KvShape shape) {
  switch (shape) {
    case KvShape::kKeyValue:
      return "key_value";
    case KvShape::kLatent:
      return "latent";
  }
  return "unknown";
}

uint64_t KvGroup::unit_bytes() const {
  return static_cast<uint64_t>(head_dim) * static_cast<uint64_t>(ItemSize(dtype));
}

int32_t TransferLayout::num_layers() const {
  int64_t n = 0;
  for (const KvGroup& g : groups) n += g.num_layers;
  return static_cast<int32_t>(std::min<int64_t>(n, std::numeric_limits<int32_t>::max()));
}

size_t TransferLayout::num_buffers() const {
  size_t n = 0;
  for (const KvGroup& g : groups) n += g.buffers.size();
  return n;
}

uint64_t TransferLayout::num_pages() const {
  uint64_t pages = std::numeric_limits<uint64_t>::max();
  bool any = false;
  for (const KvGroup& g : groups) {
    for (const BufferInfo& b : g.buffers) {
      if (b.item_len == 0) return 0;
      pages = std::min(pages, b.length / b.item_len);
      any = true;
    }
  }
  return any ? pages : 0;
}

uint64_t TransferLayout::num_aux_slots() const {
  uint64_t slots = std::numeric_limits<uint64_t>::max();
  for (const BufferInfo& b : aux) {
    if (b.item_len == 0) return 0;
    slots = std::min(slots, b.length / b.item_len);
  }
  return aux.empty() ? 0 : slots;
}

uint64_t TransferLayout::page_bytes(size_t group) const {
  const KvGroup& g = groups.at(group);
  return static_cast<uint64_t>(page_size) * g.head_num * g.unit_bytes();
}

std::vector<TransferLayout::FlatBuffer> TransferLayout::Flatten() const {
  std::vector<FlatBuffer> flat;
  flat.reserve(num_buffers());
  int32_t first_layer = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const KvGroup& group = groups[g];
    for (size_t i = 0; i < group.buffers.size(); ++i) {
      FlatBuffer f;
      f.info = group.buffers[i];
      f.group = static_cast<uint32_t>(g);
      f.layer = first_layer + static_cast<int32_t>(
                                  group.num_layers == 0 ? 0 : i % group.num_layers);
      flat.push_back(f);
    }
    first_layer += static_cast<int32_t>(group.num_layers);
  }
  return flat;
}

std::string TransferLayout::Describe() const {
  std::string groups_text;
  for (size_t g = 0; g < groups.size(); ++g) {
    const KvGroup& group = groups[g];
    groups_text += fmt::format("{}{} {} layers x {} heads x {} {} ({} B/page)",
                               g == 0 ? "" : "; ", KvShapeName(group.shape), group.num_layers,
                               group.head_num, group.head_dim, DTypeName(group.dtype),
                               page_bytes(g));
  }
  std::string aux_text;
  for (size_t i = 0; i < aux.size(); ++i) {
    aux_text += fmt::format("{}{}", i == 0 ? "" : ", ", aux[i].item_len);
  }
  return fmt::format("page_size {}, tp {}/{}, {}, groups [{}], aux slots [{}] x {}", page_size,
                     tp_rank, tp_size, device < 0 ? "host" : fmt::format("cuda:{}", device),
                     groups_text, aux_text, num_aux_slots());
}

}  // namespace kvt::transfer
