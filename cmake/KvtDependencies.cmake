# Finds every dependency kvt builds against. tools/setup.sh installs the Debian packages.
# cmake/kvtConfig.cmake.in finds again, for users of the installed package, those that kvt's
# exported targets name: keep the two in step.
set(KVT_CUDA_TOOLKIT_MIN_VERSION 12.0)
set(KVT_BOOST_MIN_VERSION 1.74)
find_package(Threads REQUIRED)
find_package(CUDAToolkit ${KVT_CUDA_TOOLKIT_MIN_VERSION} REQUIRED)
# The CUDA runtime kvt::kernels links: static into static libraries (one copy in the program),
# shared for shared libraries (several shared objects must not each carry their own copy).
if(BUILD_SHARED_LIBS)
  set(KVT_CUDA_RUNTIME CUDA::cudart)
else()
  set(KVT_CUDA_RUNTIME CUDA::cudart_static)
endif()

# NCCL ships inside the CUDA toolkit's folders on our machines; a system NCCL works too.
find_path(KVT_NCCL_INCLUDE_DIR nccl.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME PATH_SUFFIXES include)
find_library(KVT_NCCL_LIBRARY nccl
  HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_HOME PATH_SUFFIXES lib lib64)
if(NOT KVT_NCCL_INCLUDE_DIR OR NOT KVT_NCCL_LIBRARY)
  message(FATAL_ERROR "NCCL not found: looked beside CUDA (${CUDAToolkit_LIBRARY_DIR}) and in "
                      "NCCL_HOME. Install NCCL or set NCCL_HOME.")
endif()
add_library(kvt::nccl INTERFACE IMPORTED)
target_include_directories(kvt::nccl INTERFACE ${KVT_NCCL_INCLUDE_DIR})
target_link_libraries(kvt::nccl INTERFACE ${KVT_NCCL_LIBRARY})

find_package(PkgConfig REQUIRED)
pkg_check_modules(UCX REQUIRED IMPORTED_TARGET ucx)

find_package(Boost ${KVT_BOOST_MIN_VERSION} REQUIRED)
find_package(Protobuf REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 CONFIG QUIET)
if(NOT CLI11_FOUND)
  find_path(KVT_CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  target_include_directories(CLI11::CLI11 INTERFACE ${KVT_CLI11_INCLUDE_DIR})
endif()
find_package(nlohmann_json 3 REQUIRED)
find_path(KVT_XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_library(KVT_XXHASH_LIBRARY xxhash REQUIRED)
add_library(kvt::xxhash INTERFACE IMPORTED)
target_include_directories(kvt::xxhash INTERFACE ${KVT_XXHASH_INCLUDE_DIR})
target_link_libraries(kvt::xxhash INTERFACE ${KVT_XXHASH_LIBRARY})

if(KVT_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
