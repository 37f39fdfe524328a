#include "system_info.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>

#include <cstdio>
#include <iterator>
#include <memory>
#include <string>

#include "kvt/kernels/cuda_util.h"

namespace kvt::tools {
namespace {

using nlohmann::json;

// ucs_memory_type_t names by bit, as UCX 1.16 orders them. Not read from UCX's own
// ucs_memory_type_names[]: that array grew between releases (1.13 here, 1.16 on the GPU
// machines), and a copy-relocated reference to it breaks when the runtime's is larger.
json MemoryTypeNames(uint64_t mask) {
  static constexpr const char* kNames[] = {"host",    "cuda",         "cuda-managed",
                                           "rocm",    "rocm-managed", "rdma",
                                           "ze-host", "ze-device",    "ze-managed"};
  json names = json::array();
  for (int t = 0; t < 64; ++t) {
    if ((mask & (uint64_t{1} << t)) == 0) continue;
    names.push_back(t < static_cast<int>(std::size(kNames)) ? std::string(kNames[t])
                                                            : "type" + std::to_string(t));
  }
  return names;
}

json CudaInfo() {
  json out;
  const kvt::cuda::DeviceCountResult count = kvt::cuda::DeviceCount();
  out["count"] = count.count;
  out["reason"] = count.count == 0 ? json(count.reason) : json(nullptr);
  json devices = json::array();
  for (int i = 0; i < count.count; ++i) {
    cudaDeviceProp prop{};
    const cudaError_t err = cudaGetDeviceProperties(&prop, i);
    if (err != cudaSuccess) {
      devices.push_back({{"index", i}, {"error", cudaGetErrorString(err)}});
      continue;
    }
    devices.push_back(
        {{"index", i},
         {"name", prop.name},
         {"compute_capability", std::to_string(prop.major) + "." + std::to_string(prop.minor)},
         {"memory_bytes", static_cast<uint64_t>(prop.totalGlobalMem)},
         {"sm_count", prop.multiProcessorCount}});
  }
  out["devices"] = devices;
  int runtime = 0;
  if (cudaRuntimeGetVersion(&runtime) == cudaSuccess) out["runtime_version"] = runtime;
  int driver = 0;
  if (cudaDriverGetVersion(&driver) == cudaSuccess) out["driver_version"] = driver;
  cudaGetLastError();
  return out;
}

json NcclInfo() {
  int v = 0;
  const ncclResult_t r = ncclGetVersion(&v);
  if (r != ncclSuccess) return {{"version", nullptr}, {"error", ncclGetErrorString(r)}};
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  const std::string version = std::to_string(v / 10000) + "." + std::to_string((v % 10000) / 100) +
                              "." + std::to_string(v % 100);
  return {{"version", version}, {"code", v}};
}

// Every UCT component, memory domain and transport resource, with what the domain can
// register and access.
json UctTransports(json* md_memory) {
  json transports = json::array();
  uct_component_h* components = nullptr;
  unsigned num_components = 0;
  if (uct_query_components(&components, &num_components) != UCS_OK) return transports;
  for (unsigned c = 0; c < num_components; ++c) {
    uct_component_attr_t attr{};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
    if (uct_component_query(components[c], &attr) != UCS_OK) continue;
    std::unique_ptr<uct_md_resource_desc_t[]> mds(
        new uct_md_resource_desc_t[attr.md_resource_count > 0 ? attr.md_resource_count : 1]);
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
    attr.md_resources = mds.get();
    if (uct_component_query(components[c], &attr) != UCS_OK) continue;
    const std::string component = attr.name;
    for (unsigned m = 0; m < attr.md_resource_count; ++m) {
      const std::string md_name = mds[m].md_name;
      uct_md_config_t* config = nullptr;
      if (uct_md_config_read(components[c], nullptr, nullptr, &config) != UCS_OK) continue;
      uct_md_h md = nullptr;
      const ucs_status_t open = uct_md_open(components[c], md_name.c_str(), config, &md);
      uct_config_release(config);
      if (open != UCS_OK) continue;
      uct_md_attr_t md_attr{};
      if (uct_md_query(md, &md_attr) == UCS_OK) {
        (*md_memory)[md_name] = {{"register", MemoryTypeNames(md_attr.cap.reg_mem_types)},
                                 {"access", MemoryTypeNames(md_attr.cap.access_mem_types)}};
      }
      uct_tl_resource_desc_t* resources = nullptr;
      unsigned num_resources = 0;
      if (uct_md_query_tl_resources(md, &resources, &num_resources) == UCS_OK) {
        for (unsigned r = 0; r < num_resources; ++r) {
          transports.push_back({{"component", component},
                                {"md", md_name},
                                {"transport", resources[r].tl_name},
                                {"device", resources[r].dev_name}});
        }
        uct_release_tl_resource_list(resources);
      }
      uct_md_close(md);
    }
  }
  uct_release_component_list(components);
  return transports;
}

json UcxInfo() {
  json out;
  out["version"] = ucp_get_version_string();
  ucp_config_t* config = nullptr;
  if (ucp_config_read(nullptr, nullptr, &config) == UCS_OK) {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_TAG;
    ucp_context_h context = nullptr;
    const ucs_status_t st = ucp_init(&params, config, &context);
    ucp_config_release(config);
    if (st == UCS_OK) {
      ucp_context_attr_t attr{};
      attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
      if (ucp_context_query(context, &attr) == UCS_OK) {
        out["memory_types"] = MemoryTypeNames(attr.memory_types);
      }
      ucp_cleanup(context);
    } else {
      out["error"] = std::string("ucp_init: ") + ucs_status_string(st);
    }
  }
  json md_memory = json::object();
  out["transports"] = UctTransports(&md_memory);
  out["md_memory_types"] = md_memory;
  return out;
}

}  // namespace

json CollectSystemInfo() {
  return {{"cuda", CudaInfo()}, {"nccl", NcclInfo()}, {"ucx", UcxInfo()}};
}

void PrintSystemInfo(const json& info) {
  const json& cuda = info["cuda"];
  std::printf("CUDA devices: %d\n", cuda["count"].get<int>());
  if (cuda["count"].get<int>() == 0) {
    std::printf("  none: %s\n", cuda["reason"].get<std::string>().c_str());
  }
  for (const json& d : cuda["devices"]) {
    if (d.contains("error")) {
      std::printf("  [%d] error: %s\n", d["index"].get<int>(),
                  d["error"].get<std::string>().c_str());
      continue;
    }
    std::printf(
        "  [%d] %s, compute capability %s, %.1f GiB, %d SMs\n", d["index"].get<int>(),
        d["name"].get<std::string>().c_str(), d["compute_capability"].get<std::string>().c_str(),
        d["memory_bytes"].get<double>() / (1024.0 * 1024.0 * 1024.0), d["sm_count"].get<int>());
  }
  const json& nccl = info["nccl"];
  std::printf("NCCL: %s\n", nccl["version"].is_null()
                                ? ("unavailable: " + nccl["error"].get<std::string>()).c_str()
                                : nccl["version"].get<std::string>().c_str());
  const json& ucx = info["ucx"];
  std::printf("UCX: %s\n", ucx["version"].get<std::string>().c_str());
  if (ucx.contains("memory_types"))
    std::printf("  memory types: %s\n", ucx["memory_types"].dump().c_str());
  if (ucx.contains("error")) std::printf("  %s\n", ucx["error"].get<std::string>().c_str());
  std::printf("  transports:\n");
  for (const json& t : ucx["transports"]) {
    std::printf("    %-10s %-14s %-10s %s\n", t["component"].get<std::string>().c_str(),
                t["md"].get<std::string>().c_str(), t["transport"].get<std::string>().c_str(),
                t["device"].get<std::string>().c_str());
  }
  for (const auto& [md, types] : ucx["md_memory_types"].items()) {
    std::printf("  md %-14s registers %s\n", md.c_str(), types["register"].dump().c_str());
  }
}

}  // namespace kvt::tools
