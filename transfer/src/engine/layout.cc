// TransferLayout: building a layout from kvt's pool or from an engine's buffer infos, and
// checking it against the process's memory.
#include "kvt/transfer/layout.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "backends/common/host_memory.h"
#include "kvt/common/hex.h"
#include "kvt/pool/kv_pool.h"

namespace kvt::transfer {
namespace {

constexpr uint32_t kMaxPageSize = 65536;
constexpr uint32_t kMaxLayers = 4096;
constexpr uint32_t kMaxHeads = 65536;
constexpr uint32_t kMaxHeadDim = 65536;
constexpr size_t kMaxGroups = 16;
constexpr size_t kMaxAuxBuffers = 64;
// Aux bytes of one request travel in its TransferDone frame (at most 16 MiB by default).
constexpr uint64_t kMaxAuxRequestBytes = uint64_t{8} << 20;

// What the buffer is, for messages: "buffer 5 (group 0, V of layer 1)".
std::string BufferName(const TransferLayout& layout, size_t index) {
  size_t first = 0;
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    const KvGroup& group = layout.groups[g];
    const size_t n = group.buffers.size();
    if (index < first + n) {
      const size_t i = index - first;
      std::string what;
      if (group.shape == KvShape::kLatent) {
        what = fmt::format("layer {}", i);
      } else if (group.num_layers > 0) {
        what = fmt::format("{} of layer {}", i < group.num_layers ? "K" : "V",
                           i % group.num_layers);
      }
      return fmt::format("buffer {} (group {}{}{})", index, g, what.empty() ? "" : ", ", what);
    }
    first += n;
  }
  return fmt::format("buffer {}", index);
}

// CUDA's view of a pointer: {device ordinal, true} for device memory, {-1, false} for anything
// else (host memory, or no CUDA driver or device at all).
struct CudaView {
  bool device_memory = false;
  int device = -1;
};
CudaView ViewOf(uint64_t ptr) {
  cudaPointerAttributes attrs{};
  const cudaError_t rc = cudaPointerGetAttributes(&attrs, reinterpret_cast<const void*>(ptr));
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  if (attrs.type == cudaMemoryTypeDevice) return {true, attrs.device};
  return {};
}

Status CheckMemory(const BufferInfo& b, int32_t device, const std::string& name) {
  const uint64_t last = b.ptr + b.length - 1;
  if (device < 0) {
    const CudaView view = ViewOf(b.ptr);
    if (view.device_memory) {
      return InvalidArgument(fmt::format(
          "{} at {} is CUDA memory of device {}, but the layout says host memory (device = -1); "
          "set the layout's device to {}",
          name, Hex(b.ptr), view.device, view.device));
    }
    if (!HostRangeMapped(b.ptr, b.length)) {
      return InvalidArgument(fmt::format(
          "{} [{}, {}) is not mapped host memory of this process (and not CUDA memory): pass "
          "the address and length of memory this process allocated",
          name, Hex(b.ptr), Hex(b.ptr + b.length)));
    }
    return OkStatus();
  }
  for (const uint64_t p : {b.ptr, last}) {
    const CudaView view = ViewOf(p);
    if (!view.device_memory || view.device != device) {
      const std::string what =
          view.device_memory ? fmt::format("CUDA memory of device {}", view.device)
          : HostRangeMapped(p, 1)
              ? std::string("host memory")
              : std::string("neither host memory nor CUDA memory this process can see");
      return InvalidArgument(fmt::format(
          "{} [{}, {}): byte {} is {}, but the layout says CUDA memory of device {}; pass "
          "buffers allocated on device {} (or set the layout's device to where they live, -1 "
          "for host memory)",
          name, Hex(b.ptr), Hex(b.ptr + b.length), Hex(p), what, device, device));
    }
  }
  return OkStatus();
}

Status CheckBuffer(const BufferInfo& b, const std::string& name) {
  if (b.ptr == 0) return InvalidArgument(name + " has a null pointer");
  if (b.item_len == 0) return InvalidArgument(name + " has item_len 0; pages must have bytes");
  if (b.length % b.item_len != 0) {
    return InvalidArgument(fmt::format(
        "{} is {} bytes, not a multiple of its item_len {} (bytes of one page); pass the "
        "buffer's whole length, num_pages * item_len",
        name, b.length, b.item_len));
  }
  if (b.ptr > std::numeric_limits<uint64_t>::max() - b.length) {
    return InvalidArgument(
        fmt::format("{} at {} with {} bytes wraps around the address space", name, Hex(b.ptr),
                    b.length));
  }
  return OkStatus();
}

}  // namespace

