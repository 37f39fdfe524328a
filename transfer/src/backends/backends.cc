// The backend registry: one table of the backends this build has (name, description,
// capabilities, default options, factory). Adding a backend: its folder and CMake target under
// backends/, its options header under kvt/transfer/backends/, an alternative in BackendConfig
// and a row here.
#include "kvt/transfer/backends.h"

#include <type_traits>

#include "backends/cuda_ipc/cuda_ipc_backend.h"
#include "backends/loopback/loopback_backend.h"
#include "backends/nccl/nccl_backend.h"
#include "backends/ucx/ucx_backend.h"

namespace kvt::transfer {
namespace {

using Factory = StatusOr<std::unique_ptr<Backend>> (*)(const BackendConfig&);

struct BackendEntry {
  BackendInfo info;
  BackendConfig defaults;  // the alternative names the entry's options type
  Factory create;
};

// The factory of the backend whose options are `Options`: unwraps them and calls `create`.
template <typename Options, StatusOr<std::unique_ptr<Backend>> (*create)(const Options&)>
StatusOr<std::unique_ptr<Backend>> Create(const BackendConfig& config) {
  return create(std::get<Options>(config));
}

constexpr BackendCapabilities Capabilities(std::initializer_list<bool BackendCapabilities::*> set) {
  BackendCapabilities caps;
  for (bool BackendCapabilities::*flag : set) caps.*flag = true;
  return caps;
}

using C = BackendCapabilities;

// Priority order: the order BackendNames() lists them in.
const BackendEntry kBackends[] = {
    {{"ucx",
      "UCX RMA puts (RDMA, TCP, shared memory) within and across hosts; CUDA pools registered "
      "directly when UCX handles CUDA memory, else staged through pinned bounce buffers",
      Capabilities({&C::host_memory, &C::cuda_memory, &C::inter_process, &C::inter_node,
                    &C::page_writes, &C::notifies_completion})},
     UcxOptions{},
     &Create<UcxOptions, &CreateUcxBackend>},
    {{"cuda_ipc",
      "CUDA IPC within one host: one gather/scatter kernel per layer batch writes into the "
      "peer's pool over NVLink or PCIe",
      Capabilities({&C::cuda_memory, &C::inter_process, &C::page_writes, &C::notifies_completion})},
     CudaIpcOptions{},
     &Create<CudaIpcOptions, &CreateCudaIpcBackend>},
    {{"nccl",
      "NCCL point-to-point sends of packed pages between GPUs within and across hosts; the "
      "receiving side takes part in every transfer",
      Capabilities(
          {&C::cuda_memory, &C::inter_process, &C::inter_node, &C::page_writes, &C::two_sided})},
     NcclOptions{},
     &Create<NcclOptions, &CreateNcclBackend>},
    {{"loopback", "in-process copies between backends of one process, host memory only (tests)",
      Capabilities({&C::host_memory, &C::page_writes})},
     LoopbackOptions{},
     &Create<LoopbackOptions, &CreateLoopbackBackend>},
};

static_assert(std::size(kBackends) == std::variant_size_v<BackendConfig>,
              "every BackendConfig alternative needs a row in kBackends");

const BackendEntry& EntryFor(const BackendConfig& config) {
  for (const BackendEntry& entry : kBackends) {
    if (entry.defaults.index() == config.index()) return entry;
  }
  return kBackends[0];  // unreachable: the static_assert above and the rows cover every index
}

std::vector<BackendInfo> InfosOf() {
  std::vector<BackendInfo> infos;
  for (const BackendEntry& entry : kBackends) infos.push_back(entry.info);
  return infos;
}

}  // namespace

std::span<const BackendInfo> RegisteredBackends() {
  static const std::vector<BackendInfo> infos = InfosOf();
  return infos;
}

std::vector<std::string> BackendNames() {
  std::vector<std::string> names;
  for (const BackendEntry& entry : kBackends) names.emplace_back(entry.info.name);
  return names;
}

std::string_view BackendName(const BackendConfig& config) { return EntryFor(config).info.name; }

StatusOr<BackendConfig> DefaultBackendConfig(std::string_view name) {
  for (const BackendEntry& entry : kBackends) {
    if (entry.info.name == name) return entry.defaults;
  }
  std::string known;
  for (const BackendEntry& entry : kBackends) {
    known += (known.empty() ? "" : ", ") + std::string(entry.info.name);
  }
  return InvalidArgument("unknown backend '" + std::string(name) + "'; this build has " + known);
}

StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendConfig& config) {
  return EntryFor(config).create(config);
}

StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name) {
  KVT_ASSIGN_OR_RETURN(BackendConfig config, DefaultBackendConfig(name));
  return CreateBackend(config);
}

namespace {

class BackendAllocator final : public pool::HostAllocator {
 public:
  explicit BackendAllocator(std::shared_ptr<Backend> backend) : backend_(std::move(backend)) {}
  StatusOr<void*> Allocate(int64_t bytes) override {
    if (bytes <= 0) return InvalidArgument("allocation of " + std::to_string(bytes) + " bytes");
    return backend_->AllocateHost(static_cast<size_t>(bytes));
  }
  void Free(void* block, int64_t) override { backend_->FreeHost(block); }
  std::string_view name() const override { return backend_->Name(); }

 private:
  const std::shared_ptr<Backend> backend_;
};

}  // namespace

std::shared_ptr<pool::HostAllocator> BackendHostAllocator(std::shared_ptr<Backend> backend) {
  if (!backend) return nullptr;
  // Probe with one page: backends without an allocator answer Unimplemented.
  StatusOr<void*> probe = backend->AllocateHost(4096);
  if (!probe.ok()) return nullptr;
  backend->FreeHost(*probe);
  return std::make_shared<BackendAllocator>(std::move(backend));
}

}  // namespace kvt::transfer
