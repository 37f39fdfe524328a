#include "engine/layout_codec.h"

#include "control/protocol.h"

namespace kvt::transfer {

namespace {

v1::KvShape ToProtoShape(KvShape shape) {
  return shape == KvShape::kLatent ? v1::KV_SHAPE_LATENT : v1::KV_SHAPE_KEY_VALUE;
}

const char* ShapeName(v1::KvShape shape) {
  switch (shape) {
    case v1::KV_SHAPE_KEY_VALUE:
      return "key_value";
    case v1::KV_SHAPE_LATENT:
      return "latent";
    default:
      return "unspecified";
  }
}

uint64_t ProtoItemSize(v1::DType dtype) {
  StatusOr<DType> d = control::FromProtoDType(dtype);
  return d.ok() ? static_cast<uint64_t>(ItemSize(*d)) : 0;
}

// The groups a layout describes; a layout without groups (a protocol 2 sender's) is one
// key_value group of its top-level fields.
std::vector<v1::KvGroup> GroupsOf(const v1::Layout& layout) {
  if (layout.groups_size() > 0) return {layout.groups().begin(), layout.groups().end()};
  v1::KvGroup g;
  g.set_shape(v1::KV_SHAPE_KEY_VALUE);
  g.set_num_layers(layout.num_layers());
  g.set_head_num(layout.head_num());
  g.set_head_dim(layout.head_dim());
  g.set_dtype(layout.dtype());
  g.set_page_bytes(uint64_t{layout.page_size()} * layout.head_num() * layout.head_dim() *
                   ProtoItemSize(layout.dtype()));
  return {g};
}

}  // namespace

StatusOr<v1::Layout> LayoutToProto(const TransferLayout& t) {
  if (t.groups.empty()) return InvalidArgument("the layout has no KV groups");
  if (t.tp_size == 0 || t.tp_rank >= t.tp_size) {
    return InvalidArgument("tp_rank=" + std::to_string(t.tp_rank) +
                           " must be below tp_size=" + std::to_string(t.tp_size));
  }
  v1::Layout layout;
  const KvGroup& target = t.groups.front();
  KVT_ASSIGN_OR_RETURN(v1::DType dtype, control::ToProtoDType(target.dtype));
  layout.set_num_layers(static_cast<uint32_t>(t.num_layers()));
  layout.set_page_size(t.page_size);
  layout.set_dtype(dtype);
  layout.set_head_num(target.head_num);
  layout.set_head_dim(target.head_dim);
  layout.set_tp_rank(t.tp_rank);
  layout.set_tp_size(t.tp_size);
  layout.set_num_pages(t.num_pages());
  layout.set_num_tokens(t.num_pages() > 0 ? (t.num_pages() - 1) * t.page_size : 0);
  layout.set_total_kv_heads(t.total_kv_heads);
  for (size_t g = 0; g < t.groups.size(); ++g) {
    const KvGroup& group = t.groups[g];
    v1::KvGroup* out = layout.add_groups();
    out->set_shape(ToProtoShape(group.shape));
    out->set_num_layers(group.num_layers);
    out->set_head_num(group.head_num);
    out->set_head_dim(group.head_dim);
    KVT_ASSIGN_OR_RETURN(v1::DType group_dtype, control::ToProtoDType(group.dtype));
    out->set_dtype(group_dtype);
    out->set_page_bytes(t.page_bytes(g));
  }
  for (const BufferInfo& aux : t.aux) layout.add_aux_slot_bytes(aux.item_len);
  layout.set_aux_slots(t.num_aux_slots());
  return layout;
}

std::vector<LocalRegion> LocalRegionsOf(const TransferLayout& layout,
                                        std::span<const TransferLayout::FlatBuffer> buffers) {
  const bool cuda = layout.device >= 0;
  std::vector<LocalRegion> regions;
  regions.reserve(buffers.size());
  for (const TransferLayout::FlatBuffer& b : buffers) {
    LocalRegion r;
    r.base = b.info.ptr;
    r.length = b.info.length;
    r.item_len = b.info.item_len;
    r.kind = cuda ? MemoryKind::kCuda : MemoryKind::kHost;
    r.device = cuda ? layout.device : -1;
    r.layer = b.layer;
    regions.push_back(r);
  }
  return regions;
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
  auto compare_text = [&](const std::string& field, std::string_view a, std::string_view b) {
    if (a == b) return;
    diffs += (diffs.empty() ? "" : "; ") + field + " " + std::string(our_role) + "=" +
             std::string(a) + " " + std::string(their_role) + "=" + std::string(b);
  };
  compare("num_layers", ours.num_layers(), theirs.num_layers());
  compare("page_size", ours.page_size(), theirs.page_size());
  const std::vector<v1::KvGroup> our_groups = GroupsOf(ours);
  const std::vector<v1::KvGroup> their_groups = GroupsOf(theirs);
  const bool same_tp = ours.tp_size() == theirs.tp_size();
  compare("KV groups (target model, then draft models)", our_groups.size(), their_groups.size());
  for (size_t g = 0; g < std::min(our_groups.size(), their_groups.size()); ++g) {
    const v1::KvGroup& a = our_groups[g];
    const v1::KvGroup& b = their_groups[g];
    const std::string p = g == 0 ? "" : "group " + std::to_string(g) + " ";
    compare_text(p + "shape", ShapeName(a.shape()), ShapeName(b.shape()));
    if (g > 0 || our_groups.size() > 1 || their_groups.size() > 1) {
      compare((p + "num_layers").c_str(), a.num_layers(), b.num_layers());
    }
    compare_text(p + "dtype", v1::DType_Name(a.dtype()), v1::DType_Name(b.dtype()));
    compare((p + "head_dim").c_str(), a.head_dim(), b.head_dim());
    if (same_tp) {
      compare((p + "head_num").c_str(), a.head_num(), b.head_num());
      compare((p + "page_bytes").c_str(), a.page_bytes(), b.page_bytes());
    }
  }
  {
    auto list = [](const v1::Layout& l) {
      std::string text = "[";
      for (int i = 0; i < l.aux_slot_bytes_size(); ++i) {
        text += (i == 0 ? "" : ", ") + std::to_string(l.aux_slot_bytes(i));
      }
      return text + "]";
    };
    compare_text("aux_slot_bytes", list(ours), list(theirs));
  }
  if (same_tp) {
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
