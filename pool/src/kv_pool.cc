#include "kvt/pool/kv_pool.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>

#include "kvt/common/log.h"
#include "kvt/kernels/cuda_util.h"
#include "kvt/kernels/kernels.h"
#include "pool_memory.h"

namespace kvt::pool {
namespace {

namespace kernels = ::kvt::kernels;

std::string Str(int64_t v) { return std::to_string(v); }

// Copies bytes between host and CUDA memory; plain memcpy when both sides are host memory (so
// host pools never need a CUDA driver).
Status CopyBytes(void* dst, MemoryKind dst_kind, const void* src, MemoryKind src_kind,
                 int64_t bytes) {
  if (bytes == 0) return OkStatus();
  if (dst_kind == MemoryKind::kHost && src_kind == MemoryKind::kHost) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return OkStatus();
  }
  return kvt::cuda::Copy(dst, src, static_cast<size_t>(bytes));
}

Status CheckMemoryKind(MemoryKind kind, const char* what) {
  if (kind == MemoryKind::kHost || kind == MemoryKind::kCuda) return OkStatus();
  return InvalidArgument(std::string(what) + " memory kind " + Str(static_cast<int>(kind)) +
                         " is unknown; use host or cuda");
}

// Per-call argument tables and scratch in the pool's memory space. For CUDA pools the host
// index lists are copied to the device here and kept alive until the call has synchronised; for
// host pools the host pointers are used as they are.
class CallScratch {
 public:
  CallScratch(MemoryKind kind, int device) : kind_(kind), device_index_(device) {}

  template <typename T>
  StatusOr<const T*> Table(std::span<const T> host) {
    if (kind_ == MemoryKind::kHost) return host.data();
    KVT_ASSIGN_OR_RETURN(void* p, Bytes(static_cast<int64_t>(host.size_bytes())));
    KVT_RETURN_IF_ERROR(kvt::cuda::Copy(p, host.data(), host.size_bytes()));
    return static_cast<const T*>(p);
  }

  // `bytes` of uninitialised memory in the pool's memory space.
  StatusOr<void*> Bytes(int64_t bytes) {
    const size_t n = static_cast<size_t>(std::max<int64_t>(bytes, 1));
    if (kind_ == MemoryKind::kHost) {
      host_.emplace_back(n);
      return static_cast<void*>(host_.back().data());
    }
    KVT_ASSIGN_OR_RETURN(auto buffer, kvt::cuda::DeviceBuffer::Allocate(n, device_index_));
    device_buffers_.push_back(std::move(buffer));
    return device_buffers_.back().data();
  }

  // `src` (in `src_kind` memory) as a pointer in the pool's memory space, staging a copy when
  // it lives elsewhere.
  StatusOr<const void*> Local(const void* src, MemoryKind src_kind, int64_t bytes) {
    if (src_kind == kind_) return src;
    KVT_ASSIGN_OR_RETURN(void* p, Bytes(bytes));
    KVT_RETURN_IF_ERROR(CopyBytes(p, kind_, src, src_kind, bytes));
    return static_cast<const void*>(p);
  }

 private:
  MemoryKind kind_;
  int device_index_;
  std::vector<std::vector<uint8_t>> host_;
  std::vector<kvt::cuda::DeviceBuffer> device_buffers_;
};

}  // namespace

class KvPool::Impl {
 public:
  MemoryKind kind = MemoryKind::kHost;
  int device = 0;
  bool pinned = false;
  std::vector<std::unique_ptr<PoolMemory>> k_memory;  // distinct K buffers
  std::vector<std::unique_ptr<PoolMemory>> v_memory;  // distinct V buffers
  std::vector<std::unique_ptr<PoolMemory>> conv_memory;
  std::vector<std::unique_ptr<PoolMemory>> ssm_memory;
  // Per layer: K bases of layers 0..L-1 then V bases (0 for state layers). The pack/unpack
  // tables, in the buffer-info order.
  std::vector<uint64_t> layer_bases;
  // Distinct buffers (K then V), each once: what move and clear touch.
  std::vector<uint64_t> distinct_bases;
  std::vector<int64_t> distinct_row_bytes;
  bool aliased = false;  // several layers share one buffer (hybrid slab)

