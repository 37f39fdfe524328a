#include "engine/layout_codec.h"

#include "control/protocol.h"

namespace kvt::transfer {

StatusOr<v1::Layout> LayoutFromPool(const pool::KvPool& pool, uint32_t tp_rank, uint32_t tp_size) {
  const pool::PoolOptions& o = pool.options();
  KVT_ASSIGN_OR_RETURN(v1::DType dtype, control::ToProtoDType(o.dtype));
  if (tp_size == 0 || tp_rank >= tp_size) {
    return InvalidArgument("tp_rank=" + std::to_string(tp_rank) +
                           " must be below tp_size=" + std::to_string(tp_size));
  }
  v1::Layout layout;
  layout.set_num_layers(static_cast<uint32_t>(o.layer_num));
  layout.set_page_size(static_cast<uint32_t>(o.page_size));
  layout.set_dtype(dtype);
  layout.set_head_num(static_cast<uint32_t>(o.head_num));
  layout.set_head_dim(static_cast<uint32_t>(o.head_dim));
  layout.set_tp_rank(tp_rank);
  layout.set_tp_size(tp_size);
  layout.set_num_pages(static_cast<uint64_t>((o.size + o.page_size) / o.page_size));
  layout.set_num_tokens(static_cast<uint64_t>(o.size));
  return layout;
}

v1::PeerInfo MakePeerInfo(const std::string& name, bool prefill, const v1::Layout& layout,
                          const PeerDescriptor& descriptor, std::span<const LocalRegion> regions) {
  v1::PeerInfo info;
  info.set_name(name);
  info.set_role(prefill ? v1::ROLE_PREFILL : v1::ROLE_DECODE);
  *info.mutable_layout() = layout;
  for (size_t i = 0; i < descriptor.regions.size(); ++i) {
    const RemoteRegion& r = descriptor.regions[i];
    v1::MemoryDescriptor* d = info.add_buffers();
    d->set_buffer_index(static_cast<uint32_t>(i));
    d->set_base(r.base);
    d->set_length(r.length);
    d->set_item_len(r.item_len);
    const bool cuda = i < regions.size() && regions[i].kind == MemoryKind::kCuda;
    d->set_kind(cuda ? v1::MEMORY_KIND_CUDA : v1::MEMORY_KIND_HOST);
    d->set_device_id(cuda ? regions[i].device : 0);
    v1::BackendKey* key = d->add_keys();
    key->set_backend(descriptor.backend);
    key->set_blob(r.key);
  }
  v1::BackendEndpoint* endpoint = info.add_endpoints();
  endpoint->set_backend(descriptor.backend);
  endpoint->set_address(descriptor.address);
  return info;
}

StatusOr<PeerDescriptor> DescriptorFromPeerInfo(const v1::PeerInfo& info,
                                                std::string_view backend) {
  PeerDescriptor descriptor;
  descriptor.backend = std::string(backend);
  bool found = false;
  std::string offered;
  for (const v1::BackendEndpoint& e : info.endpoints()) {
    offered += (offered.empty() ? "" : ", ") + e.backend();
    if (e.backend() == backend) {
      descriptor.address = e.address();
      found = true;
    }
  }
  if (!found) {
    return NotFound("peer '" + info.name() + "' offers backends [" + offered + "], not '" +
                    std::string(backend) + "'; run both agents with the same backend");
  }
  for (const v1::MemoryDescriptor& d : info.buffers()) {
    RemoteRegion r{d.base(), d.length(), d.item_len(), {}};
    bool has_key = false;
    for (const v1::BackendKey& k : d.keys()) {
      if (k.backend() == backend) {
        r.key = k.blob();
        has_key = true;
      }
    }
    if (!has_key) {
      return InvalidArgument("peer '" + info.name() + "' buffer " +
                             std::to_string(d.buffer_index()) + " has no key for backend '" +
                             std::string(backend) + "'");
    }
    if (d.buffer_index() != descriptor.regions.size()) {
      return InvalidArgument("peer '" + info.name() + "' lists buffer " +
                             std::to_string(d.buffer_index()) + " at position " +
                             std::to_string(descriptor.regions.size()));
    }
    descriptor.regions.push_back(std::move(r));
  }
  return descriptor;
}

Status CheckCompatible(const v1::Layout& ours, const v1::Layout& theirs, std::string_view our_role,
                       std::string_view their_role) {
  std::string diffs;
  std::string rank_mismatch;
  auto compare = [&](const char* field, uint64_t a, uint64_t b) {
    if (a == b) return;
    diffs += std::string(diffs.empty() ? "" : "; ") + field + " " + std::string(our_role) + "=" +
             std::to_string(a) + " " + std::string(their_role) + "=" + std::to_string(b);
  };
  compare("num_layers", ours.num_layers(), theirs.num_layers());
  compare("page_size", ours.page_size(), theirs.page_size());
  if (ours.dtype() != theirs.dtype()) {
    diffs += std::string(diffs.empty() ? "" : "; ") + "dtype " + std::string(our_role) + "=" +
             v1::DType_Name(ours.dtype()) + " " + std::string(their_role) + "=" +
             v1::DType_Name(theirs.dtype());
  }
  compare("head_dim", ours.head_dim(), theirs.head_dim());
  if (ours.tp_size() == theirs.tp_size()) {
    compare("head_num", ours.head_num(), theirs.head_num());
    if (ours.tp_rank() != theirs.tp_rank()) {
      // Same TP size: each rank holds its own shard of the heads, so only equal ranks move
      // pages into each other; any other pairing would deliver another rank's shard.
      const bool we_decode = our_role == "decode";
      const v1::Layout& decode = we_decode ? ours : theirs;
      const v1::Layout& prefill = we_decode ? theirs : ours;
      rank_mismatch = "tp rank mismatch: decode tp_rank=" + std::to_string(decode.tp_rank()) +
                      " of tp_size=" + std::to_string(decode.tp_size()) +
                      ", prefill tp_rank=" + std::to_string(prefill.tp_rank()) +
                      " of tp_size=" + std::to_string(prefill.tp_size()) +
                      "; decode rank r pairs with prefill rank r when the TP sizes match";
    }
  } else {
    diffs += std::string(diffs.empty() ? "" : "; ") + "tp_size " + std::string(our_role) + "=" +
             std::to_string(ours.tp_size()) + " " + std::string(their_role) + "=" +
             std::to_string(theirs.tp_size()) +
             " (transfers between different TP sizes are not implemented yet)";
  }
  if (diffs.empty() && rank_mismatch.empty()) return OkStatus();
  if (diffs.empty()) return FailedPrecondition(rank_mismatch);
  return FailedPrecondition("layout mismatch: " + diffs +
                            "; both agents must serve the same model shard layout" +
                            (rank_mismatch.empty() ? "" : "; " + rank_mismatch));
}

}  // namespace kvt::transfer
