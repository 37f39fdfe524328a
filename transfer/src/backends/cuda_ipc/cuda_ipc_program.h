// How the cuda_ipc backend turns one write into page-copy launches: a CopyProgram holds the
// tables the kernel reads (source and destination base tables, page index lists), laid out in
// one block that is staged to the device with a single copy, and the launches that read them.
//
// A page write (PageWrite) of layers [a, b) moves the registered buffers of those transfer layers
// (LocalRegion::layer, looked up in the LayerTable that LocalBuffers builds once at Register). It
// becomes one launch per distinct (source, destination) page size among its buffers (one for a
// uniform pool, one per model for a layout with draft or latent groups) and per unit (units
// empty: whole pages, one launch). A
// write of copy runs becomes one launch per distinct run length, each run one "buffer" of a
// single page whose bases are the run's own addresses.
//
// Everything is validated here against both sides' buffers, so that no launch can touch memory
// outside them; the functions are pure (no CUDA calls) and run the same on a CPU machine, where
// tests execute the programs with kernels::PageCopyCpu. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backends/common/layer_table.h"
#include "kvt/common/status.h"
#include "kvt/kernels/kernels.h"
#include "kvt/transfer/backend.h"
#include "kvt/transfer/plan.h"

namespace kvt::transfer::cuda_ipc {

struct CopyLaunch {
  size_t src_bases = 0;  // byte offset of this launch's source base table in the tables
  size_t dst_bases = 0;  // likewise for the destination bases
  int32_t num_buffers = 0;
  bool indexed = false;  // reads the program's page lists (page writes); identity otherwise
  int64_t num_pages = 0;
  int64_t src_page_stride = 0;
  int64_t dst_page_stride = 0;
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t bytes = 0;  // per (buffer, page)
};

struct CopyProgram {
  // The staged block, as 8-byte words so that base tables are aligned wherever it is copied.
  std::vector<uint64_t> tables;
  size_t src_pages = 0;  // byte offsets of the page lists in the tables (indexed launches)
  size_t dst_pages = 0;
  std::vector<CopyLaunch> launches;  // empty: nothing to move
  uint64_t bytes = 0;                // bytes the launches move in all

  size_t table_bytes() const { return tables.size() * sizeof(uint64_t); }
};

// The registered buffers as the planner reads them: the regions and the table of which of them
// each transfer layer moves, built once from their layers. A value type.
class LocalBuffers {
 public:
  LocalBuffers() = default;  // nothing registered
  // InvalidArgument (from LayerTable) when the regions' layers are not 0..n-1 in the layout's
  // order, naming the buffer and its layer.
  static StatusOr<LocalBuffers> Create(std::span<const LocalRegion> regions);

  bool empty() const { return regions_.empty(); }
  size_t size() const { return regions_.size(); }
  const LocalRegion& operator[](size_t i) const { return regions_[i]; }
  std::span<const LocalRegion> regions() const { return regions_; }
  operator std::span<const LocalRegion>() const { return regions_; }  // NOLINT: a view of them
  const LayerTable& layers() const { return layers_; }

 private:
  std::vector<LocalRegion> regions_;
  LayerTable layers_;
};

// The kernel arguments of `launch` when the program's tables live at `tables_address` (device
// memory for PageCopyCuda, the program's own vector for PageCopyCpu).
kernels::PageCopyArgs LaunchArgs(const CopyProgram& program, const CopyLaunch& launch,
                                 uint64_t tables_address);

// Plans a page write. `local` are our buffers, `remote` the peer's as published (index by index
// the same structure), `dst_bases` where each peer buffer is reachable from this process (same
// count as `remote`). The write's num_layers must be the registered layer count and its range
// inside [0, num_layers].
StatusOr<CopyProgram> PlanPageWrite(const PageWrite& write, const LocalBuffers& local,
                                    std::span<const RemoteRegion> remote,
                                    std::span<const uint64_t> dst_bases);

// What page writes of one layer batch take from the two sides' buffers, worked out once: the
// batch's buffers in launch order (sorted by page size), their base tables, the launches' page
// sizes, and the bounds every write's pages and units must respect. A write whose pages and
// units are inside them is planned by copying the base tables, without a pass of checks over
// every buffer (for a one-page write of 64 buffers that pass, over data gone cold between
// requests, was most of its post's time outside CUDA calls; docs/performance.md).
struct BatchShape {
  struct Group {
    size_t begin = 0, end = 0;  // buffers [begin, end) of the launch order
    uint64_t src_item = 0, dst_item = 0;
  };
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  bool usable = false;         // every page size is in (0, 2^63); else the checks report it
  bool same_page_size = true;  // every buffer's pages are as long here as at the peer
  uint64_t src_item_min = 0;   // the shortest page of the batch, on each side
  uint64_t dst_item_min = 0;
  int64_t src_page_end = 0;  // pages [0, end) lie inside every buffer of the batch
  int64_t dst_page_end = 0;
  std::vector<uint64_t> bases;  // the source base table, then the destination's (launch order)
  std::vector<Group> groups;    // one per (source, destination) page size
};

// The shapes of the layer batches written to one peer. The buffers they are built from must not
// change while they are kept: Clear() when either side's registration does. Not thread-safe.
class BatchShapes {
 public:
  // The shape of layers [begin, end) (a range CheckRange accepted), built on first use.
  const BatchShape& Get(const LocalBuffers& local, std::span<const RemoteRegion> remote,
                        std::span<const uint64_t> dst_bases, int32_t begin, int32_t end);
  void Clear() { shapes_.clear(); }
  size_t size() const { return shapes_.size(); }

  // Batches kept at most (one per layer and the whole model are what engines post); past it
  // the oldest half is dropped.
  static constexpr size_t kMaxShapes = 256;

 private:
  std::vector<std::unique_ptr<BatchShape>> shapes_;  // stable addresses for Get's callers
};

// The same, into `program`, whose storage is reused: a poster that keeps one CopyProgram
// allocates nothing per write once warm. Fresh tables cost page faults on every write (glibc
// hands a freed block of tens of KiB back to the kernel), about 85 µs for the 64 KiB tables of an
// 8192-page write where faults are slow. On error `program` holds no launches. With `shapes`
// (kept for this peer) the batch's shape is built once and reused.
Status PlanPageWriteInto(const PageWrite& write, const LocalBuffers& local,
                         std::span<const RemoteRegion> remote, std::span<const uint64_t> dst_bases,
                         CopyProgram& program, BatchShapes* shapes = nullptr);

// Plans a write of copy runs (checked with CheckRuns, as every backend does).
StatusOr<CopyProgram> PlanRunWrite(std::span<const CopyRun> runs,
                                   std::span<const LocalRegion> local,
                                   std::span<const RemoteRegion> remote,
                                   std::span<const uint64_t> dst_bases);

}  // namespace kvt::transfer::cuda_ipc