  // CUDA pools only.
  kvt::cuda::Stream stream;
  kvt::cuda::DeviceBuffer d_layer_bases;
  kvt::cuda::DeviceBuffer d_distinct_bases;
  kvt::cuda::DeviceBuffer d_distinct_row_bytes;

  bool cuda() const { return kind == MemoryKind::kCuda; }
  const uint64_t* LayerBases() const {
    return cuda() ? d_layer_bases.as<const uint64_t>() : layer_bases.data();
  }

  Status Pack(const kernels::PackArgs& a) const {
    if (a.num_pages == 0 || a.num_buffers == 0) return OkStatus();
    return cuda() ? kernels::PackCuda(a, stream.get()) : kernels::PackCpu(a);
  }
  Status Unpack(const kernels::PackArgs& a) const {
    if (a.num_pages == 0 || a.num_buffers == 0) return OkStatus();
    return cuda() ? kernels::UnpackCuda(a, stream.get()) : kernels::UnpackCpu(a);
  }
  Status Sync() const { return cuda() ? stream.Synchronize() : OkStatus(); }

  // Scatters `staging` ([2, L, n, row], pool memory) into rows `pages` of every layer. Layers that
  // alias one slab are written one after another in layer order, so the last layer wins as in the
  // reference's per-layer loop (one launch over aliased bases would race).
  Status UnpackAll(const PoolLayout& layout, const int32_t* pages, int64_t n,
                   const void* staging) const {
    const Impl& impl = *this;
    const int64_t num_layers = layout.layer_num();
    kernels::PackArgs args;
    args.pages = pages;
    args.num_pages = n;
    args.page_stride = layout.row_bytes();
    args.bytes = layout.row_bytes();
    if (!impl.aliased) {
      args.bases = impl.LayerBases();
      args.num_buffers = static_cast<int32_t>(2 * num_layers);
      args.staging = const_cast<void*>(staging);
      return impl.Unpack(args);
    }
    const int64_t block = n * layout.row_bytes();
    for (int64_t l = 0; l < num_layers; ++l) {
      for (int64_t side = 0; side < 2; ++side) {
        const int64_t entry = side * num_layers + l;
        args.bases = impl.LayerBases() + entry;
        args.num_buffers = 1;
        args.staging = const_cast<uint8_t*>(static_cast<const uint8_t*>(staging)) + entry * block;
        KVT_RETURN_IF_ERROR(impl.Unpack(args));
      }
    }
    return OkStatus();
  }

  // Packs rows `pages` of all 2L layer buffers into `staging` ([2, L, n, row], pool memory).
  Status PackAll(const PoolLayout& layout, const int32_t* pages, int64_t n, void* staging) const {
    const Impl& impl = *this;
    kernels::PackArgs args;
    args.bases = impl.LayerBases();
    args.num_buffers = static_cast<int32_t>(2 * layout.layer_num());
    args.pages = pages;
    args.num_pages = n;
    args.page_stride = layout.row_bytes();
    args.bytes = layout.row_bytes();
    args.staging = staging;
    return impl.Pack(args);
  }
};

KvPool::KvPool(PoolLayout layout, std::unique_ptr<Impl> impl)
    : layout_(std::move(layout)), impl_(std::move(impl)) {}

KvPool::~KvPool() = default;

bool KvPool::host_memory_pinned() const { return impl_->pinned; }

