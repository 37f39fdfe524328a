// TransferLayout: what a transfer engine moves, described from whatever owns the memory.
//
// A serving engine owns its KV memory (torch tensors on a GPU or on the host) and describes it
// the way the reference pool does (get_contiguous_buf_infos): buffer base pointers, buffer
// bytes and page bytes, K of every layer then V of every layer, page p of buffer i at
// ptrs[i] + p * item_lens[i]. A TransferLayout holds exactly that, grouped by model:
//
//   groups[0]      the target model's buffers (KvShape::kKeyValue: K of layers 0..L-1, then V;
//                  KvShape::kLatent: one buffer per layer, as MLA-style pools keep)
//   groups[1..]    draft models' buffers, appended after the target's (the start_idx
//                  convention of get_layerwise_buf_info_offsets: start_idx = the target's buffer
//                  count), moved with the same request
//   aux            per-request metadata slots (SGLang's aux_data_ptrs / lens / item_lens: first
//                  output tokens, logprobs, hidden states): slot s of aux[i] is item_len bytes at
//                  ptr + s * item_len. Moved after the last KV layer, visible at the decode side
//                  before the request is reported done. Host memory.
//
// Transfer layers count group by group: the target's layers are 0..L0-1, the first draft
// model's L0..L0+L1-1, and so on. LayersReady and Receive's layer range use these numbers.
//
// The layout travels in the engines' hello (and in registry entries) without its pointers; two
// engines exchange pages only when page size, groups (shape, layers, heads, head_dim, dtype,
// page bytes), aux slot bytes and TP placement agree, and a mismatch names every differing
// field with both values.
//
// A value type: copy it freely; thread-safe as any value. Validate() checks it against the
// process's memory (it reads no byte of it).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvt/common/dtype.h"
#include "kvt/common/status.h"

namespace kvt::pool {
class KvPool;
}

namespace kvt::transfer {

// How a model keeps its KV: two buffers per layer (K, V) or one (an MLA-style latent buffer).
enum class KvShape : uint8_t { kKeyValue = 0, kLatent = 1 };
// "key_value", "latent".
const char* KvShapeName(KvShape shape);

// One buffer as the reference pool's buffer infos give it.
struct BufferInfo {
  uint64_t ptr = 0;       // base address (host, or CUDA memory of TransferLayout::device)
  uint64_t length = 0;    // bytes of the whole buffer: a multiple of item_len
  uint64_t item_len = 0;  // bytes of one page of this buffer (aux: of one slot)
};

// One model's KV buffers.
struct KvGroup {
  KvShape shape = KvShape::kKeyValue;
  uint32_t num_layers = 0;
  uint32_t head_num = 0;  // KV heads held by this rank (kLatent: 1)
  uint32_t head_dim = 0;  // elements per head (kLatent: the latent width)
  DType dtype = DType::kBF16;
  // kKeyValue: 2 * num_layers buffers, K of layers 0..L-1 then V; kLatent: num_layers buffers.
  // Every buffer's item_len is page_size * head_num * unit bytes (head_dim * itemsize).
  std::vector<BufferInfo> buffers;

  uint32_t buffers_per_layer() const { return shape == KvShape::kKeyValue ? 2 : 1; }
  // head_dim * itemsize: what get_contiguous_buf_unit_lens gives per buffer.
  uint64_t unit_bytes() const;
};

struct TransferLayout {
  uint32_t page_size = 0;       // tokens per page
  uint32_t tp_rank = 0;         // this rank, < tp_size
  uint32_t tp_size = 1;         // the model's tensor-parallel size
  uint32_t total_kv_heads = 0;  // KV heads of the whole model before sharding; 0: not given
  int32_t device = -1;          // CUDA ordinal of every KV buffer; -1: host memory
  std::vector<KvGroup> groups;  // [0] the target model, then draft models
  std::vector<BufferInfo> aux;  // per-request slots (host memory); may be empty

  // Sum of the groups' layers (the transfer layers).
  int32_t num_layers() const;
  // Buffers of every group, in order (the reference order, groups appended).
  size_t num_buffers() const;
  // Pages every KV buffer holds (the fewest of any buffer), the dummy page 0 included.
  uint64_t num_pages() const;
  // Slots every aux buffer holds (the fewest of any); 0 without aux buffers.
  uint64_t num_aux_slots() const;
  // page_size * head_num * unit bytes of groups[group].
  uint64_t page_bytes(size_t group) const;

  // The KV buffers in buffer order, with the transfer layer of each.
  struct FlatBuffer {
    BufferInfo info;
    int32_t layer = 0;  // transfer layer
    uint32_t group = 0;
  };
  std::vector<FlatBuffer> Flatten() const;

  // Checks the description and the memory it names; the first error names the field, the
  // buffer and the value, and what to do. Checked: page size, groups (shape, layers, heads,
  // head_dim, dtype, buffer count for the shape), each buffer (length a non-zero multiple of
  // item_len, item_len = page_size * head_num * head_dim * itemsize, at least two pages),
  // buffers overlapping each other, TP rank and size, and the memory: every KV buffer lies in
  // CUDA memory of `device` (one allocation) or, with device = -1, in mapped host memory; aux
  // buffers in mapped host memory.
  Status Validate() const;

  // The layout of kvt's own pool, through its buffer infos: the pool's guards still decide
  // (slab-aliased and state-layer pools are refused with the pool's message).
  static StatusOr<TransferLayout> FromPool(const pool::KvPool& pool, uint32_t tp_rank = 0,
                                           uint32_t tp_size = 1);

  // What FromBufInfos needs besides the buffer infos.
  struct BufInfoOptions {
    uint32_t page_size = 0;
    DType dtype = DType::kBF16;
    uint32_t head_num = 0;  // KV heads of this rank (kLatent: 1)
    uint32_t head_dim = 0;
    KvShape shape = KvShape::kKeyValue;
    int32_t device = -1;  // CUDA ordinal of the buffers; -1: host memory
    uint32_t tp_rank = 0;
    uint32_t tp_size = 1;
    uint32_t total_kv_heads = 0;
    // Buffers [0, target_buffers) are the target model's; the rest, when any, one draft model's
    // (start_idx = target_buffers). 0: every buffer is the target's.
    size_t target_buffers = 0;
    // The draft model's heads and head_dim when they differ from the target's (0: the same).
    uint32_t draft_head_num = 0;
    uint32_t draft_head_dim = 0;
    // get_contiguous_buf_unit_lens(), checked against head_dim * itemsize when given.
    std::span<const int64_t> unit_lens;
  };
  // From get_contiguous_buf_infos() (and the aux buffers' ptrs / lens / item_lens, which may be
  // empty). Validates the result (Validate).
  static StatusOr<TransferLayout> FromBufInfos(std::span<const uint64_t> ptrs,
                                               std::span<const int64_t> lens,
                                               std::span<const int64_t> item_lens,
                                               const BufInfoOptions& options,
                                               std::span<const uint64_t> aux_ptrs = {},
                                               std::span<const int64_t> aux_lens = {},
                                               std::span<const int64_t> aux_item_lens = {});

  // The model description (everything but pointers) on one line, for logs and errors.
  std::string Describe() const;
};

}  // namespace kvt::transfer
