// Argument checks shared by the CUDA and CPU entry points of every kernel.
#include "validate.h"

#include <algorithm>
#include <limits>
#include <string>

#include "kvt/common/dtype.h"

namespace kvt::kernels::internal {
namespace {

std::string Num(int64_t v) { return std::to_string(v); }

}  // namespace

Status NonNegative(const char* fn, const char* name, int64_t value) {
  if (value < 0) {
    return InvalidArgument(std::string(fn) + ": " + name + " is " + Num(value) +
                           "; it must be >= 0");
  }
  return OkStatus();
}

namespace {

// A page's byte range [offset, offset + bytes) must stay inside one page stride whenever more
// than one page (or an explicit page index) is addressed; otherwise items would overlap.
Status RangeInsideStride(const char* fn, const char* offset_name, int64_t offset, int64_t bytes,
                         const char* stride_name, int64_t stride) {
  if (offset > std::numeric_limits<int64_t>::max() - bytes || offset + bytes > stride) {
    return InvalidArgument(std::string(fn) + ": " + offset_name + " (" + Num(offset) +
                           ") + bytes (" + Num(bytes) + ") exceeds " + stride_name + " (" +
                           Num(stride) + "); each copied range must lie within one page");
  }
  return OkStatus();
}

}  // namespace

Status ValidatePageCopy(const PageCopyArgs& a, const char* fn) {
  KVT_RETURN_IF_ERROR(NonNegative(fn, "num_buffers", a.num_buffers));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "num_pages", a.num_pages));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "bytes", a.bytes));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "src_page_stride", a.src_page_stride));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "dst_page_stride", a.dst_page_stride));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "src_offset", a.src_offset));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "dst_offset", a.dst_offset));
  if (a.num_buffers == 0 || a.num_pages == 0 || a.bytes == 0) return OkStatus();
  if (a.src_bases == nullptr) {
    return InvalidArgument(std::string(fn) +
                           ": src_bases is null with num_buffers = " + Num(a.num_buffers));
  }
  if (a.dst_bases == nullptr) {
    return InvalidArgument(std::string(fn) +
                           ": dst_bases is null with num_buffers = " + Num(a.num_buffers));
  }
  if (a.num_pages > 1 || a.src_pages != nullptr) {
    KVT_RETURN_IF_ERROR(RangeInsideStride(fn, "src_offset", a.src_offset, a.bytes,
                                          "src_page_stride", a.src_page_stride));
  }
  if (a.num_pages > 1 || a.dst_pages != nullptr) {
    KVT_RETURN_IF_ERROR(RangeInsideStride(fn, "dst_offset", a.dst_offset, a.bytes,
                                          "dst_page_stride", a.dst_page_stride));
  }
  return OkStatus();
}

Status ValidatePack(const PackArgs& a, const char* fn) {
  KVT_RETURN_IF_ERROR(NonNegative(fn, "num_buffers", a.num_buffers));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "num_pages", a.num_pages));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "bytes", a.bytes));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "page_stride", a.page_stride));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "offset", a.offset));
  if (a.num_buffers == 0 || a.num_pages == 0 || a.bytes == 0) return OkStatus();
  if (a.bases == nullptr) {
    return InvalidArgument(std::string(fn) +
                           ": bases is null with num_buffers = " + Num(a.num_buffers));
  }
  if (a.staging == nullptr) {
    return InvalidArgument(std::string(fn) + ": staging is null; it must hold num_buffers (" +
                           Num(a.num_buffers) + ") * num_pages (" + Num(a.num_pages) +
                           ") * bytes (" + Num(a.bytes) + ") bytes");
  }
  if (a.num_pages > std::numeric_limits<int64_t>::max() / a.num_buffers / a.bytes) {
    return InvalidArgument(std::string(fn) + ": staging size num_buffers (" + Num(a.num_buffers) +
                           ") * num_pages (" + Num(a.num_pages) + ") * bytes (" + Num(a.bytes) +
                           ") overflows int64");
  }
  if (a.num_pages > 1 || a.pages != nullptr) {
    KVT_RETURN_IF_ERROR(
        RangeInsideStride(fn, "offset", a.offset, a.bytes, "page_stride", a.page_stride));
  }
  return OkStatus();
}

namespace {

bool IsStoreSource(DType d) { return d == DType::kBF16 || d == DType::kFP16 || d == DType::kFP32; }

Status Null(const char* fn, const char* name, const std::string& context) {
  return InvalidArgument(std::string(fn) + ": " + name + " is null" + context);
}

}  // namespace