StatusOr<std::unique_ptr<KvPool>> KvPool::Create(const PoolOptions& options) {
  // Every validation and guard runs here, before a byte is allocated.
  KVT_ASSIGN_OR_RETURN(PoolLayout layout, PoolLayout::Compute(options));

  auto impl = std::make_unique<Impl>();
  impl->kind = options.memory;
  impl->device = options.device;
  if (impl->cuda()) {
    const kvt::cuda::DeviceCountResult devices = kvt::cuda::DeviceCount();
    if (devices.count == 0) {
      return Unavailable("a CUDA pool was asked for but there is no CUDA device (" +
                         devices.reason + "); use memory = host");
    }
    if (options.device >= devices.count) {
      return InvalidArgument("device " + Str(options.device) +
                             " does not exist; this process sees " + Str(devices.count) +
                             " CUDA device(s)");
    }
  }

  const bool pin = options.pin_host_memory;
  for (int32_t i = 0; i < layout.num_kv_buffers(); ++i) {
    for (auto* side : {&impl->k_memory, &impl->v_memory}) {
      KVT_ASSIGN_OR_RETURN(
          auto mem, PoolMemory::Allocate(impl->kind, layout.buffer_bytes(), impl->device, pin,
                                         options.prefault_host_memory, options.host_allocator));
      side->push_back(std::move(mem));
    }
  }
  const int64_t rows = layout.state_rows();
  for (int32_t i = 0; i < layout.num_state_slab_pairs(); ++i) {
    KVT_ASSIGN_OR_RETURN(auto conv, PoolMemory::Allocate(impl->kind, rows * layout.conv_row_bytes(),
                                                         impl->device, pin));
    KVT_ASSIGN_OR_RETURN(auto ssm, PoolMemory::Allocate(impl->kind, rows * layout.ssm_row_bytes(),
                                                        impl->device, pin));
    impl->conv_memory.push_back(std::move(conv));
    impl->ssm_memory.push_back(std::move(ssm));
  }
  impl->pinned = !impl->cuda() && !impl->k_memory.empty() && impl->k_memory[0]->pinned();

  const int64_t num_layers = layout.layer_num();
  impl->layer_bases.assign(2 * num_layers, 0);
  for (int64_t l = 0; l < num_layers; ++l) {
    const LayerLayout& layer = layout.layers()[l];
    if (layer.kv_buffer < 0) continue;
    impl->layer_bases[l] = reinterpret_cast<uint64_t>(impl->k_memory[layer.kv_buffer]->data());
    impl->layer_bases[num_layers + l] =
        reinterpret_cast<uint64_t>(impl->v_memory[layer.kv_buffer]->data());
  }
  for (const auto* side : {&impl->k_memory, &impl->v_memory}) {
    for (const auto& mem : *side) {
      impl->distinct_bases.push_back(reinterpret_cast<uint64_t>(mem->data()));
    }
  }
  impl->distinct_row_bytes.assign(impl->distinct_bases.size(), layout.row_bytes());
  impl->aliased = layout.hybrid_slab_active();

  if (impl->cuda()) {
    ScopedDevice scoped(impl->device);
    KVT_RETURN_IF_ERROR(scoped.status());
    KVT_ASSIGN_OR_RETURN(impl->stream, kvt::cuda::Stream::Create(impl->device));
    auto upload = [&](kvt::cuda::DeviceBuffer& dst, const void* src, size_t bytes) -> Status {
      KVT_ASSIGN_OR_RETURN(
          dst, kvt::cuda::DeviceBuffer::Allocate(std::max<size_t>(bytes, 1), impl->device));
      return bytes == 0 ? OkStatus() : kvt::cuda::Copy(dst.data(), src, bytes);
    };
    KVT_RETURN_IF_ERROR(upload(impl->d_layer_bases, impl->layer_bases.data(),
                               impl->layer_bases.size() * sizeof(uint64_t)));
    KVT_RETURN_IF_ERROR(upload(impl->d_distinct_bases, impl->distinct_bases.data(),
                               impl->distinct_bases.size() * sizeof(uint64_t)));
    KVT_RETURN_IF_ERROR(upload(impl->d_distinct_row_bytes, impl->distinct_row_bytes.data(),
                               impl->distinct_row_bytes.size() * sizeof(int64_t)));
  }

  const auto [k_bytes, v_bytes] = layout.KvSizeBytes();
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  KVT_LOG_INFO("pool",
               "KV pool allocated on {} (rank {}): {}; size {} tokens, page {}. K size: {:.2f} "
               "GB, V size: {:.2f} GB{}",
               MemoryKindName(impl->kind), options.rank, layout.Summary(), options.size,
               options.page_size, k_bytes / kGiB, v_bytes / kGiB, impl->pinned ? " (pinned)" : "");
  return std::unique_ptr<KvPool>(new KvPool(std::move(layout), std::move(impl)));
}