Status TransferLayout::Validate() const {
  if (page_size == 0 || page_size > kMaxPageSize) {
    return InvalidArgument(fmt::format("layout page_size {} must be in 1..{} (tokens per page)",
                                       page_size, kMaxPageSize));
  }
  if (tp_size == 0 || tp_rank >= tp_size) {
    return InvalidArgument(fmt::format("layout tp_rank {} must be below tp_size {} (>= 1)",
                                       tp_rank, tp_size));
  }
  if (device < -1) {
    return InvalidArgument(fmt::format(
        "layout device {} is no CUDA ordinal; use -1 for host memory", device));
  }
  if (groups.empty()) {
    return InvalidArgument("the layout has no KV groups; add the target model's buffers");
  }
  if (groups.size() > kMaxGroups) {
    return InvalidArgument(fmt::format("the layout has {} KV groups; at most {} (a target model "
                                       "and its draft models)",
                                       groups.size(), kMaxGroups));
  }
  int64_t total_layers = 0;
  size_t index = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const KvGroup& group = groups[g];
    const std::string gname = fmt::format("group {}{}", g, g == 0 ? " (target)" : " (draft)");
    if (group.num_layers == 0 || group.num_layers > kMaxLayers) {
      return InvalidArgument(
          fmt::format("{} has {} layers; must be 1..{}", gname, group.num_layers, kMaxLayers));
    }
    total_layers += group.num_layers;
    if (group.head_num == 0 || group.head_num > kMaxHeads) {
      return InvalidArgument(
          fmt::format("{} has head_num {}; must be 1..{}", gname, group.head_num, kMaxHeads));
    }
    if (group.head_dim == 0 || group.head_dim > kMaxHeadDim) {
      return InvalidArgument(
          fmt::format("{} has head_dim {}; must be 1..{}", gname, group.head_dim, kMaxHeadDim));
    }
    if (!IsPoolDType(group.dtype)) {
      return InvalidArgument(fmt::format("{} has dtype {}, which is no KV element type", gname,
                                         DTypeName(group.dtype)));
    }
    const size_t want = static_cast<size_t>(group.num_layers) * group.buffers_per_layer();
    if (group.buffers.size() != want) {
      return InvalidArgument(fmt::format(
          "{} lists {} buffers; a {} group of {} layers has {} ({})", gname,
          group.buffers.size(), KvShapeName(group.shape), group.num_layers, want,
          group.shape == KvShape::kKeyValue ? "K of every layer, then V of every layer"
                                            : "one per layer"));
    }
    const uint64_t unit = group.unit_bytes();
    const uint64_t page = page_bytes(g);
    for (size_t i = 0; i < group.buffers.size(); ++i, ++index) {
      const BufferInfo& b = group.buffers[i];
      const std::string name = BufferName(*this, index);
      KVT_RETURN_IF_ERROR(CheckBuffer(b, name));
      if (b.item_len % unit != 0) {
        return InvalidArgument(fmt::format(
            "{}: unit bytes {} (head_dim {} x {} bytes of {}) do not divide its item_len {}; "
            "check head_dim and dtype against the buffer",
            name, unit, group.head_dim, ItemSize(group.dtype), DTypeName(group.dtype),
            b.item_len));
      }
      if (b.item_len != page) {
        return InvalidArgument(fmt::format(
            "{}: item_len {} is not page_size {} x head_num {} x unit bytes {} = {}; check "
            "page_size and head_num against the buffer",
            name, b.item_len, page_size, group.head_num, unit, page));
      }
      if (b.length / b.item_len < 2) {
        return InvalidArgument(fmt::format(
            "{} holds {} page(s); a pool needs the dummy page 0 and at least one real page", name,
            b.length / b.item_len));
      }
    }
  }
  if (total_layers > kMaxLayers) {
    return InvalidArgument(fmt::format("the groups have {} layers together; at most {}",
                                       total_layers, kMaxLayers));
  }
  if (aux.size() > kMaxAuxBuffers) {
    return InvalidArgument(
        fmt::format("the layout has {} aux buffers; at most {}", aux.size(), kMaxAuxBuffers));
  }
  uint64_t aux_bytes = 0;
  for (size_t i = 0; i < aux.size(); ++i) {
    KVT_RETURN_IF_ERROR(CheckBuffer(aux[i], fmt::format("aux buffer {}", i)));
    aux_bytes += aux[i].item_len;
  }
  if (aux_bytes > kMaxAuxRequestBytes) {
    return InvalidArgument(fmt::format(
        "one request's aux slots are {} bytes together; at most {} (they travel in the "
        "request's last control message): move large tensors as KV groups instead",
        aux_bytes, kMaxAuxRequestBytes));
  }

  // No two buffers overlap: a page written into one would land in another.
  struct Span {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;
  index = 0;
  for (const KvGroup& group : groups) {
    for (const BufferInfo& b : group.buffers) {
      spans.push_back({b.ptr, b.ptr + b.length, BufferName(*this, index++)});
    }
  }
  for (size_t i = 0; i < aux.size(); ++i) {
    spans.push_back({aux[i].ptr, aux[i].ptr + aux[i].length, fmt::format("aux buffer {}", i)});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].begin < spans[i - 1].end) {
      return InvalidArgument(fmt::format(
          "{} [{}, {}) and {} [{}, {}) overlap; every buffer needs memory of its own",
          spans[i - 1].name, Hex(spans[i - 1].begin), Hex(spans[i - 1].end), spans[i].name,
          Hex(spans[i].begin), Hex(spans[i].end)));
    }
  }

  // The memory itself.
  index = 0;
  for (const KvGroup& group : groups) {
    for (const BufferInfo& b : group.buffers) {
      KVT_RETURN_IF_ERROR(CheckMemory(b, device, BufferName(*this, index++)));
    }
  }
  for (size_t i = 0; i < aux.size(); ++i) {
    const std::string name = fmt::format("aux buffer {}", i);
    if (ViewOf(aux[i].ptr).device_memory) {
      return InvalidArgument(
          name + " is CUDA memory; aux buffers must be host memory (copy device metadata into "
                 "a host slot before the request's last LayersReady)");
    }
    KVT_RETURN_IF_ERROR(CheckMemory(aux[i], -1, name));
  }
  return OkStatus();
}