Status ValidateStore(const StoreArgs& a, const char* fn) {
  KVT_RETURN_IF_ERROR(NonNegative(fn, "num_rows", a.num_rows));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "row_elems", a.row_elems));
  if (a.src_dtype != a.dst_dtype && (!IsStoreSource(a.src_dtype) || !IsPoolDType(a.dst_dtype))) {
    return InvalidArgument(std::string(fn) + ": no conversion from src_dtype " +
                           std::string(DTypeName(a.src_dtype)) + " to dst_dtype " +
                           std::string(DTypeName(a.dst_dtype)) +
                           "; sources are bf16, fp16 or fp32 (or the pool's own dtype), "
                           "destinations a pool dtype");
  }
  if (a.num_rows == 0 || a.row_elems == 0) return OkStatus();
  const int64_t item = std::max(ItemSize(a.src_dtype), ItemSize(a.dst_dtype));
  if (a.row_elems > std::numeric_limits<int64_t>::max() / item) {
    return InvalidArgument(std::string(fn) + ": row_elems (" + Num(a.row_elems) +
                           ") overflows a byte count");
  }
  const std::string ctx = " with num_rows = " + Num(a.num_rows);
  if (a.k_src == nullptr) return Null(fn, "k_src", ctx);
  if (a.v_src == nullptr) return Null(fn, "v_src", ctx);
  if (a.k_dst == nullptr) return Null(fn, "k_dst", ctx);
  if (a.v_dst == nullptr) return Null(fn, "v_dst", ctx);
  if (a.loc == nullptr) return Null(fn, "loc", ctx);
  return OkStatus();
}

Status ValidateTiledCopy(const TiledCopyArgs& a, const char* fn) {
  KVT_RETURN_IF_ERROR(NonNegative(fn, "num_buffers", a.num_buffers));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "num_locs", a.num_locs));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "max_row_bytes", a.max_row_bytes));
  if (a.bytes_per_tile <= 0) {
    return InvalidArgument(std::string(fn) + ": bytes_per_tile is " + Num(a.bytes_per_tile) +
                           "; it must be > 0 (see TileBytesForStride)");
  }
  if (a.num_buffers == 0 || a.num_locs == 0 || a.max_row_bytes == 0) return OkStatus();
  const std::string ctx =
      " with num_buffers = " + Num(a.num_buffers) + " and num_locs = " + Num(a.num_locs);
  if (a.bases == nullptr) return Null(fn, "bases", ctx);
  if (a.row_bytes == nullptr) return Null(fn, "row_bytes", ctx);
  if (a.tgt_loc == nullptr) return Null(fn, "tgt_loc", ctx);
  if (a.src_loc == nullptr) return Null(fn, "src_loc", ctx);
  return OkStatus();
}

Status ValidatePattern(const PatternArgs& a, const char* fn) {
  KVT_RETURN_IF_ERROR(NonNegative(fn, "num_layers", a.num_layers));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "num_tokens", a.num_tokens));
  KVT_RETURN_IF_ERROR(NonNegative(fn, "row_bytes", a.row_bytes));
  if (a.num_layers == 0 || a.num_tokens == 0 || a.row_bytes == 0) return OkStatus();
  if (a.page_size <= 0) {
    return InvalidArgument(std::string(fn) + ": page_size is " + Num(a.page_size) +
                           "; it must be > 0 tokens");
  }
  const std::string ctx =
      " with num_layers = " + Num(a.num_layers) + " and num_tokens = " + Num(a.num_tokens);
  if (a.k_bases == nullptr) return Null(fn, "k_bases", ctx);
  if (a.v_bases == nullptr) return Null(fn, "v_bases", ctx);
  if (a.pages == nullptr) return Null(fn, "pages", ctx);
  // The verifier linearises (layer, kv, token, byte) into 64 bits.
  const double positions =
      2.0 * a.num_layers * static_cast<double>(a.num_tokens) * static_cast<double>(a.row_bytes);
  if (positions >= 9.0e18) {
    return InvalidArgument(std::string(fn) + ": 2 * num_layers * num_tokens * row_bytes (" +
                           std::to_string(positions) + ") exceeds 2^63 bytes");
  }
  return OkStatus();
}

}  // namespace kvt::kernels::internal