StatusOr<ContiguousBufInfos> KvPool::GetContiguousBufInfos() const {
  KVT_RETURN_IF_ERROR(layout_.CheckContiguousBufInfos());
  ContiguousBufInfos infos;
  infos.data_ptrs = impl_->layer_bases;
  KVT_ASSIGN_OR_RETURN(infos.data_lens, layout_.DataLens());
  KVT_ASSIGN_OR_RETURN(infos.item_lens, layout_.ItemLens());
  return infos;
}

StatusOr<BufferView> KvPool::GetKeyBuffer(int64_t layer_id) const {
  KVT_RETURN_IF_ERROR(layout_.CheckKvLayer(layer_id));
  if (layer_waiter_ != nullptr) layer_waiter_->WaitUntil(layer_id);
  BufferView view;
  view.data = impl_->k_memory[layout_.layers()[layer_id].kv_buffer]->data();
  view.dtype = layout_.dtype();
  view.store_dtype = layout_.store_dtype();
  view.shape = {layout_.rows_per_buffer(), options().head_num, options().head_dim};
  view.bytes = layout_.buffer_bytes();
  view.memory = impl_->kind;
  view.device = impl_->device;
  return view;
}

StatusOr<BufferView> KvPool::GetValueBuffer(int64_t layer_id) const {
  KVT_ASSIGN_OR_RETURN(BufferView view, GetKeyBuffer(layer_id));
  view.data = impl_->v_memory[layout_.layers()[layer_id].kv_buffer]->data();
  return view;
}

StatusOr<std::pair<BufferView, BufferView>> KvPool::GetKvBuffer(int64_t layer_id) const {
  KVT_ASSIGN_OR_RETURN(BufferView k, GetKeyBuffer(layer_id));
  KVT_ASSIGN_OR_RETURN(BufferView v, GetValueBuffer(layer_id));
  return std::make_pair(std::move(k), std::move(v));
}

std::vector<std::pair<BufferView, BufferView>> KvPool::StateSlabs() const {
  std::vector<std::pair<BufferView, BufferView>> slabs;
  for (size_t i = 0; i < impl_->conv_memory.size(); ++i) {
    BufferView conv;
    conv.data = impl_->conv_memory[i]->data();
    conv.dtype = layout_.conv_dtype();
    conv.store_dtype = layout_.conv_dtype();
    conv.shape = layout_.conv_slab_shape();
    conv.bytes = impl_->conv_memory[i]->bytes();
    conv.memory = impl_->kind;
    conv.device = impl_->device;
    BufferView ssm = conv;
    ssm.data = impl_->ssm_memory[i]->data();
    ssm.dtype = layout_.ssm_dtype();
    ssm.store_dtype = layout_.ssm_dtype();
    ssm.shape = layout_.ssm_slab_shape();
    ssm.bytes = impl_->ssm_memory[i]->bytes();
    slabs.emplace_back(std::move(conv), std::move(ssm));
  }
  return slabs;
}

StatusOr<std::pair<BufferView, BufferView>> KvPool::GetStateBuffers(int64_t layer_id) const {
  KVT_RETURN_IF_ERROR(layout_.CheckStateLayer(layer_id));
  return StateSlabs()[layout_.layers()[layer_id].state_pair];
}