StatusOr<TransferLayout> TransferLayout::FromPool(const pool::KvPool& pool, uint32_t tp_rank,
                                                  uint32_t tp_size) {
  // The pool's guards decide what may be registered for transfer.
  KVT_ASSIGN_OR_RETURN(pool::ContiguousBufInfos infos, pool.GetContiguousBufInfos());
  const pool::PoolOptions& o = pool.options();
  TransferLayout layout;
  layout.page_size = static_cast<uint32_t>(o.page_size);
  layout.tp_rank = tp_rank;
  layout.tp_size = tp_size;
  layout.device = pool.memory_kind() == pool::MemoryKind::kCuda ? o.device : -1;
  KvGroup group;
  group.shape = KvShape::kKeyValue;
  group.num_layers = static_cast<uint32_t>(o.layer_num);
  group.head_num = static_cast<uint32_t>(o.head_num);
  group.head_dim = static_cast<uint32_t>(o.head_dim);
  group.dtype = o.dtype;
  for (size_t i = 0; i < infos.data_ptrs.size(); ++i) {
    group.buffers.push_back(BufferInfo{infos.data_ptrs[i],
                                       static_cast<uint64_t>(infos.data_lens[i]),
                                       static_cast<uint64_t>(infos.item_lens[i])});
  }
  layout.groups.push_back(std::move(group));
  KVT_RETURN_IF_ERROR(layout.Validate());
  return layout;
}

