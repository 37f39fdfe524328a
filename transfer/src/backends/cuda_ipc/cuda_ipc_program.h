// How the cuda_ipc backend turns one write into page-copy launches: a CopyProgram holds the
// tables the kernel reads (source and destination base tables, page index lists), laid out in
// one block that is staged to the device with a single copy, and the launches that read them.
//
// A page write (PageWrite) becomes one launch per distinct (source, destination) page size among
// its buffers (one for a uniform pool) and per unit (units empty: whole pages, one launch). A
// write of copy runs becomes one launch per distinct run length, each run one "buffer" of a
// single page whose bases are the run's own addresses.
//
// Everything is validated here against both sides' buffers, so that no launch can touch memory
// outside them; the functions are pure (no CUDA calls) and run the same on a CPU machine, where
// tests execute the programs with kernels::PageCopyCpu. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

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

// The kernel arguments of `launch` when the program's tables live at `tables_address` (device
// memory for PageCopyCuda, the program's own vector for PageCopyCpu).
kernels::PageCopyArgs LaunchArgs(const CopyProgram& program, const CopyLaunch& launch,
                                 uint64_t tables_address);

// Plans a page write. `local` are our buffers, `remote` the peer's as published, `dst_bases`
// where each peer buffer is reachable from this process (same count as `remote`).
StatusOr<CopyProgram> PlanPageWrite(const PageWrite& write, std::span<const LocalRegion> local,
                                    std::span<const RemoteRegion> remote,
                                    std::span<const uint64_t> dst_bases);

// Plans a write of copy runs (checked with CheckRuns, as every backend does).
StatusOr<CopyProgram> PlanRunWrite(std::span<const CopyRun> runs,
                                   std::span<const LocalRegion> local,
                                   std::span<const RemoteRegion> remote,
                                   std::span<const uint64_t> dst_bases);

}  // namespace kvt::transfer::cuda_ipc
