# The installed package: libraries, public headers, a CMake package that find_package(kvt)
# finds (kvtConfig.cmake, kvtConfigVersion.cmake, kvtTargets*.cmake) and kvt.pc for pkg-config,
# all relocatable with their prefix. Installed: kvt::common, kvt::kernels, kvt::pool,
# kvt::transfer and the libraries kvt::transfer links (kvt::transfer_core, the backends,
# kvt::proto), static or, with BUILD_SHARED_LIBS=ON, shared; never kvt::transfer_internal, its
# private headers, generated protobuf headers, kvt's logging headers or anything of tests/.
# The tools install themselves (tools/*/CMakeLists.txt) into bin/.
#
# The target kvt_package builds everything `cmake --install` installs (libraries and tools) and
# nothing else, e.g. for a shared-library tree:
#   cmake -S . -B build-shared -G Ninja -DBUILD_SHARED_LIBS=ON
#   cmake --build build-shared --target kvt_package
#   ctest --test-dir build-shared -L package
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

get_property(kvt_targets GLOBAL PROPERTY KVT_EXPORTED_TARGETS)
foreach(target ${kvt_targets})
  get_target_property(dir ${target} SOURCE_DIR)
  cmake_path(IS_PREFIX PROJECT_SOURCE_DIR "${dir}" NORMALIZE inside)
  file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${dir})
  if(NOT inside OR rel MATCHES "^(tests|tools)(/|$)")
    message(FATAL_ERROR "${target} (from ${dir}) is marked for installation, but only the "
                        "libraries of common/, kernels/, pool/, proto/ and transfer/ are installed; "
                        "define test and tool libraries with add_library, not kvt_library")
  endif()
endforeach()

install(TARGETS ${kvt_targets} EXPORT kvtTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
# kvt's logging headers (kvt/common/log.h, log_level.h) are spdlog's API and serve kvt's own
# components and tools; the installed headers include only kvt's own headers, the standard
# library and CUDA's runtime API (tools/ci/public_headers.sh checks both).
set(KVT_INTERNAL_HEADERS log.h log_level.h)
set(exclude)
foreach(header ${KVT_INTERNAL_HEADERS})
  list(APPEND exclude PATTERN ${header} EXCLUDE)
endforeach()
foreach(component common kernels pool transfer)
  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/${component}/include)
    install(DIRECTORY ${component}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} ${exclude})
  endif()
endforeach()

set(KVT_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvt)
install(EXPORT kvtTargets NAMESPACE kvt:: DESTINATION ${KVT_CMAKE_INSTALL_DIR})
if(BUILD_SHARED_LIBS)
  set(KVT_SHARED_LIBS ON)
else()
  set(KVT_SHARED_LIBS OFF)
endif()
configure_package_config_file(cmake/kvtConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cmake/kvtConfig.cmake
  INSTALL_DESTINATION ${KVT_CMAKE_INSTALL_DIR})
# 0.x: a new minor version may break the API, so only the same major.minor is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/kvtConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cmake/kvtConfig.cmake
              ${PROJECT_BINARY_DIR}/cmake/kvtConfigVersion.cmake
  DESTINATION ${KVT_CMAKE_INSTALL_DIR})

# kvt.pc. Static libraries must come before the libraries they use: each kvt library is defined
# after the ones it links, so the reverse of the definition order is a valid link order.
set(KVT_PC_LIBS)
foreach(target ${kvt_targets})
  get_target_property(name ${target} OUTPUT_NAME)
  if(NOT name)
    set(name ${target})
  endif()
  list(PREPEND KVT_PC_LIBS -l${name})
endforeach()
list(JOIN KVT_PC_LIBS " " KVT_PC_LIBS)
# The dependencies every link of the static libraries needs: through their own .pc files where
# pkg-config knows them, else by the library file CMake found.
set(KVT_PC_REQUIRES_PRIVATE)
set(KVT_PC_LIBS_PRIVATE)
function(kvt_pc_dependency module)
  pkg_check_modules(KVT_PC_${module} QUIET ${module})
  if(KVT_PC_${module}_FOUND)
    set(KVT_PC_REQUIRES_PRIVATE ${KVT_PC_REQUIRES_PRIVATE} ${module} PARENT_SCOPE)
  else()
    set(KVT_PC_LIBS_PRIVATE ${KVT_PC_LIBS_PRIVATE} ${ARGN} PARENT_SCOPE)
  endif()
endfunction()
kvt_pc_dependency(protobuf ${Protobuf_LIBRARIES})
kvt_pc_dependency(ucx ${UCX_LINK_LIBRARIES})
kvt_pc_dependency(libcrypto ${OPENSSL_CRYPTO_LIBRARY})
kvt_pc_dependency(libxxhash ${KVT_XXHASH_LIBRARY})
list(JOIN KVT_PC_REQUIRES_PRIVATE " " KVT_PC_REQUIRES_PRIVATE)
list(GET CUDAToolkit_INCLUDE_DIRS 0 KVT_PC_CUDA_INCLUDE_DIR)
set(KVT_PC_CUDA_LIBRARY_DIR ${CUDAToolkit_LIBRARY_DIR})
if(BUILD_SHARED_LIBS)
  # The shared libraries carry their own dependencies; kvt::kernels' users get the CUDA runtime
  # (shared, one copy per process) with it.
  set(KVT_PC_LIBRARY_KIND shared)
  string(APPEND KVT_PC_LIBS " -L\${cuda_libdir} -lcudart")
else()
  # cudart_static needs libdl, librt and pthreads (as CMake's CUDA::cudart_static links them).
  set(KVT_PC_LIBRARY_KIND static)
  list(APPEND KVT_PC_LIBS_PRIVATE -L\${cuda_libdir} -lcudart_static -ldl -lrt -pthread)
endif()
list(JOIN KVT_PC_LIBS_PRIVATE " " KVT_PC_LIBS_PRIVATE)
set(KVT_PC_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
file(RELATIVE_PATH KVT_PC_PREFIX_FROM_PCFILEDIR /prefix/${KVT_PC_INSTALL_DIR} /prefix)
string(REGEX REPLACE "/$" "" KVT_PC_PREFIX_FROM_PCFILEDIR "${KVT_PC_PREFIX_FROM_PCFILEDIR}")
configure_file(cmake/kvt.pc.in ${PROJECT_BINARY_DIR}/cmake/kvt.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/cmake/kvt.pc DESTINATION ${KVT_PC_INSTALL_DIR})

# kvt_package: what `cmake --install` installs, built without the tests.
add_custom_target(kvt_package)
add_dependencies(kvt_package ${kvt_targets})
if(KVT_BUILD_TOOLS)
  get_property(tool_dirs DIRECTORY tools PROPERTY SUBDIRECTORIES)
  foreach(dir ${tool_dirs})
    get_property(tool_targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
    foreach(target ${tool_targets})
      get_target_property(type ${target} TYPE)
      if(type STREQUAL "EXECUTABLE" AND target MATCHES "^kvt-")
        add_dependencies(kvt_package ${target})
      endif()
    endforeach()
  endforeach()
endif()
