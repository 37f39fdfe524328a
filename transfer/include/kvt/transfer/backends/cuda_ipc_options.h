// Options of the cuda_ipc backend (CUDA IPC within one host: one gather/scatter kernel per layer
// batch writes straight into the peer's pool over NVLink or PCIe).
#pragma once

namespace kvt::transfer {

struct CudaIpcOptions {
  // After each write the transfer stream also sets a word in mapped pinned memory
  // (cuda::CompletionWord), which a caller watching a write reads without a driver call
  // (Backend::CompletedHint; the engine's poller spins on it) and which Check reads before it
  // queries the write's event. Off, or where the device cannot run stream memory operations,
  // completion is seen through the event alone.
  bool completion_word = true;
};

}  // namespace kvt::transfer