Status KvPool::SetKvBuffer(int64_t layer_id, std::span<const int32_t> loc, const KvRows& rows,
                           std::optional<float> k_scale, std::optional<float> v_scale) {
  KVT_RETURN_IF_ERROR(layout_.CheckKvLayer(layer_id));
  KVT_RETURN_IF_ERROR(CheckMemoryKind(rows.memory, "input rows"));
  if (!IsPoolDType(rows.dtype)) {
    return InvalidArgument("input rows of dtype " + std::string(DTypeName(rows.dtype)) +
                           " cannot be stored; give bf16, fp16, fp32, fp8_e4m3 or fp8_e5m2 rows");
  }
  const auto n = static_cast<int64_t>(loc.size());
  KVT_RETURN_IF_ERROR(layout_.CheckRows(loc.data(), n, "loc"));
  if (n == 0) return OkStatus();
  if (rows.k == nullptr || rows.v == nullptr) {
    return InvalidArgument("SetKvBuffer: rows.k and rows.v must not be null for " + Str(n) +
                           " locations");
  }
  const int64_t row_elems = options().head_num * options().head_dim;
  const int64_t src_bytes = n * row_elems * ItemSize(rows.dtype);

  ScopedDevice scoped(impl_->cuda() ? impl_->device : -1);
  KVT_RETURN_IF_ERROR(scoped.status());
  CallScratch scratch(impl_->kind, impl_->device);
  kernels::StoreArgs args;
  KVT_ASSIGN_OR_RETURN(args.k_src, scratch.Local(rows.k, rows.memory, src_bytes));
  KVT_ASSIGN_OR_RETURN(args.v_src, scratch.Local(rows.v, rows.memory, src_bytes));
  KVT_ASSIGN_OR_RETURN(args.loc, scratch.Table(loc));
  args.src_dtype = rows.dtype;
  const int32_t buffer = layout_.layers()[layer_id].kv_buffer;
  args.k_dst = impl_->k_memory[buffer]->data();
  args.v_dst = impl_->v_memory[buffer]->data();
  args.dst_dtype = layout_.dtype();
  args.num_rows = n;
  args.row_elems = row_elems;
  // Scales only apply on conversion, as in the reference.
  const bool convert = rows.dtype != layout_.dtype();
  args.has_k_scale = convert && k_scale.has_value();
  args.k_scale = k_scale.value_or(1.0f);
  args.has_v_scale = convert && v_scale.has_value();
  args.v_scale = v_scale.value_or(1.0f);
  if (impl_->cuda()) {
    KVT_RETURN_IF_ERROR(kernels::StoreCuda(args, impl_->stream.get()));
    return impl_->Sync();
  }
  return kernels::StoreCpu(args);
}

Status KvPool::MoveKvCache(std::span<const int32_t> tgt_loc, std::span<const int32_t> src_loc) {
  if (tgt_loc.size() != src_loc.size()) {
    return InvalidArgument("MoveKvCache: tgt_loc has " + Str(static_cast<int64_t>(tgt_loc.size())) +
                           " entries but src_loc has " + Str(static_cast<int64_t>(src_loc.size())) +
                           "; give one source per target");
  }
  const auto n = static_cast<int64_t>(tgt_loc.size());
  KVT_RETURN_IF_ERROR(layout_.CheckRows(tgt_loc.data(), n, "tgt_loc"));
  KVT_RETURN_IF_ERROR(layout_.CheckRows(src_loc.data(), n, "src_loc"));
  if (n == 0) return OkStatus();
  std::unordered_map<int32_t, int64_t> target_pos;
  target_pos.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const auto [it, inserted] = target_pos.emplace(tgt_loc[i], i);
    if (!inserted) {
      return InvalidArgument("MoveKvCache: tgt_loc[" + Str(i) + "] = " + Str(tgt_loc[i]) +
                             " repeats tgt_loc[" + Str(it->second) +
                             "]; each target row may be written once");
    }
  }
  const bool tiled = options().enable_kv_cache_copy;
  if (tiled) {
    for (int64_t i = 0; i < n; ++i) {
      const auto it = target_pos.find(src_loc[i]);
      if (it != target_pos.end()) {
        return InvalidArgument(
            "MoveKvCache: src_loc[" + Str(i) + "] = " + Str(src_loc[i]) + " is also tgt_loc[" +
            Str(it->second) +
            "]; the one-launch tiled copy needs target rows disjoint from source rows. Move in "
            "two steps, or use enable_kv_cache_copy = false (gather then scatter per buffer)");
      }
    }
  }

  ScopedDevice scoped(impl_->cuda() ? impl_->device : -1);
  KVT_RETURN_IF_ERROR(scoped.status());
  CallScratch scratch(impl_->kind, impl_->device);
  KVT_ASSIGN_OR_RETURN(const int32_t* tgt, scratch.Table(tgt_loc));
  KVT_ASSIGN_OR_RETURN(const int32_t* src, scratch.Table(src_loc));
  const int64_t row_bytes = layout_.row_bytes();
  const auto num_buffers = static_cast<int32_t>(impl_->distinct_bases.size());

  if (tiled) {
    // One launch over every distinct buffer. The reference lists aliased slabs once per layer
    // (re-copying rows); each distinct buffer once gives the same bytes without the re-copy.
    kernels::TiledCopyArgs args;
    args.bases =
        impl_->cuda() ? impl_->d_distinct_bases.as<const uint64_t>() : impl_->distinct_bases.data();
    args.row_bytes = impl_->cuda() ? impl_->d_distinct_row_bytes.as<const int64_t>()
                                   : impl_->distinct_row_bytes.data();
    args.num_buffers = num_buffers;
    args.tgt_loc = tgt;
    args.src_loc = src;
    args.num_locs = n;
    args.max_row_bytes = row_bytes;
    args.bytes_per_tile = kernels::TileBytesForStride(row_bytes);
    if (impl_->cuda()) {
      KVT_RETURN_IF_ERROR(kernels::TiledCopyCuda(args, impl_->stream.get()));
      return impl_->Sync();
    }
    return kernels::TiledCopyCpu(args);
  }

  // Per-buffer fallback (the reference's move_kv_cache_native: k[tgt] = k[src]): gather every
  // source row first, then scatter, so overlapping source and target rows behave as in torch.
  KVT_ASSIGN_OR_RETURN(void* staging, scratch.Bytes(n * row_bytes));
  for (int32_t b = 0; b < num_buffers; ++b) {
    kernels::PackArgs args;
    args.bases = impl_->cuda() ? impl_->d_distinct_bases.as<const uint64_t>() + b
                               : impl_->distinct_bases.data() + b;
    args.num_buffers = 1;
    args.num_pages = n;
    args.page_stride = row_bytes;
    args.bytes = row_bytes;
    args.staging = staging;
    args.pages = src;
    KVT_RETURN_IF_ERROR(impl_->Pack(args));
    args.pages = tgt;
    KVT_RETURN_IF_ERROR(impl_->Unpack(args));
  }
  return impl_->Sync();
}