StatusOr<TransferLayout> TransferLayout::FromBufInfos(std::span<const uint64_t> ptrs,
                                                      std::span<const int64_t> lens,
                                                      std::span<const int64_t> item_lens,
                                                      const BufInfoOptions& options,
                                                      std::span<const uint64_t> aux_ptrs,
                                                      std::span<const int64_t> aux_lens,
                                                      std::span<const int64_t> aux_item_lens) {
  if (ptrs.size() != lens.size() || ptrs.size() != item_lens.size()) {
    return InvalidArgument(fmt::format(
        "buffer infos disagree in length: {} pointers, {} lengths, {} item lengths; pass the "
        "three lists of get_contiguous_buf_infos() as they are",
        ptrs.size(), lens.size(), item_lens.size()));
  }
  if (aux_ptrs.size() != aux_lens.size() || aux_ptrs.size() != aux_item_lens.size()) {
    return InvalidArgument(fmt::format(
        "aux buffer infos disagree in length: {} pointers, {} lengths, {} item lengths",
        aux_ptrs.size(), aux_lens.size(), aux_item_lens.size()));
  }
  if (ptrs.empty()) return InvalidArgument("no KV buffers given");
  if (!options.unit_lens.empty() && options.unit_lens.size() != ptrs.size()) {
    return InvalidArgument(fmt::format("{} unit lengths for {} buffers; pass "
                                       "get_contiguous_buf_unit_lens() whole, or nothing",
                                       options.unit_lens.size(), ptrs.size()));
  }
  const size_t target = options.target_buffers == 0 ? ptrs.size() : options.target_buffers;
  if (target > ptrs.size()) {
    return InvalidArgument(fmt::format("target_buffers {} is more than the {} buffers given",
                                       target, ptrs.size()));
  }
  auto to_info = [&](size_t i, const char* what) -> StatusOr<BufferInfo> {
    if (lens[i] < 0 || item_lens[i] < 0) {
      return InvalidArgument(fmt::format("{} {} has a negative length ({}) or item_len ({})",
                                         what, i, lens[i], item_lens[i]));
    }
    return BufferInfo{ptrs[i], static_cast<uint64_t>(lens[i]),
                      static_cast<uint64_t>(item_lens[i])};
  };
  const uint32_t per_layer = options.shape == KvShape::kKeyValue ? 2 : 1;
  auto make_group = [&](size_t begin, size_t end, uint32_t head_num,
                        uint32_t head_dim) -> StatusOr<KvGroup> {
    KvGroup group;
    group.shape = options.shape;
    group.head_num = head_num;
    group.head_dim = head_dim;
    group.dtype = options.dtype;
    const size_t n = end - begin;
    if (n % per_layer != 0) {
      return InvalidArgument(fmt::format(
          "buffers [{}, {}) are {}, an odd count: a key_value group has K and V of every layer "
          "(one buffer per layer: KvShape::kLatent; latent=True in Python)",
          begin, end, n));
    }
    group.num_layers = static_cast<uint32_t>(n / per_layer);
    for (size_t i = begin; i < end; ++i) {
      KVT_ASSIGN_OR_RETURN(BufferInfo info, to_info(i, "buffer"));
      if (!options.unit_lens.empty() &&
          static_cast<uint64_t>(options.unit_lens[i]) != group.unit_bytes()) {
        return InvalidArgument(fmt::format(
            "buffer {}: unit length {} differs from head_dim {} x {} bytes of {} = {}; the unit "
            "is one head of one token",
            i, options.unit_lens[i], head_dim, ItemSize(options.dtype), DTypeName(options.dtype),
            group.unit_bytes()));
      }
      group.buffers.push_back(info);
    }
    return group;
  };
  TransferLayout layout;
  layout.page_size = options.page_size;
  layout.tp_rank = options.tp_rank;
  layout.tp_size = options.tp_size;
  layout.total_kv_heads = options.total_kv_heads;
  layout.device = options.device;
  KVT_ASSIGN_OR_RETURN(KvGroup main, make_group(0, target, options.head_num, options.head_dim));
  layout.groups.push_back(std::move(main));
  if (target < ptrs.size()) {
    KVT_ASSIGN_OR_RETURN(
        KvGroup draft,
        make_group(target, ptrs.size(),
                   options.draft_head_num != 0 ? options.draft_head_num : options.head_num,
                   options.draft_head_dim != 0 ? options.draft_head_dim : options.head_dim));
    layout.groups.push_back(std::move(draft));
  }
  for (size_t i = 0; i < aux_ptrs.size(); ++i) {
    if (aux_lens[i] < 0 || aux_item_lens[i] < 0) {
      return InvalidArgument(fmt::format("aux buffer {} has a negative length ({}) or item_len ({})",
                                         i, aux_lens[i], aux_item_lens[i]));
    }
    layout.aux.push_back(BufferInfo{aux_ptrs[i], static_cast<uint64_t>(aux_lens[i]),
                                    static_cast<uint64_t>(aux_item_lens[i])});
  }
  KVT_RETURN_IF_ERROR(layout.Validate());
  return layout;
}

}  // namespace kvt::transfer