namespace {

// The reference reads every layer's K/V for offload and flat transfers, so a state layer (no
// K/V) fails them; name the first one.
Status CheckAllLayersHaveKv(const PoolLayout& layout, const char* op) {
  for (int64_t l = 0; l < layout.layer_num(); ++l) {
    Status st = layout.CheckKvLayer(l);
    if (!st.ok()) return st.WithContext(op);
  }
  return OkStatus();
}

}  // namespace

int64_t KvPool::FlatDataBytes(int64_t num_indices) const {
  return 2 * layout_.layer_num() * num_indices * layout_.row_bytes();
}

Status KvPool::GetFlatDataInto(std::span<const int32_t> indices, void* dst, int64_t dst_bytes,
                               MemoryKind dst_memory) const {
  KVT_RETURN_IF_ERROR(CheckAllLayersHaveKv(layout_, "GetFlatData"));
  KVT_RETURN_IF_ERROR(CheckMemoryKind(dst_memory, "flat data destination"));
  const auto n = static_cast<int64_t>(indices.size());
  KVT_RETURN_IF_ERROR(layout_.CheckRows(indices.data(), n, "indices"));
  const int64_t bytes = FlatDataBytes(n);
  if (dst_bytes < bytes) {
    return InvalidArgument("GetFlatData: destination has " + Str(dst_bytes) + " bytes but " +
                           Str(n) + " indices need " + Str(bytes) + " ([2, L, n, H, D])");
  }
  if (n == 0) return OkStatus();
  if (dst == nullptr) return InvalidArgument("GetFlatData: destination is null");
  ScopedDevice scoped(impl_->cuda() ? impl_->device : -1);
  KVT_RETURN_IF_ERROR(scoped.status());
  CallScratch scratch(impl_->kind, impl_->device);
  KVT_ASSIGN_OR_RETURN(const int32_t* pages, scratch.Table(indices));
  void* staging = dst;
  if (dst_memory != impl_->kind) {
    KVT_ASSIGN_OR_RETURN(staging, scratch.Bytes(bytes));
  }
  KVT_RETURN_IF_ERROR(impl_->PackAll(layout_, pages, n, staging));
  KVT_RETURN_IF_ERROR(impl_->Sync());
  if (staging != dst) KVT_RETURN_IF_ERROR(CopyBytes(dst, dst_memory, staging, impl_->kind, bytes));
  return OkStatus();
}

StatusOr<std::vector<uint8_t>> KvPool::GetFlatData(std::span<const int32_t> indices) const {
  std::vector<uint8_t> flat(
      static_cast<size_t>(FlatDataBytes(static_cast<int64_t>(indices.size()))));
  KVT_RETURN_IF_ERROR(
      GetFlatDataInto(indices, flat.data(), static_cast<int64_t>(flat.size()), MemoryKind::kHost));
  return flat;
}

Status KvPool::Transfer(std::span<const int32_t> indices, const void* flat, int64_t flat_bytes,
                        MemoryKind flat_memory) {
  KVT_RETURN_IF_ERROR(CheckAllLayersHaveKv(layout_, "Transfer"));
  KVT_RETURN_IF_ERROR(CheckMemoryKind(flat_memory, "flat data"));
  const auto n = static_cast<int64_t>(indices.size());
  KVT_RETURN_IF_ERROR(layout_.CheckRows(indices.data(), n, "indices"));
  const int64_t bytes = FlatDataBytes(n);
  if (flat_bytes != bytes) {
    return InvalidArgument("Transfer: flat data has " + Str(flat_bytes) + " bytes but " + Str(n) +
                           " indices of this pool need " + Str(bytes) + " ([2, " +
                           Str(layout_.layer_num()) + ", " + Str(n) + ", " +
                           Str(options().head_num) + ", " + Str(options().head_dim) + "])");
  }
  if (n == 0) return OkStatus();
  if (flat == nullptr) return InvalidArgument("Transfer: flat data is null");
  ScopedDevice scoped(impl_->cuda() ? impl_->device : -1);
  KVT_RETURN_IF_ERROR(scoped.status());
  CallScratch scratch(impl_->kind, impl_->device);
  KVT_ASSIGN_OR_RETURN(const int32_t* pages, scratch.Table(indices));
  KVT_ASSIGN_OR_RETURN(const void* local, scratch.Local(flat, flat_memory, bytes));
  KVT_RETURN_IF_ERROR(impl_->UnpackAll(layout_, pages, n, local));
  return impl_->Sync();
}

StatusOr<KvCpuCopy> KvPool::GetCpuCopy(std::span<const int32_t> indices) const {
  KVT_RETURN_IF_ERROR(CheckAllLayersHaveKv(layout_, "GetCpuCopy"));
  const auto n = static_cast<int64_t>(indices.size());
  KVT_RETURN_IF_ERROR(layout_.CheckRows(indices.data(), n, "indices"));
  const int64_t num_layers = layout_.layer_num();
  const int64_t row_bytes = layout_.row_bytes();
  const int64_t chunk = options().offload_chunk_page_num;
  KvCpuCopy copy;
  copy.row_bytes = row_bytes;
  copy.layers.resize(static_cast<size_t>(num_layers));

  ScopedDevice scoped(impl_->cuda() ? impl_->device : -1);
  KVT_RETURN_IF_ERROR(scoped.status());
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t m = std::min(chunk, n - start);
    CallScratch scratch(impl_->kind, impl_->device);
    KVT_ASSIGN_OR_RETURN(const int32_t* pages, scratch.Table(indices.subspan(start, m)));
    KVT_ASSIGN_OR_RETURN(void* staging, scratch.Bytes(2 * num_layers * m * row_bytes));
    // One gather of the chunk from all 2L buffers, then split per layer.
    KVT_RETURN_IF_ERROR(impl_->PackAll(layout_, pages, m, staging));
    KVT_RETURN_IF_ERROR(impl_->Sync());
    const auto* base = static_cast<const uint8_t*>(staging);
    const int64_t block = m * row_bytes;
    for (int64_t l = 0; l < num_layers; ++l) {
      KvCpuChunk c;
      c.num_rows = m;
      c.k.resize(static_cast<size_t>(block));
      c.v.resize(static_cast<size_t>(block));
      KVT_RETURN_IF_ERROR(
          CopyBytes(c.k.data(), MemoryKind::kHost, base + l * block, impl_->kind, block));
      KVT_RETURN_IF_ERROR(CopyBytes(c.v.data(), MemoryKind::kHost, base + (num_layers + l) * block,
                                    impl_->kind, block));
      copy.layers[l].push_back(std::move(c));
    }
  }
  return copy;
}

Status KvPool::LoadCpuCopy(const KvCpuCopy& copy, std::span<const int32_t> indices) {
  KVT_RETURN_IF_ERROR(CheckAllLayersHaveKv(layout_, "LoadCpuCopy"));
  const auto n = static_cast<int64_t>(indices.size());
  KVT_RETURN_IF_ERROR(layout_.CheckRows(indices.data(), n, "indices"));
  const int64_t num_layers = layout_.layer_num();
  const int64_t row_bytes = layout_.row_bytes();
  const int64_t chunk = options().offload_chunk_page_num;
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  // Validate the whole copy before writing anything (the reference asserts per chunk).
  if (copy.row_bytes != row_bytes) {
    return InvalidArgument("LoadCpuCopy: the copy has " + Str(copy.row_bytes) +
                           "-byte rows but this pool's rows are " + Str(row_bytes) +
                           " bytes; load a copy made by a pool of the same layout");
  }
  if (static_cast<int64_t>(copy.layers.size()) != num_layers) {
    return InvalidArgument("LoadCpuCopy: the copy has " +
                           Str(static_cast<int64_t>(copy.layers.size())) +
                           " layers but the pool has " + Str(num_layers));
  }
  for (int64_t l = 0; l < num_layers; ++l) {
    if (static_cast<int64_t>(copy.layers[l].size()) != num_chunks) {
      return InvalidArgument("LoadCpuCopy: layer " + Str(l) + " has " +
                             Str(static_cast<int64_t>(copy.layers[l].size())) + " chunks but " +
                             Str(n) + " indices in chunks of " + Str(chunk) + " need " +
                             Str(num_chunks));
    }
    for (int64_t c = 0; c < num_chunks; ++c) {
      const KvCpuChunk& ch = copy.layers[l][c];
      const int64_t m = std::min(chunk, n - c * chunk);
      const auto want = static_cast<size_t>(m * row_bytes);
      if (ch.num_rows != m || ch.k.size() != want || ch.v.size() != want) {
        return InvalidArgument(
            "LoadCpuCopy: layer " + Str(l) + " chunk " + Str(c) + " holds " + Str(ch.num_rows) +
            " rows (" + Str(static_cast<int64_t>(ch.k.size())) + " K bytes, " +
            Str(static_cast<int64_t>(ch.v.size())) + " V bytes) but its " + Str(m) +
            " indices need " + Str(m) + " rows of " + Str(row_bytes) + " bytes each");
      }
    }
  }

  ScopedDevice scoped(impl_->cuda() ? impl_->device : -1);
  KVT_RETURN_IF_ERROR(scoped.status());
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t start = c * chunk;
    const int64_t m = std::min(chunk, n - start);
    const int64_t block = m * row_bytes;
    CallScratch scratch(impl_->kind, impl_->device);
    KVT_ASSIGN_OR_RETURN(const int32_t* pages, scratch.Table(indices.subspan(start, m)));
    KVT_ASSIGN_OR_RETURN(void* staging, scratch.Bytes(2 * num_layers * block));
    auto* base = static_cast<uint8_t*>(staging);
    for (int64_t l = 0; l < num_layers; ++l) {
      const KvCpuChunk& ch = copy.layers[l][c];
      KVT_RETURN_IF_ERROR(
          CopyBytes(base + l * block, impl_->kind, ch.k.data(), MemoryKind::kHost, block));
      KVT_RETURN_IF_ERROR(CopyBytes(base + (num_layers + l) * block, impl_->kind, ch.v.data(),
                                    MemoryKind::kHost, block));
    }
    KVT_RETURN_IF_ERROR(impl_->UnpackAll(layout_, pages, m, staging));
    KVT_RETURN_IF_ERROR(impl_->Sync());
  }
  return OkStatus();
}

Status KvPool::ClearKvBuffers() {
  for (const auto* side : {&impl_->k_memory, &impl_->v_memory}) {
    for (const auto& mem : *side) KVT_RETURN_IF_ERROR(mem->Zero());
  }
  return OkStatus();
}

}  // namespace kvt::pool
